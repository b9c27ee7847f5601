"""The remedy lab's long runs, trainer side: GRPO from a warm start, per arm, under
the engine-noise instrument (moe_replay/noise.py: calibrated to GPU figures, never a GPU result).

What is here (engine-agnostic; HF transformers imported lazily): the long-run arms (the quick lab's
ARMS plus gspo), the run settings, the supervised warm start (cached), and one GRPO update with its
per-step measurements. The engine loop is moe_replay/lab/engine_runs.py; the collapse rule and the
boundary are moe_replay/lab/collapse.py; benchmarks/lab.py --full prints the JSON.

One GRPO step of an arm, on the rollouts the engine sampled under noise:
  1. a no-grad forward at the rollout's weights (replay on if the arm replays) gives the step's
     measurements: vllm-kl (k3 of the trainer's logprobs vs the engine's), route flips, entropy
     (over the full vocabulary for every arm, so arms compare);
  2. π_old = that forward's logprobs (the trainer's recompute), or the engine's n-replica estimate
     for an arm with the estimator; the arm's corrections weight π_old against the engine's
     logprobs (the demo trainer's convention);
  3. `minibatches` PPO updates (clipped surrogate, token-mean over kept tokens, grad norm clipped at
     1): from the second one on the policy has moved, so the clip fraction measures real PPO
     clipping (the first minibatch's clipping is phantom: 0 unless π_old is the engine's).

Legend: R rollouts of a step, G generated tokens (flat, trace order), P parameters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .arms import ARMS, arm_preset
from .collapse import COLLAPSE_RULE, level_key
from ..trace import RolloutTrace

LONG_ARMS: dict[str, dict[str, Any]] = {**ARMS, "gspo": {"preset": "none", "corrections": [{"name": "gspo"}]}}
"""The quick lab's arms plus gspo (the sequence's geometric-mean ratio π_old / π_engine as every
token's weight, untruncated: corrections.GSPOConfig's default), each stripped to its own remedy."""

DEFAULT_LEVELS: tuple[float, ...] = (0.0, 1.0, 2.0, 4.0, 8.0)
"""EngineNoise scales of the issue's grid: off, calibrated, 2x, 4x, 8x."""


def long_arm_preset(arm: str):
    """The Preset of an arm of LONG_ARMS (ValueError naming the arms on an unknown one)."""
    if arm in ARMS:
        return arm_preset(arm)
    if arm not in LONG_ARMS:
        raise ValueError(f"lab runs: unknown arm {arm!r}; expected one of {sorted(LONG_ARMS)}")
    from ..corrections import build_correction
    from ..presets import load_preset

    spec = LONG_ARMS[arm]
    return dataclasses.replace(load_preset(spec["preset"]),
                               corrections=tuple(build_correction(c) for c in spec["corrections"]))


