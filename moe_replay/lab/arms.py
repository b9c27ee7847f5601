"""The remedy lab (quick mode): what each remedy does to one step of training on the same rollouts,
under the engine-noise instrument (moe_replay/noise.py; calibrated to GPU figures, never a GPU result).

Engine-agnostic part: the arms (a preset's replay switches plus the remedy's corrections), the
per-arm trainer pass on HF transformers (imported lazily), and the statistics (phantom clipping,
gradient cosine with a bootstrap interval, the estimator's variance ratio). The engine side (rollouts
under noise, π_old re-scoring) is moe_replay/lab/engine.py; benchmarks/lab.py prints the JSON.

Per arm, on the same traces and the same fixed per-rollout advantages A_r (seeded N(0, 1)):
  * phantom_clip_fraction: kept tokens whose PPO ratio π_trainer / π_old leaves [1 - eps, 1 + eps]
    at identical weights (the first minibatch), π_old = the engine's logprobs (the estimator's for a
    multi-sample arm): every such clip is phantom, as no update has happened yet.
  * k3_kl, flip_rate: trainer vs rollout (metrics.mismatch_metrics' rollout_corr/k3_kl and
    moe_replay/route_flip_rate).
  * grad_cos_to_reference: cosine between the arm's gradient of the PPO-clipped surrogate
    Σ_t w_t min(ρ_t A, clip(ρ_t) A) (w: the arm's IS weights, 0 on masked tokens) and the reference
    gradient Σ_t A ∇ log π_trainer (on-policy: the trainer's own free-routing fp32 logprobs, ratio 1,
    nothing clipped or masked), both summed over rollouts; a percentile bootstrap over groups of
    rollouts gives the interval (the Gram matrices of per-group gradients make each resample O(U^2)).

Legend: R rollouts, U bootstrap units (groups of rollouts), G generated tokens (flat), P parameters.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..trace import RolloutTrace

ARMS: dict[str, dict[str, Any]] = {
    "none": {"preset": "none", "corrections": []},
    "tis": {"preset": "none", "corrections": [{"name": "tis", "threshold": 2.0}]},
    "mis": {"preset": "none", "corrections": [{"name": "mis", "threshold": 2.0}]},
    "icepop": {"preset": "none", "corrections": [{"name": "icepop", "low": 0.5, "high": 5.0}]},
    "r3": {"preset": "r3", "corrections": []},
    "r3_support": {"preset": "r3_support", "corrections": []},
    "r3_support_multisample": {"preset": "r3_support_multisample", "corrections": []},
}
"""Arm -> the preset giving its replay switches (and estimator) and the corrections of the remedy;
every other correction is stripped, so arms differ only by their remedy (the presets' TIS included:
r3 here is replay alone). Thresholds are the presets' (TIS/MIS C = 2, IcePop [0.5, 5])."""

TARGETS = {
    "phantom_clip_r3_support_over_none_max": 0.1,
    "phantom_clip_none_min_for_target": 0.01,
    "variance_ratio_n4_max": 0.5,
}


def arm_preset(arm: str):
    """The Preset of an arm of ARMS (ValueError naming the arms on an unknown one)."""
    from ..corrections import build_correction
    from ..presets import load_preset

    if arm not in ARMS:
        raise ValueError(f"lab: unknown arm {arm!r}; expected one of {sorted(ARMS)}")
    spec = ARMS[arm]
    return dataclasses.replace(load_preset(spec["preset"]),
                               corrections=tuple(build_correction(c) for c in spec["corrections"]))


def fixed_advantages(num: int, seed: int) -> np.ndarray:
    """Per-rollout advantages [R], N(0, 1) from the seed: fixed, the same for every arm."""
    return np.random.default_rng([seed, 32]).standard_normal(num)


def phantom_clip_fraction(train_G: torch.Tensor, old_G: torch.Tensor, keep_G: torch.Tensor, eps: float) -> float:
    """Fraction of kept tokens whose ratio exp(train - old) lies outside [1 - eps, 1 + eps]."""
    ratio_G = torch.exp(train_G.double() - old_G.double())
    out_G = (ratio_G < 1 - eps) | (ratio_G > 1 + eps)
    kept = int(keep_G.sum())
    return float((out_G & keep_G).sum()) / kept if kept else 0.0


