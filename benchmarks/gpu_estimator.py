"""GPU figures of the multi-sample π_old estimator. Needs a CUDA GPU and vLLM.

Written for one H100 / H200 with vLLM 0.26 (ran on an H200, 2026-11-27: docs/benchmarks.md); never run by the tests. On the
gpu.md bench model (qwen3_moe, 8 layers, hidden 1024, 64 experts top-8, bf16), `--requests`
rollouts of `--tokens` tokens (top_p 0.9) are sampled and captured on the main engine, then
scored on it. `--engine graph` (default, vLLM's default: torch.compile + CUDA graphs; the routers'
forcing step is bound at model load, integrations/vllm/scoring/force_step.py) or `--engine eager`
(enforce_eager=True); a second engine in the other mode gives the cross-mode placements:

  forced_vs_rollout     forced re-scoring (routes + support) vs the rollout's own logprobs: the
                        engine's noise level between decode and prefill (max / mean |Δ| nats);
  placements            the same traces scored under placements that change the engine's kernels:
                        batch sizes 1/4/16/64 (batch-size buckets of the GEMMs and attention),
                        prompt reuse vs full, and the other mode (the second engine), forced too.
                        Per placement: max |Δ| vs the main engine's batch-of-all score, the
                        fraction of token logprobs that moved, and how many distinct results (bit
                        patterns) the placements gave; free-routing placements are labelled;
  estimator_s[n]        estimate(traces, VllmScorer, n) for n = 1/2/4/8 as a user calls it: every
                        replica's requests in flight together (VllmScorer.score_batches), the engine
                        packs them into its steps; estimator_s_rollout[4]: the same with the rollout's
                        recorded logprobs as replica 0 (3 re-scorings);
  estimator_s_bucketed[n]  replicas drained one batch-size bucket at a time (1/4/16/64: the batch-1
                        bucket is 64 drains of one request); estimator_s_reuse[n] with prompt
                        reuse (fresh cache salt per run, so each run starts cold);
  hf_recompute_s        HFScorer (bf16, this GPU, replay + support) recomputing π_old for the batch;
  variance_ratio[n]     Var(estimate with n) / Var(single score) over `--variance-repeats`
                        estimates, replicas in flight together in a shuffled order (a new seed per
                        repeat), nothing injected (null where every repeat agrees bit for bit);
                        variance_ratio_bucketed[n]: replicas in rotating batch-size buckets;
  profile_est4          the host's cProfile of one n = 4 estimate (top functions by cumulative time);
  rollout_s, pipelined_s(_reuse)  one engine: rollouts alone; rollouts with each finished
                        rollout's n = 4 replicas submitted to the same engine as it finishes
                        (the sidecar on the engine that sampled), to the last score;
  estimator_s_reuse_rollout[n], pipelined_s_reuse_rollout  the same with the rollout's recorded
                        logprobs as replica 0 (EstimatorConfig(rollout_replica=True)): n - 1
                        re-scorings; the rollout's decode kernels are one more placement, whose
                        distance from the prefill score is `forced_vs_rollout`. No variance ratio is
                        taken for it: replica 0 is the same in every repeat of one trace.

Timings: median of `--repeats` (interleaved, torch.cuda.synchronize around each). Output is JSON
labelled with the GPU name and the vLLM / torch versions.

`--quick` (what benchmarks/gpu_driver.py runs inside a 15-minute GPU lease): the timed jobs are the
rollout, the HF recompute, pipelined, the estimator at n = 1/2/4/8 in flight and bucketed (full
re-scoring), n = 4 with the rollout as a replica and n = 4 bucketed with prompt reuse; 2 repeats,
4 variance repeats; the second engine (other mode) is skipped. Partial
results go to stderr as each section ends, so a run cut short still leaves its figures in the log.

`--core process` runs vLLM's engine core in its own process (vLLM's default; the GPU machine's setup
runs it in-process, `--core inproc`, the default here): the core starts stepping on the first
requests while this process still adds the rest (on the H200, n = 4 spent 0.25 s submitting its
256 requests before the first step, in-process). `--ratio-only` times just the rollout, the HF
recompute and the estimator at n = 1 / 4 (n = 4 also with the rollout as a replica), for
`estimator_n4_vs_recompute` under either core (what gpu_driver.py's `estimator_core` step runs).

Usage: python benchmarks/gpu_estimator.py --json [--engine graph|eager] [--requests 64] [--tokens 128]
       [--repeats 3] [--variance-repeats 8] [--gpu-memory-utilization 0.25] [--quick]
       [--core inproc|process] [--ratio-only] [--plan]
`--plan` prints the configuration as JSON and exits (checks the script on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

NS = (1, 2, 4, 8)
BUCKETS = (1, 4, 16, 64)
"""Batch sizes replicas are scored in: each lands in a different CUDA-graph / GEMM bucket."""
MODEL = dict(num_experts=64, num_experts_per_tok=8, hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=8)
WORDS = "the cat route token model expert layer sample mixture alpha beta dog".split()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--engine", default="graph", choices=["graph", "eager"],
                    help="mode of the main engine (rollouts, timings, variance); the other mode is the second engine")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variance-repeats", type=int, default=8)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--core", default="inproc", choices=["inproc", "process"],
                    help="where vLLM's engine core runs: in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) or in "
                         "its own (=1, vLLM's default): there it steps while this process still adds requests")
    ap.add_argument("--ratio-only", action="store_true",
                    help="time only the rollout, the HF recompute and the estimator at n = 1 / 4 (and n = 4 with the "
                         "rollout as a replica): estimator_n4_vs_recompute in ~1 minute after the engine starts")
    ap.add_argument("--plan", action="store_true", help="print the configuration and exit (no GPU needed)")
    ap.add_argument("--quick", action="store_true",
                    help="the jobs the targets need, 2 repeats, 4 variance repeats, no second engine")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.variance_repeats = min(args.repeats, 2), min(args.variance_repeats, 4)
    for name in ("requests", "tokens", "repeats", "variance_repeats", "block_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.gpu_memory_utilization < 0.5:
        ap.error("--gpu-memory-utilization must lie in (0, 0.5): two engines share the GPU")
    return args


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(16 + (i * 13) % 49)) for i in range(n)]


class BucketScorer:
    """Scores round r of an estimate in chunks of BUCKETS[(r + offset) % 4]: each replica of a rollout
    runs in a different batch-size bucket (the estimator's rounds call score_batch per batch)."""

    def __init__(self, scorer, num: int, offset: int = 0) -> None:
        self.scorer, self.num, self.offset, self.seen = scorer, num, offset, 0

    def score_batch(self, traces):
        bucket = BUCKETS[(self.seen // self.num + self.offset) % len(BUCKETS)]
        self.seen += len(traces)
        out = []
        for i in range(0, len(traces), bucket):
            out += self.scorer.score_batch(traces[i : i + bucket])
        return out


class RolloutScorer(BucketScorer):
    """A BucketScorer that vouches for the rollout's recorded logprobs through the VllmScorer it wraps."""

    def recorded_logprobs_problem(self, trace):
        return self.scorer.recorded_logprobs_problem(trace)


def digest(scores) -> str:
    return hashlib.sha256(b"".join(np.asarray(s, dtype=np.float64).tobytes() for s in scores)).hexdigest()[:16]


def compare(ref, other) -> dict:
    d = np.concatenate([np.abs(a - b) for a, b in zip(ref, other)])
    return {"max_abs": float(d.max()), "moved_fraction": float((d > 0).mean()), "digest": digest(other)}


def interleaved(jobs, repeats: int, sync) -> dict[str, list[float]]:
    """Seconds per job: one warm-up call each, then `repeats` rounds, each round starting one job later."""
    times: dict[str, list[float]] = {}
    for _, fn in jobs:
        fn()
    for r in range(repeats):
        for name, fn in jobs[r % len(jobs):] + jobs[: r % len(jobs)]:
            times.setdefault(name, []).append(sync(fn)[0])
    return times


def main(argv=None) -> None:
    args = parse_args(argv)
    plan = {"model": {"family": "qwen3_moe", "size": "bench", **MODEL}, "dtype": "bfloat16", "ns": NS,
            "buckets": BUCKETS, "rollout_replica_ns": [n for n in NS if n > 1], **{k: v for k, v in vars(args).items() if k not in ("json", "plan")}}
    if args.plan:
        print(json.dumps(plan, indent=1))
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_estimator.py needs a CUDA GPU (use --plan to check the script without one)")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.core == "process" else "0"  # read when the LLM is built
    import vllm
    from vllm import LLM, SamplingParams

    from moe_replay.estimator.core import EstimatorConfig, estimate
    from moe_replay.integrations.hf.scorer import HFScorer, HFScorerConfig
    from moe_replay.integrations.vllm import (CaptureConfig, ScoringError, VllmCapture, VllmScorer, VllmScorerConfig,
                                              scoring_engine_kwargs)
    from moe_replay.models import build_tiny_model

    tmp = tempfile.TemporaryDirectory()
    model_dir = str(build_tiny_model("qwen3_moe", Path(tmp.name) / "bench", size="bench", seed=0, **MODEL))
    kw = dict(model=model_dir, dtype="bfloat16", max_model_len=1024, max_num_seqs=max(64, args.requests * 4),
              gpu_memory_utilization=args.gpu_memory_utilization, seed=0, block_size=args.block_size)
    main_mode, other_mode = args.engine, "eager" if args.engine == "graph" else "graph"
    llm = LLM(**scoring_engine_kwargs(enforce_eager=main_mode == "eager", **kw))
    cap = VllmCapture(llm, CaptureConfig())
    full_cfg = VllmScorerConfig(force_routes=True, use_support=True, prompt_reuse=False)
    scorer = VllmScorer(llm, full_cfg)

    def reuse():
        return scorer.with_config(dataclasses.replace(full_cfg, prompt_reuse=True, salt=uuid.uuid4().hex))

    P = prompts(args.requests)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=args.tokens, ignore_eos=True)
    traces = cap.generate(P, sp, use_tqdm=False)[1]
    hf = HFScorer(HFScorerConfig(model_dir, dtype="bfloat16", device="cuda", force_routes=True, use_support=True))

    def sync(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    if args.ratio_only:  # the rollout, the HF recompute, n = 1 / 4 (n = 4 also with the rollout as replica 0)
        n = len(traces)
        times = interleaved([
            ("rollout", lambda: cap.generate(P, sp, use_tqdm=False)), ("hf", lambda: hf.score_batch(traces)),
            ("est1", lambda: estimate(traces, scorer, EstimatorConfig(n=1), batch_size=n)),
            ("est4", lambda: estimate(traces, scorer, EstimatorConfig(n=4), batch_size=n)),
            ("est4_rollout", lambda: estimate(traces, scorer, EstimatorConfig(n=4, rollout_replica=True), batch_size=n))],
            args.repeats, sync)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(json.dumps({
            "gpu": torch.cuda.get_device_name(), "vllm": vllm.__version__, "torch": torch.__version__, "plan": plan,
            "engine": main_mode, "engine_core": args.core, "scored_tokens": int(sum(t.num_generated for t in traces)),
            "estimator_s": {"1": med["est1"], "4": med["est4"]}, "estimator_s_rollout": {"4": med["est4_rollout"]},
            "hf_recompute_s": med["hf"], "rollout_s": med["rollout"],
            "estimator_n4_vs_recompute": med["est4"] / med["hf"],
            "estimator_n4_rollout_vs_recompute": med["est4_rollout"] / med["hf"], "raw_s": times}))
        if args.core == "process":
            llm.llm_engine.engine_core.shutdown()
        return

    # -- noise: forced vs rollout, placements ------------------------------------------------------
    ref = scorer.score_batch(traces)
    gap = np.concatenate([np.abs(s - t.logprobs_G) for s, t in zip(ref, traces)])
    placements = {f"{main_mode}_all": {"max_abs": 0.0, "moved_fraction": 0.0, "digest": digest(ref)}}
    for b in BUCKETS:
        placements[f"{main_mode}_batch{b}"] = compare(
            ref, BucketScorer(scorer, len(traces), BUCKETS.index(b)).score_batch(traces))
    rs = reuse()
    rs.score_batch(traces)  # cold: caches the prompts
    placements[f"{main_mode}_all_prompt_reuse"] = compare(ref, rs.score_batch(traces))
    free = scorer.with_config(dataclasses.replace(full_cfg, force_routes=False))
    free_ref = free.score_batch(traces)
    placements[f"{main_mode}_all_free_routing"] = compare(ref, free_ref)

    def progress(section: str, value) -> None:
        print(json.dumps({"section": section, "value": value}, default=str), file=sys.stderr, flush=True)

    progress("noise", {"forced_vs_rollout_max_abs": float(gap.max()), "forced_vs_rollout_mean_abs": float(gap.mean()),
                       "placements": placements})

    # -- timings, interleaved ---------------------------------------------------------------------
    def pipelined(sc, replicas=4):
        eng = llm.llm_engine
        for i, p in enumerate(P):
            eng.add_request(f"pipe-{uuid.uuid4().hex[:8]}-{i}", p, sp)
        pending, subs = set(), []
        while eng.has_unfinished_requests():
            for o in eng.step():
                if not o.finished:
                    continue
                if o.request_id.startswith("pipe-"):
                    (t,) = cap.collect([o])
                    for _ in range(replicas):
                        ids = sc.submit([t])
                        subs.append((t, ids))
                        pending.update(ids)
                else:
                    pending.discard(o.request_id)
        return [sc.finish([t], ids)[0] for t, ids in subs]

    jobs = [("rollout", lambda: cap.generate(P, sp, use_tqdm=False)), ("hf", lambda: hf.score_batch(traces)),
            ("pipelined", lambda: pipelined(scorer)), ("pipelined_reuse", lambda: pipelined(reuse())),
            ("pipelined_reuse_rollout", lambda: pipelined(reuse(), replicas=3))]
    if args.quick:
        jobs = [j for j in jobs if j[0] in ("rollout", "hf", "pipelined")]
    for n in NS:
        jobs.append((f"est{n}", lambda n=n: estimate(traces, scorer, EstimatorConfig(n=n), batch_size=len(traces))))
        jobs.append((f"est{n}_bucketed", lambda n=n: estimate(traces, BucketScorer(scorer, len(traces)),
                                                              EstimatorConfig(n=n), batch_size=len(traces))))
        if n == 4:
            jobs.append(("est4_rollout", lambda: estimate(traces, scorer, EstimatorConfig(n=4, rollout_replica=True),
                                                          batch_size=len(traces))))
        if args.quick:
            if n == 4:
                jobs.append(("est4_reuse", lambda: estimate(traces, BucketScorer(reuse(), len(traces)),
                                                            EstimatorConfig(n=4), batch_size=len(traces))))
            continue
        jobs.append((f"est{n}_reuse", lambda n=n: estimate(traces, BucketScorer(reuse(), len(traces)),
                                                           EstimatorConfig(n=n), batch_size=len(traces))))
        if n > 1:
            jobs.append((f"est{n}_reuse_rollout", lambda n=n: estimate(
                traces, RolloutScorer(reuse(), len(traces)), EstimatorConfig(n=n, rollout_replica=True),
                batch_size=len(traces))))
    times = interleaved(jobs, args.repeats, sync)
    med = {k: statistics.median(v) for k, v in times.items()}
    progress("timings_s", med)

    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(lambda: estimate(traces, scorer, EstimatorConfig(n=4), batch_size=len(traces)))
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
    profile_est4 = [line.strip() for line in buf.getvalue().splitlines() if line.strip()][-32:]
    progress("profile_est4", profile_est4)

    # -- variance under real engine noise -----------------------------------------------------------
    def variance(make_scorer, make_config) -> dict[int, float]:
        probs = {n: [] for n in NS}
        for k in range(args.variance_repeats):
            for n in NS:
                est = estimate(traces, make_scorer(k), make_config(n, k), batch_size=len(traces))
                probs[n].append(np.concatenate([e.prob_G for e in est]))
        return {n: float(np.stack(probs[n]).var(axis=0, ddof=1).sum()) for n in NS}

    var = variance(lambda k: scorer, lambda n, k: EstimatorConfig(n=n, batch_placement="shuffle", seed=k))
    var_b = variance(lambda k: BucketScorer(scorer, len(traces), offset=k), lambda n, k: EstimatorConfig(n=n))
    progress("variance", {"in_flight": var, "bucketed": var_b})

    # -- the other mode: a second engine, forced in every bucket, and free for reference ------------
    other = {}
    if args.quick:
        other["skipped"] = "--quick"
    else:
        llm_o = LLM(**scoring_engine_kwargs(enforce_eager=other_mode == "eager", **kw))
        so = VllmScorer(llm_o, full_cfg)
        for b in BUCKETS:
            try:
                placements[f"{other_mode}_batch{b}"] = compare(
                    ref, BucketScorer(so, len(traces), BUCKETS.index(b)).score_batch(traces))
            except ScoringError as e:  # recorded, never silent: a forcing failure is a finding
                other[f"batch{b}_forced_error"] = f"{type(e).__name__}: {e}"
        free_o = so.with_config(dataclasses.replace(full_cfg, force_routes=False))
        placements[f"{other_mode}_all_free_routing_vs_{main_mode}_free"] = compare(free_ref, free_o.score_batch(traces))

    digests = {k: v["digest"] for k, v in placements.items() if "free" not in k}
    result = {
        "gpu": torch.cuda.get_device_name(), "vllm": vllm.__version__, "torch": torch.__version__, "plan": plan,
        "scored_tokens": int(sum(t.num_generated for t in traces)),
        "forced_vs_rollout": {"max_abs": float(gap.max()), "mean_abs": float(gap.mean())},
        "engine": main_mode, "engine_core": args.core, "placements": placements, "other_engine": {"mode": other_mode, **other},
        "distinct_forced_results": len(set(digests.values())), "forced_placements": len(digests),
        "estimator_s": {str(n): med[f"est{n}"] for n in NS},
        "estimator_s_rollout": {"4": med["est4_rollout"]},
        "estimator_s_bucketed": {str(n): med[f"est{n}_bucketed"] for n in NS},
        "estimator_s_reuse": {str(n): med[f"est{n}_reuse"] for n in NS if f"est{n}_reuse" in med},
        "hf_recompute_s": med["hf"],
        "n4_over_hf_recompute": med["est4"] / med["hf"], "n4_reuse_over_hf_recompute": med["est4_reuse"] / med["hf"],
        "estimator_n4_vs_recompute": med["est4"] / med["hf"],
        "estimator_n4_rollout_vs_recompute": med["est4_rollout"] / med["hf"],
        "estimator_n4_bucketed_vs_recompute": med["est4_bucketed"] / med["hf"],
        "estimator_s_reuse_rollout": {str(n): med[f"est{n}_reuse_rollout"] for n in NS if f"est{n}_reuse_rollout" in med},
        "n4_reuse_rollout_over_hf_recompute": med["est4_reuse_rollout"] / med["hf"] if "est4_reuse_rollout" in med else None,
        "pipelined_s_reuse_rollout": med.get("pipelined_reuse_rollout"),
        "pipelined_overhead_reuse_rollout": med["pipelined_reuse_rollout"] / med["rollout"] - 1.0
        if "pipelined_reuse_rollout" in med else None,
        "rollout_s": med["rollout"], "pipelined_s": med["pipelined"], "pipelined_s_reuse": med.get("pipelined_reuse"),
        "pipelined_overhead": med["pipelined"] / med["rollout"] - 1.0,
        "pipelined_overhead_reuse": med["pipelined_reuse"] / med["rollout"] - 1.0 if "pipelined_reuse" in med else None,
        "variance_ratio": {str(n): (var[n] / var[1] if var[1] > 0 else None) for n in NS},
        "variance_ratio_bucketed": {str(n): (var_b[n] / var_b[1] if var_b[1] > 0 else None) for n in NS},
        "variance_sum": {"in_flight": {str(n): v for n, v in var.items()}, "bucketed": {str(n): v for n, v in var_b.items()}},
        "profile_est4": profile_est4,
        "variance_ratio_target": {str(n): 1.1 / n for n in NS},
        "noise": "real engine noise only (batch-size buckets; in flight: the submission order); nothing injected",
        "raw_s": times,
    }
    print(json.dumps(result) if args.json else result)


if __name__ == "__main__":
    main()