@dataclass(frozen=True)
class WarmStart:
    """The supervised warm start: the tiny model taught the task's format and some answers, so GRPO
    starts from a partly solved task and its reward can rise and fall. Built once per setting and
    cached under the run directory (same setting -> same weights; the file `warm_start.json` names it)."""

    family: str = "qwen3_moe"
    model_seed: int = 0
    steps: int = 30
    """SFT steps (batch `batch` problems each): a pilot (HF sampling at temperature 1, top-p 0.9)
    read a reward of 0.36 / 0.41 / 0.53 / 0.85 after 10 / 30 / 40 / 60 steps: 30 starts GRPO at a
    partly solved task (~26% of answers right) with room both ways."""
    batch: int = 32
    lr: float = 3e-3
    max_operand: int = 5
    """Operands 0..5 (about 90 distinct problems, the GRPO prompts too): with 9 (about 300) the
    pilot's GRPO reward did not rise in 40 steps at lr 1e-4 or 3e-4 (8 prompts a step see too few
    of them), with 5 each problem recurs every ~11 steps."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "max_operand"):
            if getattr(self, name) < 1:
                raise ValueError(f"WarmStart.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"WarmStart.lr must be > 0, got {self.lr}")


@dataclass(frozen=True)
class LongRunConfig:
    """One grid of long runs: arms x levels x seeds, `steps` GRPO steps each."""

    steps: int = 300
    seeds: tuple[int, ...] = (0, 1, 2)
    arms: tuple[str, ...] = tuple(LONG_ARMS)
    levels: tuple[float, ...] = DEFAULT_LEVELS
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    """8 x 4 = 32 rollouts a step: full decode steps fall in the (16, 64] bucket, a perturbed
    numerics variant for an even noise seed (EngineNoise.variant_of)."""
    max_tokens: int = 6
    """' 81' + EOS is 4 tokens; 6 leaves room to babble (the reward reads the first integer)."""
    temperature: float = 1.0
    top_p: float = 0.9
    """< 1: the sampler's kept set is smaller than the vocabulary (support replay has work to do)."""
    lr: float = 2e-4
    """A pilot at level off (none arm, seed 0): 1e-3 sharpened the policy to one answer a prompt in
    5 steps (entropy 0.8 -> 0.2, reward fell to 0.2); 5e-4 reached entropy ~0.02 by step 40, after
    which every group is flat and learning stops; 2e-4 raised the reward 0.42 -> ~0.6 over 100 steps."""
    clip_eps: float = 0.2
    minibatches: int = 2
    estimator_n: int = 4
    score_batch: int = 4
    """Rollouts per estimator batch before the placing scorer's fillers (moe_replay/lab/engine.py),
    the quick lab's 4: batches then fill to 4 or 16 requests, buckets that run different numerics
    variants, so the n replicas see both. With 8 every batch fills to 16, one bucket: at an even
    noise seed every replica runs the clean variant and π_old is the trainer's own logprobs (k3 to
    it ~2e-13 in the first grid's runs, which used 8: docs/lab.md)."""
    warm: WarmStart = field(default_factory=WarmStart)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        object.__setattr__(self, "levels", tuple(float(v) for v in self.levels))
        for name in ("steps", "prompts_per_step", "max_tokens", "minibatches", "estimator_n", "score_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"LongRunConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.samples_per_prompt < 2:
            raise ValueError(f"LongRunConfig.samples_per_prompt must be >= 2 (GRPO compares within a group), got {self.samples_per_prompt}")
        if not self.seeds or any(s < 0 for s in self.seeds) or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"LongRunConfig.seeds must be distinct ints >= 0, got {self.seeds}")
        if not self.levels or any(not (math.isfinite(v) and v >= 0) for v in self.levels) or len(set(self.levels)) != len(self.levels):
            raise ValueError(f"LongRunConfig.levels must be distinct EngineNoise scales >= 0, got {self.levels}")
        unknown = [a for a in self.arms if a not in LONG_ARMS]
        if not self.arms or unknown:
            raise ValueError(f"LongRunConfig.arms: unknown {unknown or 'none given'}; expected among {sorted(LONG_ARMS)}")
        if self.minibatches > self.rollouts:
            raise ValueError(f"LongRunConfig.minibatches ({self.minibatches}) must be <= rollouts a step ({self.rollouts})")

    @property
    def rollouts(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def level_keys(self) -> list[str]:
        return [level_key(v) for v in self.levels]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["levels"] = self.level_keys
        d["collapse_rule"] = COLLAPSE_RULE.to_dict()
        return d


def noise_seed(seed: int) -> int:
    """The EngineNoise seed of run seed `seed`: even (2 * seed), so a full step of 32 requests runs a
    perturbed variant at every seed ((bucket 3 + noise seed) % 2 = 1), as the quick lab's seed 0."""
    return 2 * seed


# ---------------------------------------------------------------------------------------- warm start


def _sft_batch(tok: Any, problems: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input ids, attention mask and labels (-100 outside the answer + EOS) of a padded batch."""
    rows, labels = [], []
    for p in problems:
        prompt = tok(p.prompt, add_special_tokens=True)["input_ids"]
        answer = tok(f" {p.answer}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    lab = torch.tensor([lb + [-100] * (width - len(lb)) for lb in labels])
    return ids, mask, lab


def build_warm_start(spec: WarmStart, cache_dir: str | Path) -> Path:
    """The warm-start checkpoint for `spec` under `cache_dir` (built on first use, then reused):
    the tiny model from `model_seed`, then `steps` supervised steps on answer + EOS tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models import build_tiny_model
    from ..models.prompts import sample_problems

    tag = json.dumps(dataclasses.asdict(spec), sort_keys=True)
    out = Path(cache_dir) / f"warm-{spec.family}-s{spec.model_seed}-{hashlib.sha256(tag.encode()).hexdigest()[:10]}"
    if _stamped(out, tag):
        return out
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=cache_dir))  # built aside, then renamed into place
    base = build_tiny_model(spec.family, tmp / "base", seed=spec.model_seed)
    tok = AutoTokenizer.from_pretrained(str(base))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.model_seed)
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
        losses = []
        for k in range(spec.steps):  # problems from a stream of its own (GRPO's use seed * 100003 + step)
            ids, mask, lab = _sft_batch(tok, sample_problems(spec.batch, seed=10**9 + 1000 * spec.model_seed + k,
                                                             max_operand=spec.max_operand))
            loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    (tmp / "warm_start.json").write_text(json.dumps({"spec": tag, "sft_loss_first_last": [losses[0], losses[-1]]}))
    if out.exists() and not _stamped(out, tag):  # a build that died before its stamp
        shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # another process put the same build in place first
        shutil.rmtree(tmp, ignore_errors=True)
    if not _stamped(out, tag):
        raise RuntimeError(f"build_warm_start: {out} holds no finished build of {tag} after building it")
    return out


