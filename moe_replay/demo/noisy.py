"""The demo's engine-noise section: what the multi-sample π_old does when the engine is noisy.

On the CPU engine every re-score is bit-identical, so the demo's multi-sample arm's π_old equals the
rollout's logprobs and shows nothing. This section runs the same engine under the engine-noise
instrument (moe_replay/noise.py at its calibrated setting: batch-composition numerics variants plus
router flips, calibrated to GPU figures; an instrument, never a GPU result) and measures, on the
section's own rollouts at the arms' starting weights:

  * mean |log π_old - rollout logprob| per n: the estimate differs from the rollout's logprobs
    (the rollout ran one numerics variant, the replicas a mix of them);
  * the variance of π_old (probability) across independent estimates per n, and its ratio to n = 1's
    (moe_replay/lab/arms.variance_ratio, the lab's statistic): it falls as 1/n;
  * the phantom-clip fraction at the first minibatch (moe_replay/lab/arms.run_arm) with π_old = the
    rollout's logprobs and with π_old = the n = `clip_n` estimate.

The engine side is the lab's (moe_replay/lab/engine.py): rollouts captured under the full noise;
re-scoring with the logit variants only (forced-route scoring and route flips wrap the same router
attribute); `estimate()` places the replicas ('shuffle', a new seed per call) and `placing_scorer`
fills each batch with other rollouts of the section to a noise-bucket size, as a serving engine
mixes a replica with other traffic. Each rollout gets `replicas` re-scorings (estimate() calls of
max(ns) replicas, kept); an n-replica estimate is the estimator's `combine` of n of them, and the
disjoint groups of n are independent estimates (every round draws its own placement): one pass of
scoring gives replicas / n estimates at each n (32 at n = 1 ... 4 at n = 8 by default), where
separate runs per n would score 15/8 as much for 4 estimates each.

Legend: E estimates at one n, R studied rollouts, G their generated tokens (flat, in rollout order).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..trace import RolloutTrace
from .config import DemoConfig
from .task import problems_for_step

ESTIMATOR_PRESET = "r3_support_multisample"
"""The preset whose estimator settings (forced routes, support, averaging) the section uses."""
LABEL = "instrument: engine-noise model on vLLM-CPU, calibrated to GPU figures (docs/noise.md); not a GPU result"


def run_noise_section(engine: Any, model_dir: Path, cfg: DemoConfig,
                      progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Run the section on the demo's engine (weights reset to `model_dir`); the report's `engine_noise` dict."""
    from ..integrations.vllm.noise import VllmEngineNoise
    from ..lab.arms import variance_ratio
    from ..presets import load_preset

    sec = cfg.noise
    if sec is None:
        raise ValueError("run_noise_section: DemoConfig.noise is None (the section is switched off); expected a NoiseSection")
    t0 = time.perf_counter()
    ticks, total = 0, sec.progress_ticks()

    def tick() -> None:
        nonlocal ticks
        ticks += 1
        if progress:
            progress("engine noise", ticks, total)

    noise = sec.noise(cfg.seed)
    score_noise = dataclasses.replace(noise, route_flip_fraction=0.0)
    settings = load_preset(ESTIMATOR_PRESET).estimator
    engine.load_weights(model_dir)  # the arms' starting weights: the trainer pass below loads the same
    step = cfg.steps  # prompts of a step no arm trained on
    problems = problems_for_step(step, sec.prompts, cfg.seed, cfg.max_operand)
    timings: dict[str, float] = {}
    with VllmEngineNoise(engine.llm, noise, captures=[engine.capture]) as nz:
        traces, _ = engine.rollout(problems, step, samples=sec.samples_per_prompt)
        rollout_stats = nz.stats()
    timings["rollouts_s"] = time.perf_counter() - t0
    tick()
    studied = traces[: sec.studied]

    t1 = time.perf_counter()
    with VllmEngineNoise(engine.llm, score_noise, captures=[engine.capture]) as nz:
        by_n = _estimates_by_n(engine.llm, settings, traces, studied, noise, sec, cfg.seed, tick)
        score_stats = nz.stats()
    timings["rescoring_s"] = time.perf_counter() - t1

    rollout_G = np.concatenate([np.asarray(t.logprobs_G, dtype=np.float64) for t in studied])
    diff_by_n = {n: np.abs(np.stack(reps) - rollout_G[None, :]) for n, reps in by_n.items()}  # [E, G] each
    estimator = {
        **variance_ratio(by_n),  # {"var": {n: v}, "variance_ratio": {n: v / v_1}}: the lab's statistic and keys
        "pi_old_abs_diff": {str(n): float(d.mean()) for n, d in diff_by_n.items()},
        "pi_old_max_abs_diff": {str(n): float(d.max()) for n, d in diff_by_n.items()},
        "estimates": {str(n): len(reps) for n, reps in by_n.items()}, "rollouts": len(studied), "tokens": int(rollout_G.size),
    }
    out: dict[str, Any] = {
        "label": LABEL,
        "noise": noise.to_dict(),
        "rescoring_noise": score_noise.to_dict(),
        "setup": {**dataclasses.asdict(sec), "rollouts": len(traces), "prompts_step": step, "estimator_preset": ESTIMATOR_PRESET,
                  "placement": (f"estimate()'s 'shuffle' placement, {sec.score_batch} rollouts a batch, each batch filled with "
                                f"other rollouts of the section to one of {sec.placement_sizes(noise)} requests, the noise buckets' sizes")},
        "traces_marked_noisy": sum(t.engine.noise is not None for t in traces),
        # what the instrument did (NoiseState.stats: logits rows perturbed, router rows flipped, steps per variant)
        "rollout_noise_stats": {k: v for k, v in rollout_stats.items() if k != "config"},
        "rescoring_noise_stats": {k: v for k, v in score_stats.items() if k != "config"},
        "estimator": estimator,
    }
    if sec.clip_n is not None:
        t2 = time.perf_counter()
        out["phantom_clip"] = _phantom_clip(model_dir, studied, by_n[sec.clip_n][0], sec.clip_n, cfg)
        timings["trainer_s"] = time.perf_counter() - t2
        tick()
    out["timings"] = {k: round(v, 1) for k, v in timings.items()}
    out["wall_s"] = time.perf_counter() - t0
    return out


