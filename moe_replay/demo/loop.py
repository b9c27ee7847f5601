"""The demo's main loop: the same GRPO run once per arm (preset), then one report.

Every arm starts from the same checkpoint and sees the same prompts and sampling seeds, so arms
differ only by the fix switched on. Per step: rollouts on the bf16 vLLM engine (captured), rewards,
GRPO advantages, optionally π_old re-scored n times on the engine, one fp32 HF update under the
preset, weight sync into the engine. Metrics compare what the trainer computed with what the
engine did on the same tokens. Then, unless `DemoConfig.noise` is None, the engine-noise section
(noisy.py) on the same engine, reset to the starting weights.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .. import __version__
from ..presets import load_preset
from .config import DemoConfig
from .task import group_advantages, problems_for_step, reward

REPLAY_FAMILIES = frozenset({"qwen3_moe", "qwen3_moe_sparse", "mixtral", "olmoe", "qwen2_moe"})
"""Families whose experts module the demo's route-flip probe reads, and whose vLLM-CPU and HF
logprobs agree (deepseek_v3 hits a vLLM-CPU RoPE bug; gpt_oss is not verified end to end here)."""

MEAN_KEYS = ("route_flip_rate", "free_route_flip_rate", "k3_kl", "kl", "max_abs_logprob_diff",
             "mean_abs_logprob_diff", "reward", "ppl_ratio", "k3_kl_vs_pi_old", "wall_s")


def check_presets(cfg: DemoConfig) -> dict[str, Any]:
    """Load every arm's preset and check the family can run it, before anything is built.

    Raises ValueError naming the arm, the preset and what to do.
    """
    from ..models import FAMILIES

    if cfg.family not in FAMILIES:
        raise ValueError(f"unknown model family {cfg.family!r}; the demo builds one of {FAMILIES.names()}")
    presets = {}
    for arm, name in cfg.arms.items():
        try:
            presets[arm] = load_preset(name)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"arm {arm!r}: {e}") from None
        if presets[arm].replay.routes and cfg.family not in REPLAY_FAMILIES:
            raise ValueError(
                f"arm {arm!r}: preset {name!r} replays routes, which the demo supports for {sorted(REPLAY_FAMILIES)} "
                f"(HF and vLLM-CPU agree on them); use --family with one of those, or an arm with preset 'none'"
            )
    if cfg.noise is not None and cfg.family not in REPLAY_FAMILIES:
        raise ValueError(
            f"the engine-noise section re-scores under forced routes and replays them in the trainer, which the demo "
            f"supports for {sorted(REPLAY_FAMILIES)}, not {cfg.family!r}; use one of those, or --no-noise"
        )
    return presets


def run_demo(cfg: DemoConfig, out_dir: Path, progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Build the model, run every arm, return the report (also written to out_dir/report.json)."""
    import json

    from ..models import build_tiny_model
    from ..report.schema import NOISE_SECTION
    from .engine import RolloutEngine
    from .estimate import PiOldEstimator
    from .noisy import run_noise_section
    from .trainer import Policy

    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    presets = check_presets(cfg)
    model_dir = build_tiny_model(cfg.family, out_dir / "model", seed=cfg.seed)
    rollouts_per_step = cfg.rollouts_per_step
    engine = RolloutEngine(model_dir, cfg, max_batch_seqs=max(rollouts_per_step, cfg.noise.rollouts if cfg.noise else 0))
    arms: dict[str, Any] = {}
    noise_section = None
    try:
        for arm, preset in presets.items():
            engine.load_weights(model_dir)  # every arm starts from the same weights
            policy = Policy(str(model_dir), preset, lr=cfg.lr, dtype=cfg.trainer_dtype, seed=cfg.seed)
            estimator = PiOldEstimator(engine, preset, cfg) if preset.estimator.enabled else None
            try:
                steps = _run_arm(arm, engine, policy, estimator, cfg, out_dir, progress)
            finally:
                if estimator is not None:
                    estimator.close()
            arms[arm] = {
                "preset": preset.name,
                "description": preset.description,
                "mean": {k: float(np.mean([s[k] for s in steps])) for k in MEAN_KEYS if all(k in s for s in steps)},
                "steps": steps,
            }
        if cfg.noise is not None:
            noise_section = run_noise_section(engine, model_dir, cfg, progress)
    finally:
        engine.shutdown()
    report = {
        "moe_replay_version": __version__,
        "wall_s": time.perf_counter() - t0,
        "setup": {**cfg.to_dict(), "model_dir": str(model_dir), "rollouts_per_step": rollouts_per_step,
                  "note": ("CPU engine: scoring is deterministic and batch-invariant, so the multi-sample "
                           "arm's n replicas agree exactly; it shows the pipeline and its cost, not noise reduction"
                           + (f" (the {NOISE_SECTION} section shows it under the engine-noise instrument)."
                              if noise_section is not None else "."))},
        "arms": arms,
    }
    if noise_section is not None:
        report[NOISE_SECTION] = noise_section
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    return report


def _run_arm(arm: str, engine: Any, policy: Any, estimator: Any, cfg: DemoConfig, out_dir: Path,
             progress: Callable[[str, int, int], None] | None) -> list[dict[str, Any]]:
    """Every GRPO step of one arm; its per-step records."""
    steps = []
    for step in range(cfg.steps):
        ts = time.perf_counter()
        problems = problems_for_step(step, cfg.prompts_per_step, cfg.seed, cfg.max_operand)
        traces, completions = engine.rollout(problems, step)
        rewards_PN = np.array([[reward(p, c) for c in comps] for p, comps in zip(problems, completions)])
        adv_R = group_advantages(rewards_PN).reshape(-1)
        pi_old_G = estimator.pi_old_G(traces) if estimator is not None else None
        result = policy.step(traces, adv_R, temperature=cfg.temperature, clip_eps=cfg.clip_eps, pi_old_G=pi_old_G)
        engine.sync_from(policy.model, out_dir / "sync")
        steps.append({"step": step, **result.metrics, "reward": float(rewards_PN.mean()), "wall_s": time.perf_counter() - ts})
        if progress:
            progress(arm, step + 1, cfg.steps)
    return steps
