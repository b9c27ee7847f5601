"""The HF trainer side of the demo: one GRPO step under a preset, and its mismatch measurements.

Legend: R rollouts in the step, G generated tokens (all rollouts, flat), Gm longest rollout,
N flat batch positions, K top-k, L MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..corrections import aggregate_loss
from ..experts_used import ExpertsUsed
from ..metrics import LOG_CLAMP, k3_terms, mismatch_metrics
from ..presets import Preset
from ..trace import RolloutTrace

HIST_EDGES = [0.0] + [float(x) for x in np.logspace(-8, 1, 28)]
"""|Δ logprob| histogram bins: [0, 1e-8) catches exact agreement, then log-spaced to 10 nats."""


@dataclass
class StepResult:
    loss: float
    metrics: dict[str, Any]


class Policy:
    """An HF causal LM being trained with GRPO (one gradient step per batch of rollouts)."""

    def __init__(self, model_dir: str, preset: Preset, *, lr: float, dtype: str = "float32", seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM

        from ..enablement import enable

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.mr = enable(preset, model=self.model)  # the trainer half of the preset
        self.geometry = self.mr.geometry

    def step(self, traces: Sequence[RolloutTrace], advantages_R: np.ndarray, *, temperature: float | None = None,
             clip_eps: float, pi_old_G: np.ndarray | None = None) -> StepResult:
        """One GRPO update. π_old is the trainer's own recompute unless the estimator provides it.

        `temperature` None scores each rollout at its recorded sampling temperature."""
        used = ExpertsUsed(self.model, self.geometry.moe_layer_ids)
        try:
            with self.mr.train_batch(traces, track_flips=True) as batch:
                logits_BSV = self.model(**batch.model_inputs()).logits
                scores = batch.scores(logits_BSV, temperature)
                logp_G = scores.logprobs_G
                old_G = torch.from_numpy(pi_old_G) if pi_old_G is not None else logp_G.detach().double()
                adv_G = torch.from_numpy(np.repeat(advantages_R, np.diff(batch.plan.gen_offsets_B1)))
                corr = batch.corrections(old_G)  # IS weights of π_old against the engine's rollout
                ratio_G = torch.exp(logp_G.double() - old_G)
                surrogate_G = torch.minimum(ratio_G * adv_G, ratio_G.clamp(1 - clip_eps, 1 + clip_eps) * adv_G)
                loss = aggregate_loss(-batch.to_rows(surrogate_G) * corr.weights_BS, corr.keep_BS)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
        finally:
            used.close()

        metrics = _mismatch(batch, logp_G.detach().double(), used.ids)
        if batch.session is not None:
            flips = batch.session.flips
            metrics["free_route_flip_rate"] = sum(flips.flips.values()) / max(sum(flips.positions.values()), 1)
        else:
            metrics["free_route_flip_rate"] = metrics["route_flip_rate"]
        if pi_old_G is not None:
            metrics["k3_kl_vs_pi_old"] = float(_k3(logp_G.detach().double(), torch.from_numpy(pi_old_G)))
        metrics.update({k: float(v) for k, v in corr.metrics.items() if k.endswith("masked_fraction")})
        metrics["entropy"] = float(scores.entropy_G.detach().double().mean())  # over the kept set when renormalised
        metrics["loss"] = float(loss.detach())
        return StepResult(float(loss.detach()), metrics)


def _k3(train_G: torch.Tensor, ref_G: torch.Tensor) -> torch.Tensor:
    return k3_terms(train_G - ref_G, LOG_CLAMP).mean()  # the rollout_corr/k3_kl formula


def _mismatch(batch, train_G, used_ids: dict[int, torch.Tensor]) -> dict[str, Any]:
    plan, rollout_G = batch.plan, batch.rollout_logprobs
    m = mismatch_metrics(batch.to_rows(train_G), batch.to_rows(rollout_G), batch.row_mask())
    diff_G = (train_G - rollout_G).abs().numpy()
    counts, _ = np.histogram(diff_G, bins=HIST_EDGES)

    # route flips: experts that ran in the trainer vs the engine's, on positions the trace routes
    routed_N = plan.routed_N
    per_layer, flips, total = {}, 0, 0
    for lid in plan.geometry.moe_layer_ids:
        trace_NK = plan.layer_ids(lid)[routed_N]
        ran_NK = used_ids[lid][routed_N]
        differ = (trace_NK.sort(-1).values != ran_NK.sort(-1).values).any(-1)
        per_layer[str(lid)] = 1.0 - float(differ.float().mean())
        flips += int(differ.sum())
        total += int(differ.numel())
    return {
        "route_flip_rate": flips / max(total, 1),
        "route_agreement_per_layer": per_layer,
        "k3_kl": float(m["rollout_corr/k3_kl"]),
        "kl": float(m["rollout_corr/kl"]),
        "max_abs_logprob_diff": float(diff_G.max()),
        "mean_abs_logprob_diff": float(diff_G.mean()),
        "ppl_ratio": float(m["rollout_corr/ppl_ratio"]),
        "chi2_token": float(m["rollout_corr/chi2_token"]),
        "is_ess": float(m["moe_replay/is_ess_token"]),
        "tokens": int(diff_G.size),  # generated tokens: the histogram's total unless some fall outside its bins
        "abs_logprob_diff_hist": {"edges": HIST_EDGES, "counts": counts.tolist()},
    }