def _stamped(out: Path, tag: str) -> bool:
    stamp = out / "warm_start.json"
    return stamp.exists() and json.loads(stamp.read_text()).get("spec") == tag


# ---------------------------------------------------------------------------------------- GRPO update


class GrpoLearner:
    """An HF model trained by GRPO under one arm's preset (see the module docstring for a step)."""

    def __init__(self, model_dir: str | Path, preset: Any, *, lr: float, seed: int, clip_eps: float, minibatches: int) -> None:
        from transformers import AutoModelForCausalLM

        from ..enablement import enable

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.mr = enable(preset, model=self.model)
        self.preset, self.clip_eps, self.minibatches = preset, clip_eps, minibatches

    def step(self, traces: Sequence[RolloutTrace], adv_R: np.ndarray, pi_old_G: np.ndarray | None = None) -> dict[str, float]:
        """One GRPO step on the traces; the step's measurements (floats, NaN where undefined)."""
        from ..demo.trainer import ExpertsUsed

        model, eps = self.model, self.clip_eps
        used = ExpertsUsed(model, self.mr.geometry.moe_layer_ids)
        try:
            with torch.no_grad(), self.mr.train_batch(traces, track_flips=True) as batch:
                sc = batch.scores(model(**batch.model_inputs()).logits, full=True)
                logp_G = sc.logprobs_G.double()
                m = batch.mismatch_metrics(logp_G, used.ids)
        finally:
            used.close()
        old_G = torch.from_numpy(pi_old_G).double() if pi_old_G is not None else logp_G
        corr = batch.corrections(old_G)  # the arm's IS weights / masks of π_old against the engine's
        rows = batch.row_mask()
        keep_G, w_G = corr.keep_BS[rows], corr.weights_BS[rows].double()
        lengths = np.array([t.num_generated for t in traces])
        offs = np.concatenate([[0], np.cumsum(lengths)])
        adv_G = torch.from_numpy(np.repeat(np.asarray(adv_R, dtype=np.float64), lengths))

        clipped = kept = 0
        clipped_first = kept_first = 0
        norms, losses = [], []
        params = [p for p in model.parameters() if p.requires_grad]
        for j, idx in enumerate(np.array_split(np.arange(len(traces)), self.minibatches)):
            sl = slice(int(offs[idx[0]]), int(offs[idx[-1] + 1]))
            with self.mr.train_batch([traces[i] for i in idx]) as b:
                lp_G = b.scores(model(**b.model_inputs()).logits, entropy=False).logprobs_G.double()
                ratio_G = torch.exp(lp_G - old_G[sl])
                A_G, k_G = adv_G[sl], keep_G[sl]
                surr_G = torch.minimum(ratio_G * A_G, ratio_G.clamp(1 - eps, 1 + eps) * A_G)
                loss = -(surr_G * w_G[sl] * k_G.double()).sum() / max(int(k_G.sum()), 1)  # token-mean over kept
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
            self.opt.step()
            losses.append(float(loss.detach()))
            out_G = ((ratio_G.detach() < 1 - eps) | (ratio_G.detach() > 1 + eps)) & k_G
            clipped, kept = clipped + int(out_G.sum()), kept + int(k_G.sum())
            if j == 0:
                clipped_first, kept_first = int(out_G.sum()), int(k_G.sum())
        row = {
            "vllm_kl": float(m["rollout_corr/k3_kl"]),
            "flip_rate": float(m.get("moe_replay/route_flip_rate", float("nan"))),
            "entropy": float(sc.full_entropy_G.double().mean()),
            "grad_norm": float(np.mean(norms)),
            "clip_fraction": clipped / kept if kept else 0.0,
            "clip_fraction_first_minibatch": clipped_first / kept_first if kept_first else 0.0,
            "masked_fraction": 1.0 - float(keep_G.double().mean()),
            "max_is_weight": float(w_G[keep_G].max()) if bool(keep_G.any()) else 0.0,
            "loss": float(np.mean(losses)),
            "tokens": int(offs[-1]),
        }
        if pi_old_G is not None:
            from .arms import m_k3

            row["k3_kl_vs_pi_old"] = m_k3(logp_G, old_G)
        return row