@dataclass
class GradStats:
    """Bootstrap statistics of cos(Σ_r b_r g_r, Σ_r b_r h_r) and |Σ b g - Σ b h| / |Σ b h| from the
    Gram matrices of per-rollout gradients g (the arm's) and h (the reference's)."""

    cos: float
    cos_ci: tuple[float, float]
    rel_err: float
    rel_err_ci: tuple[float, float]

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.cos, "ci95": list(self.cos_ci), "rel_err": self.rel_err, "rel_err_ci95": list(self.rel_err_ci)}


def grad_stats(gg_RR: np.ndarray, gh_RR: np.ndarray, hh_RR: np.ndarray, *, boot: int = 2000, seed: int = 0) -> GradStats:
    """Point estimate (all rollouts once) and 95% percentile bootstrap interval over rollouts."""
    R = gg_RR.shape[0]
    rng = np.random.default_rng([seed, 33])
    counts_BR = np.vstack([np.ones(R), rng.multinomial(R, np.full(R, 1.0 / R), size=boot)])

    def quad(M):
        return np.einsum("br,rs,bs->b", counts_BR, M, counts_BR)

    aa, ab, bb = quad(gg_RR), quad(gh_RR), quad(hh_RR)
    cos_B = ab / np.sqrt(np.maximum(aa * bb, 1e-300))
    rel_B = np.sqrt(np.maximum(aa - 2 * ab + bb, 0.0) / np.maximum(bb, 1e-300))
    ci = lambda x: (float(np.percentile(x[1:], 2.5)), float(np.percentile(x[1:], 97.5)))  # noqa: E731
    return GradStats(float(cos_B[0]), ci(cos_B), float(rel_B[0]), ci(rel_B))


def variance_ratio(estimates_by_n: dict[int, list[np.ndarray]]) -> dict[str, Any]:
    """From K repeated π_old estimates [G] (log) per n, each under other placements: the mean over
    tokens of the across-repeat variance of the probability, and its ratio to n = 1's.

    {"var": {n: v}, "variance_ratio": {n: v / v_1}} (ratio None where v_1 is 0: no noise to reduce)."""
    var = {}
    for n, reps in sorted(estimates_by_n.items()):
        p_KG = np.exp(np.stack(reps))
        var[n] = float(p_KG.var(axis=0, ddof=1).mean())
    base = var.get(1)
    ratio = {str(n): (v / base if base else None) for n, v in var.items() if n != 1}
    return {"var": {str(n): v for n, v in var.items()}, "variance_ratio": ratio}


def _flat_grad(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double()
                      for p in params])


def _gen_slices(traces: Sequence[RolloutTrace]) -> list[slice]:
    offs = np.concatenate([[0], np.cumsum([t.num_generated for t in traces])])
    return [slice(int(a), int(b)) for a, b in zip(offs[:-1], offs[1:])]