def _estimates_by_n(llm: Any, settings: Any, pool: list[RolloutTrace], studied: list[RolloutTrace], noise: Any,
                    sec: Any, seed: int, tick: Callable[[], None]) -> dict[int, list[np.ndarray]]:
    """{n: the replicas / n disjoint n-replica estimates, each a flat log π_old [G] of the studied rollouts}."""
    from ..estimator import combine, estimate
    from ..lab.engine import placing_scorer
    from ..integrations.vllm.scoring.scorer import VllmScorer, VllmScorerConfig

    top = max(sec.ns)
    replicas: list[list[np.ndarray]] = [[] for _ in studied]  # per rollout, its replica logprobs [G_r] in order
    scorer = VllmScorer(llm, VllmScorerConfig(force_routes=settings.force_routes, use_support=settings.use_support))
    try:
        for b in range(sec.blocks):
            placement_seed = 1000 * seed + b
            config = dataclasses.replace(settings.config, n=top, batch_placement="shuffle", seed=placement_seed,
                                         adaptive=False, rollout_replica=False)
            ests = estimate(studied, placing_scorer(scorer, pool, list(noise.buckets), placement_seed), config,
                            batch_size=sec.score_batch, keep_replicas=True)
            for r, e in enumerate(ests):
                replicas[r].extend(e.replicas_RG)
            tick()
    finally:
        scorer.uninstall()
    averaging = settings.config.averaging
    return {n: [np.concatenate([combine(t.key, np.stack(reps[g * n:(g + 1) * n]), averaging).logprob_G
                                for t, reps in zip(studied, replicas)])
                for g in range(sec.replicas // n)]
            for n in sec.ns}


def _phantom_clip(model_dir: Path, studied: list[RolloutTrace], pi_old_G: np.ndarray, n: int, cfg: DemoConfig) -> dict[str, Any]:
    """Kept tokens PPO-clipped at the first minibatch (the trainer at the rollout's weights, routes and
    support replayed): π_old = the rollout's logprobs vs π_old = the n-replica estimate."""
    from ..lab.arms import arm_preset, fixed_advantages, run_arm

    adv_R = fixed_advantages(len(studied), cfg.seed)  # the clip fraction does not read them; the gradient pass does
    rollout, _ = run_arm(str(model_dir), arm_preset("r3_support"), studied, adv_R, clip_eps=cfg.clip_eps, groups=1)
    est, _ = run_arm(str(model_dir), arm_preset(ESTIMATOR_PRESET), studied, adv_R, pi_old_G=pi_old_G,
                     clip_eps=cfg.clip_eps, groups=1)
    return {"clip_eps": cfg.clip_eps, "n": n,
            "rollout_logprobs": rollout["phantom_clip_fraction"], "estimate": est["phantom_clip_fraction"],
            "k3_kl_vs_rollout": rollout["k3_kl"], "k3_kl_vs_estimate": est.get("k3_kl_vs_pi_old"),
            "tokens": rollout["tokens"]}