def run_arm(model_dir: str, preset, traces: Sequence[RolloutTrace], adv_R: np.ndarray, *,
            pi_old_G: np.ndarray | None = None, clip_eps: float = 0.2, reference: bool = False,
            groups: int = 8) -> tuple[dict[str, Any], torch.Tensor]:
    """One arm on the traces at the checkpoint's weights: (metrics, per-group gradients [U, P]).

    The bootstrap unit is a group of rollouts (`groups` contiguous groups, U = min(groups, R)): one
    forward and backward per group instead of per rollout (R = 32 passes x 8 arms took > 30 min on
    2 loaded cores; 8 groups take a quarter of that).

    `reference=True` ignores π_old and corrections: the on-policy gradient Σ A ∇ log π_trainer."""
    from transformers import AutoModelForCausalLM

    from ..enablement import enable
    from ..experts_used import ExpertsUsed

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()  # identical weights, no dropout: the first minibatch
    mr = enable(preset, model=model)
    params = [p for p in model.parameters() if p.requires_grad]
    total_G = sum(t.num_generated for t in traces)
    metrics: dict[str, Any] = {}
    used = ExpertsUsed(model, mr.geometry.moe_layer_ids)
    try:
        with torch.no_grad(), mr.train_batch(traces, track_flips=True) as batch:
            logp_G = batch.scores(model(**batch.model_inputs()).logits, entropy=False).logprobs_G.double()
            m = batch.mismatch_metrics(logp_G, used.ids)
            old_G = torch.from_numpy(pi_old_G) if pi_old_G is not None else batch.rollout_logprobs
            corr = batch.corrections(logp_G)
            keep_G = corr.keep_BS[batch.row_mask()]
            w_G = corr.weights_BS[batch.row_mask()].double()
    finally:
        used.close()
    ratio_G = torch.exp(logp_G - old_G)
    metrics = {
        "phantom_clip_fraction": phantom_clip_fraction(logp_G, old_G, keep_G, clip_eps),
        "k3_kl": float(m["rollout_corr/k3_kl"]),
        "flip_rate": float(m.get("moe_replay/route_flip_rate", float("nan"))),
        "is_ess_token": float(m["moe_replay/is_ess_token"]),
        "max_ratio": float(ratio_G.max()),
        "max_is_weight": float(w_G[keep_G].max()) if bool(keep_G.any()) else 0.0,
        "masked_fraction": 1.0 - float(keep_G.double().mean()),
        "tokens": int(total_G),
    }
    if pi_old_G is not None:
        metrics["k3_kl_vs_pi_old"] = float(m_k3(logp_G, old_G))
    grads = []
    slices = _gen_slices(traces)
    adv_G = torch.from_numpy(np.concatenate([np.full(t.num_generated, float(a)) for t, a in zip(traces, adv_R)]))
    for idx in np.array_split(np.arange(len(traces)), min(groups, len(traces))):
        sl = slice(slices[idx[0]].start, slices[idx[-1]].stop)
        model.zero_grad(set_to_none=True)
        with mr.train_batch([traces[i] for i in idx]) as b:
            lp_G = b.scores(model(**b.model_inputs()).logits, entropy=False).logprobs_G.double()
            A_G = adv_G[sl]
            if reference:
                loss = -(A_G * lp_G).sum() / total_G
            else:
                ratio = torch.exp(lp_G - old_G[sl])
                surr = torch.minimum(ratio * A_G, ratio.clamp(1 - clip_eps, 1 + clip_eps) * A_G)
                loss = -(surr * w_G[sl] * keep_G[sl].double()).sum() / total_G
            loss.backward()
        grads.append(_flat_grad(params))
    return metrics, torch.stack(grads)


def m_k3(train_G: torch.Tensor, ref_G: torch.Tensor) -> float:
    """Mean k3 KL estimator of train vs ref logprobs (metrics.k3_terms, the rollout_corr/k3_kl formula)."""
    from ..metrics import LOG_CLAMP, k3_terms

    return float(k3_terms(train_G.double() - ref_G.double(), LOG_CLAMP).mean())


def gram(a_RP: torch.Tensor, b_RP: torch.Tensor) -> np.ndarray:
    return (a_RP @ b_RP.T).numpy()


def targets_report(arms: dict[str, dict[str, Any]], var_ratio: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets next to the measured numbers, each with `met` (None: not applicable)."""
    none, sup = arms.get("none"), arms.get("r3_support")
    out: dict[str, Any] = {}
    if none and sup:
        pn, ps = none["phantom_clip_fraction"], sup["phantom_clip_fraction"]
        applies = pn > TARGETS["phantom_clip_none_min_for_target"]
        out["phantom_clip_r3_support_le_tenth_of_none"] = {
            "none": pn, "r3_support": ps, "applies": applies, "met": (ps <= 0.1 * pn) if applies else None,
            "rule": "r3_support <= none / 10 when none > 1%"}
        cn, cs = none["grad_cos_to_reference"]["value"], sup["grad_cos_to_reference"]["value"]
        out["grad_cos_r3_support_ge_none"] = {"none": cn, "r3_support": cs, "met": cs >= cn,
                                              "rule": "r3_support's gradient cosine >= none's (point estimates)"}
    r4 = (var_ratio.get("variance_ratio") or {}).get("4")
    out["variance_ratio_n4_le_half"] = {"value": r4, "met": (r4 <= TARGETS["variance_ratio_n4_max"]) if r4 is not None else None,
                                        "rule": "variance of π_old at n = 4 <= 0.5 x n = 1's"}
    return out


def finite_or_none(x: Any) -> Any:
    """JSON-safe: nan/inf -> None, recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_none(v) for v in x]
    return x
