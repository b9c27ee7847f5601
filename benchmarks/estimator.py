"""Multi-sample π_old on the vLLM engine: cost of n re-scorings, overlap with rollouts, variance.

On the `bench` qwen3_moe model (8 MoE layers, 32 experts top-4, hidden 512), `--requests`
rollouts of `--tokens` tokens (top_p 0.9) are sampled and captured, then re-scored under their
routes and kept sets.

Sidecar layout (the deployment the overlap figures use; described in the JSON's `sidecar`): two
vLLM AsyncLLM engines, each with its engine core (and, with the uni executor, its model) in its
own process, each pinned to its own core by CPU affinity inherited at spawn:
  rollout engine   capture extension (AsyncVllmCapture), engine-core process on core A;
  scoring engine   scoring extension (AsyncVllmScorer under an EstimatorService, n = 4),
                   engine-core process on core B;
  client           this process (asyncio loop: request streams, trace collection, the service),
                   pinned to core B so the rollout core only decodes.
The client's own threads run on core B with one torch thread during these figures; for the
single-engine figures below it is unpinned again with torch's default threads, as before.
Both engines use the uni executor, so vLLM's VLLM_CPU_OMP_THREADS_BIND (read only by the mp
executor's OMPProcessManager) never binds anything; it is set to 'nobind' to say so, and each
engine process is spawned with OMP_NUM_THREADS=1 under its 1-core affinity mask. The affinity of every
thread of every process is read back from /proc and recorded (`sidecar.processes`).

Timings (median of `--repeats`, all variants interleaved in one process, after a warm-up; `min_s`
and `raw_s` are kept too, since the 2-core machine is shared and one repeat can be hit hard):
  rollout_s        sidecar layout: the rollouts alone (AsyncLLM generate + collect traces);
  serial_s         sidecar layout: rollouts, then the EstimatorService estimates them (n = 4);
  pipelined_s      sidecar layout, overlapped: as each rollout finishes its trace is collected and
                   submitted to the service; from the start of the rollouts to the last estimate
                   (`sidecar.pipelined_rollouts_done_s`: when the last trace was submitted;
                   `sidecar.pipelined_tail_s`: the scoring left after it);
  estimator_s[n]   estimate(traces, VllmScorer, n) for n = 1, 2, 4, 8 on an in-process engine
                   (each replica round is one engine batch of every rollout, placements rotated);
  hf_recompute_s   the trainer recomputing π_old for the same batch: one HF fp32 forward with
                   replay + support scoring (no grad);
  estimator_adaptive  EstimatorConfig(n=4, adaptive, min_n=2, max_n=8, rel_tol=1e-3): its cost on the
                   in-process engine (`s`), the replicas it used (`replicas_used_mean`), and the
                   sidecar pipelined figure with it (`pipelined_s`, `pipelined_overhead`). Replicas
                   stop where they agree, so on this deterministic engine it stops at min_n = 2;
  estimator_s_reuse[n], pipelined_s_reuse  the same with prompt reuse (VllmScorerConfig(prompt_reuse=True),
                   integrations/vllm/scoring/prefix.py): a replica reads its prompt's KV
                   cached by the rollout's first replica and forwards only the prompt's tail and the
                   response (whole 32-token blocks); each timed run uses a fresh cache salt, so it starts cold. The other
                   figures use prompt_reuse=False (every replica forwards every token);
  estimator_s_rollout_kv[4], pipelined_same_engine_s_rollout_kv  scoring on the engine that sampled
                   (VllmScorerConfig(read_rollout_kv=True)): every replica, the first one included, reads
                   the rollout's own prompt blocks (unsalted; the read cap stops at the prompt, the write
                   cap is 0) on the in-process engine, n = 4, and the single-engine pipelined layout with it;
  estimator_s_reuse_rollout[n], pipelined_s_reuse_rollout  prompt reuse with the rollout as replica 0
                   (EstimatorConfig(rollout_replica=True)): n replicas = the trace's recorded logprobs
                   + n - 1 re-scorings (n = 2, 4, 8; n = 1 would score nothing), in-process and in the
                   sidecar layout;
  estimator_s_rollout_kv_rollout[4], pipelined_same_engine_s_rollout_kv_rollout  the same on the engine
                   that sampled (read_rollout_kv): 3 re-scorings, each reading the rollout's prompt blocks;
  cost_model       tokens each n = 4 variant forwards (the engine's own prefix-hit counts, one untimed run
                   each), seconds per forwarded token of a full vLLM re-scoring (estimator_s[1] / tokens)
                   and of the HF recompute (hf_recompute_s / tokens), and the n = 4 / HF ratio that the
                   token counts predict, next to the measured one;
  *_same_engine_s  the earlier single-engine figures, kept: rollouts, serial and pipelined on ONE
                   in-process engine (pipelined: each finished rollout's 4 scoring replicas join
                   the engine's running batches), so scoring and decode share the same compute.
With `--tokens` fixed for every request (`--lengths fixed`), all rollouts finish in the same
engine step, so nothing can overlap: the last estimate comes one scoring pass after the rollouts.
`--lengths spread` (default) gives request i max_tokens = round(tokens * (0.25 + 1.5 i/(R-1)))
(mean `--tokens`, ignore_eos), as variable-length RL rollouts finish at different times; the
`sidecar.fixed_lengths` section measures the fixed-length case in the same layout too.

Noise (printed as `noise`): CPU scoring was found deterministic and batch-invariant (fp32 and
bf16: scoring alone, in batches, reversed, in other chunk sizes gives identical logprobs), so the
script first measures the engine's replica spread on this run (`noise.engine_replica_spread`).
If it is 0 and `--inject-noise auto` (default), variance is measured under INJECTED noise:
independent Gaussian N(0, sigma^2) added to every replica's per-token logprob after the engine
scored it, clipped at 0 (`noise.kind == "injected"`, sigma 0.05 by default). `--inject-noise 0`
measures engine noise only (`kind == "engine"`; variance_ratio is null when replicas agree).
variance_ratio[n] = sum over tokens of Var(estimate with n) / sum of Var(single score), over
`--variance-repeats` independent estimates; the expected value under iid replica noise is 1/n.

Real noise (`real_noise`): the HF scorer in bf16 on this CPU scores a rollout differently beside
different neighbours (up to ~0.08 nats; a repeat of the same batch is bit-identical), so the script
also measures variance_ratio with that scorer and random batch placements, nothing injected.

Correctness, checked every run (`sidecar.check`): every sidecar estimate lines up with its trace
(same key, n = 4, one value per generated token) and equals the scoring engine's single score to
1e-6 (deterministic CPU engine), which also equals the in-process engine's score.

Usage: python benchmarks/estimator.py --json [--requests 8] [--tokens 32] [--repeats 5]
       [--dtype float32|bfloat16] [--lengths spread|fixed] [--inject-noise auto|SIGMA]
       [--variance-repeats 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
# Both engines use the uni executor, which never reads this; 'nobind' states that binding here is
# done by CPU affinity (inherited by each engine-core process at spawn), not by vLLM's OMP setup.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import numpy as np  # noqa: E402

from moe_replay.estimator.core import EstimatorConfig, estimate  # noqa: E402
from moe_replay.models import build_tiny_model  # noqa: E402

from _estimator_sidecar import BLOCK, SIDECAR_N, Sidecar, pin_process  # noqa: E402  (sibling)

WORDS = "the cat route token model expert layer sample mixture alpha beta dog".split()
NS = (1, 2, 4, 8)
DEFAULT_SIGMA = 0.05
ROLLOUT_REPLICA = EstimatorConfig(n=SIDECAR_N, rollout_replica=True)
"""n = 4 with the rollout's recorded logprobs as replica 0: 3 re-scorings."""
RR_TOL = 2e-5
"""With the rollout as replica 0 the estimate differs from the single re-score by a quarter of the
prefill-vs-decode gap (fp32 CPU: <= ~1e-5, `prefill_score_vs_rollout_logprob_max_abs`)."""
ADAPTIVE = EstimatorConfig(n=SIDECAR_N, adaptive=True, min_n=2, max_n=8, rel_tol=1e-3)
"""Variance-adaptive: 2 replicas first, doubled (up to 8) while any token's relative standard error
of the mean probability exceeds 1e-3. On an engine whose replicas agree it stops at 2."""


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(6 + 3 * i)) for i in range(n)]


def lengths(requests: int, tokens: int, kind: str) -> list[int]:
    if kind == "fixed" or requests == 1:
        return [tokens] * requests
    return [max(1, round(tokens * (0.25 + 1.5 * i / (requests - 1)))) for i in range(requests)]


class NoisyScorer:
    """Adds N(0, sigma^2) to each scored logprob (clipped at 0): INJECTED noise, not engine noise."""

    def __init__(self, scorer, sigma: float, seed: int) -> None:
        self.scorer, self.sigma = scorer, sigma
        self.rng = np.random.default_rng(seed)

    def score_batch(self, traces):
        out = self.scorer.score_batch(traces)
        return [np.minimum(lp + self.rng.normal(0.0, self.sigma, lp.shape), 0.0) for lp in out]


def measure_real_noise(traces, model_dir: str, repeats: int, batch_size: int = 4) -> dict:
    """Variance ratio under a noise source this CPU really has: HF bf16 scoring depends on the batch.

    The HF scorer (force_routes, use_support) in bf16 gives a rollout a different score beside
    different neighbours (padding and the GEMMs' row count change the kernels' blocking), while a
    repeat of the same batch is bit-identical. Replicas placed in random batches ('shuffle',
    `batch_size` rollouts per batch, a new seed per repeat) therefore carry real batch-composition
    noise, like a GPU engine's; nothing is injected.
    """
    from moe_replay.integrations.hf.scorer import HFScorer, HFScorerConfig

    hf = HFScorer(HFScorerConfig(model_dir, dtype="bfloat16", force_routes=True, use_support=True))

    def gap(a, b):
        return max(float(np.abs(x - y).max()) for x, y in zip(a, b))

    full = hf.score_batch(traces)
    spread = {"repeat_same_batch": gap(full, hf.score_batch(traces)),
              "alone_vs_full_batch": gap(full, [hf.score_batch([t])[0] for t in traces]),
              "reversed_batch": gap(full, hf.score_batch(traces[::-1])[::-1])}
    probs = {n: [] for n in NS}
    for k in range(repeats):
        for n in NS:
            cfg = EstimatorConfig(n=n, batch_placement="shuffle", seed=1000 * k + 17 * n)
            probs[n].append(np.concatenate([e.prob_G for e in estimate(traces, hf, cfg, batch_size=batch_size)]))
    var = {n: float(np.stack(probs[n]).var(axis=0, ddof=1).sum()) for n in NS}
    return {
        "kind": "real (not injected)",
        "scorer": "HFScorer bf16 on CPU, force_routes + use_support",
        "source": "batch composition: each replica scored in a random batch of "
                  f"{batch_size} of the {len(traces)} rollouts (placement 'shuffle')",
        "spread_max_abs_logprob": spread,
        "variance_ratio": {str(n): var[n] / var[1] if var[1] > 0 else None for n in NS},
        "variance_ratio_target": {str(n): 1.0 / n for n in NS},
        "repeats": repeats,
    }


def pi_old_refusals(scorer, traces) -> dict:
    """π_old refuses what the trainer refuses (moe_replay/identity.py), on this engine: the traces naming
    another family of the same shape (qwen2_moe), the traces of weights version 1 scored under version 2,
    and, with off_policy on purpose, the rollout's version-1 logprobs as a replica of version-2 re-scorings.
    True where refused with the typed error; nothing is scored."""
    from moe_replay.errors import GeometryMismatchError, WeightsVersionError
    from moe_replay.estimator import ReplicaVersionError

    other = [dataclasses.replace(t, geometry=dataclasses.replace(t.geometry, family="qwen2_moe")) for t in traces]
    v1 = [dataclasses.replace(t, weights_version=1) for t in traces]
    cases = {"pi_old_refused_other_model": (other, scorer, EstimatorConfig(n=2), GeometryMismatchError),
             "pi_old_refused_other_version": (v1, scorer.with_weights(2), EstimatorConfig(n=2), WeightsVersionError),
             "pi_old_refused_mixed_versions": (v1, scorer.with_weights(2, off_policy=True),
                                               EstimatorConfig(n=2, rollout_replica=True), ReplicaVersionError)}
    out = {}
    for name, (given, sc, cfg, err) in cases.items():
        try:
            estimate(given, sc, cfg)
        except err as e:
            out[name], out[name + "_error"] = True, f"{type(e).__name__}: {e}"
        else:
            out[name] = False
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--engine", default="compiled", choices=["compiled", "eager"],
                    help="vLLM's default compiled forward (enforce_eager=False; forcing runs inside it, "
                         "integrations/vllm/scoring/force_step.py) or enforce_eager=True, for every engine")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--size", default="bench", choices=["tiny", "bench"],
                    help="model size preset (moe_replay.models.SIZES); tiny: a smoke run (tests/test_bench_json.py)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--lengths", default="spread", choices=["spread", "fixed"],
                    help="max_tokens per rollout in the sidecar figures: 'spread' (0.25x..1.75x --tokens) or all --tokens")
    ap.add_argument("--inject-noise", default="auto", help="'auto' (inject sigma 0.05 only if the engine has no "
                    "replica noise), or a sigma >= 0 (0: engine noise only)")
    ap.add_argument("--variance-repeats", type=int, default=16)
    ap.add_argument("--real-noise-repeats", type=int, default=32,
                    help="independent estimates per n for the real-noise variance ratio (HF bf16 scorer)")
    args = ap.parse_args()
    if args.inject_noise != "auto" and float(args.inject_noise) < 0:
        ap.error("--inject-noise must be 'auto' or >= 0")

    import torch

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("the sidecar layout needs 2 cores (rollout engine, scoring engine); found " + str(cores))
    rollout_cpus, scoring_cpus = {cores[0]}, {cores[1]}
    all_threads = torch.get_num_threads()
    set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op in this process

    def layout(kind: str) -> None:
        """This process: 'sidecar' = the client on the scoring core, one OpenMP thread; 'single' = the
        earlier single-engine setup (in-process engine and HF on every core, torch's default threads)."""
        if kind == "sidecar":
            pin_process(scoring_cpus)
            set_threads(1)
        else:
            pin_process(set(cores))
            set_threads(all_threads)

    from vllm import LLM, SamplingParams

    from moe_replay.integrations.hf.scorer import HFScorer, HFScorerConfig
    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture, VllmScorer, VllmScorerConfig, scoring_engine_kwargs

    tmp = tempfile.TemporaryDirectory()
    model_dir = build_tiny_model("qwen3_moe", Path(tmp.name) / "bench", size=args.size, seed=0)
    L = lengths(args.requests, args.tokens, args.lengths)
    eager = args.engine == "eager"
    side = Sidecar(str(model_dir), args.dtype, args.requests, eager)
    side.start(rollout_cpus, scoring_cpus)
    layout("single")

    llm = LLM(**scoring_engine_kwargs(model=str(model_dir), dtype=args.dtype, enforce_eager=eager, max_model_len=512,
                                      max_num_seqs=max(8, args.requests * 5), max_num_batched_tokens=2048, seed=0,
                                      distributed_executor_backend="uni", block_size=BLOCK))
    cap = VllmCapture(llm, CaptureConfig())
    scorer = VllmScorer(llm, VllmScorerConfig(force_routes=True, use_support=True, prompt_reuse=False))
    reuse_cfg = VllmScorerConfig(force_routes=True, use_support=True, prompt_reuse=True)

    def reuse_scorer():
        """Prompt reuse under a fresh salt: every timed run starts cold (its first replica round
        computes every token and caches the prompts; later rounds read them)."""
        return scorer.with_config(dataclasses.replace(reuse_cfg, salt=uuid.uuid4().hex))
    hf = HFScorer(HFScorerConfig(str(model_dir), dtype="float32", force_routes=True, use_support=True))
    sps = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=args.tokens, ignore_eos=True)
    P = prompts(args.requests)
    sps_side = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=n, ignore_eos=True) for n in L]
    sps_fixed = [sps] * args.requests

    def rollout():
        return cap.generate(P, sps, use_tqdm=False)[1]

    rk_scorer = scorer.with_config(VllmScorerConfig(force_routes=True, use_support=True, read_rollout_kv=True,
                                                    on_reuse_miss="count"))
    """Scoring on the engine that sampled: every replica reads the rollout's own prompt blocks (the
    rollouts here all run on `llm` with the same prompts, so their prompt blocks stay cached)."""

    def pipelined(sc=None, replicas=4):
        sc = sc or scorer
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
                    for _ in range(replicas):  # replicas as separate requests: they land in different steps
                        ids = sc.submit([t])
                        subs.append((t, ids))
                        pending.update(ids)
                else:
                    pending.discard(o.request_id)
        assert not pending
        return [sc.finish([t], ids)[0] for t, ids in subs]

    traces = rollout()
    refusals = pi_old_refusals(scorer, traces)
    for _ in range(2):  # warm-up of every path
        estimate(traces, scorer, EstimatorConfig(n=1), batch_size=args.requests)
        hf.score_batch(traces)
    pipelined()
    layout("sidecar")
    for _ in range(2):
        side.run(side.serial(P, sps_side))
    check = side.check(*side.run(side.pipelined(P, sps_side)), scorer)
    check_fixed = side.check(*side.run(side.pipelined(P, sps_fixed)), scorer)
    rb = side.reuse_backend()
    check_reuse = side.check(*side.run(side.pipelined(P, sps_side, backend=rb)), scorer, rb)
    check_reuse["reuse_stats"] = dict(rb.reuse_stats)
    rb = side.reuse_backend()
    check_reuse_rollout = side.check(*side.run(side.pipelined(P, sps_side, backend=rb, est_cfg=ROLLOUT_REPLICA)), scorer, rb,
                                     tol=RR_TOL)
    check_reuse_rollout["reuse_stats"] = dict(rb.reuse_stats)
    layout("single")
    rs = reuse_scorer()
    est_reuse = estimate(traces, rs, EstimatorConfig(n=4), batch_size=args.requests)
    full4 = scorer.score_batch(traces)
    reuse_check = {"max_abs_n4_reuse_estimate_vs_full_score": max(float(np.abs(e.logprob_G - f).max())
                                                                   for e, f in zip(est_reuse, full4)),
                   "stats_n4": dict(rs.reuse_stats)}
    assert reuse_check["max_abs_n4_reuse_estimate_vs_full_score"] <= 1e-6, reuse_check
    est_rk = estimate(traces, rk_scorer, EstimatorConfig(n=4), batch_size=args.requests)
    reuse_check["max_abs_n4_rollout_kv_estimate_vs_full_score"] = max(float(np.abs(e.logprob_G - f).max())
                                                                      for e, f in zip(est_rk, full4))
    reuse_check["stats_n4_rollout_kv"] = dict(rk_scorer.reuse_stats)
    assert reuse_check["max_abs_n4_rollout_kv_estimate_vs_full_score"] <= 1e-6, reuse_check
    assert rk_scorer.reuse_stats["misses"] == 0, reuse_check
    rk_scorer.reuse_stats.clear()
    # the rollout as replica 0: the estimate is the mean over the recorded values and n - 1 re-scorings
    est_rr = estimate(traces, reuse_scorer(), ROLLOUT_REPLICA, batch_size=args.requests)
    reuse_check["max_abs_n4_reuse_rollout_estimate_vs_full_score"] = max(float(np.abs(e.logprob_G - f).max())
                                                                         for e, f in zip(est_rr, full4))
    assert all(e.n == 4 and e.from_rollout for e in est_rr)
    assert reuse_check["max_abs_n4_reuse_rollout_estimate_vs_full_score"] <= RR_TOL, reuse_check

    def forwarded(sc, cfg: EstimatorConfig) -> dict:
        """Engine requests and tokens forwarded (tokens - the engine's prefix hits) by one n = 4 estimate."""
        sc.reuse_stats.clear()
        estimate(traces, sc, cfg, batch_size=args.requests)
        st = dict(sc.reuse_stats)
        sc.reuse_stats.clear()
        return {"requests": st["requests"], "tokens": st["tokens"], "cached_tokens": st["cached_tokens"],
                "forwarded_tokens": st["tokens"] - st["cached_tokens"]}

    n4 = EstimatorConfig(n=4)
    forwarded_n4 = {"full": forwarded(scorer, n4), "reuse": forwarded(reuse_scorer(), n4),
                    "reuse_rollout": forwarded(reuse_scorer(), ROLLOUT_REPLICA),
                    "rollout_kv": forwarded(rk_scorer, n4), "rollout_kv_rollout": forwarded(rk_scorer, ROLLOUT_REPLICA)}

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
    times: dict[str, list[float]] = {}

    def timed(name, fn):
        layout("sidecar" if name in SIDECAR_JOBS else "single")
        t0 = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)

    jobs = [("rollout", lambda: side.run(side.rollout(P, sps_side))),
            ("serial", lambda: side.run(side.serial(P, sps_side))),
            ("pipelined", lambda: side.run(side.pipelined(P, sps_side, "spread"))),
            ("rollout_fixed", lambda: side.run(side.rollout(P, sps_fixed))),
            ("serial_fixed", lambda: side.run(side.serial(P, sps_fixed))),
            ("pipelined_fixed", lambda: side.run(side.pipelined(P, sps_fixed, "fixed"))),
            ("rollout_same_engine", rollout), ("hf", lambda: hf.score_batch(traces)),
            ("serial_same_engine", lambda: estimate(rollout(), scorer, EstimatorConfig(n=4), batch_size=args.requests)),
            ("pipelined_same_engine", pipelined),
            ("pipelined_adaptive", lambda: adaptive_n.extend(
                e.n for e in side.run(side.pipelined(P, sps_side, "adaptive", ADAPTIVE))[1].values())),
            ("est_adaptive", lambda: adaptive_n.extend(
                e.n for e in estimate(traces, scorer, ADAPTIVE, batch_size=args.requests)))]
    jobs += [(f"est{n}", lambda n=n: estimate(traces, scorer, EstimatorConfig(n=n), batch_size=args.requests)) for n in NS]
    jobs += [(f"est{n}_reuse", lambda n=n: estimate(traces, reuse_scorer(), EstimatorConfig(n=n), batch_size=args.requests))
             for n in NS]
    jobs += [("est4_rollout_kv", lambda: estimate(traces, rk_scorer, EstimatorConfig(n=4), batch_size=args.requests)),
             ("pipelined_same_engine_rollout_kv", lambda: pipelined(rk_scorer))]
    jobs += [("pipelined_reuse", lambda: side.run(side.pipelined(P, sps_side, "reuse", backend=side.reuse_backend())))]
    jobs += [(f"est{n}_reuse_rollout", lambda n=n: estimate(traces, reuse_scorer(), dataclasses.replace(ROLLOUT_REPLICA, n=n),
                                                           batch_size=args.requests)) for n in NS if n > 1]
    jobs += [("est4_rollout_kv_rollout", lambda: estimate(traces, rk_scorer, ROLLOUT_REPLICA, batch_size=args.requests)),
             ("pipelined_same_engine_rollout_kv_rollout", lambda: pipelined(rk_scorer, replicas=SIDECAR_N - 1)),
             ("pipelined_reuse_rollout", lambda: side.run(side.pipelined(P, sps_side, "reuse_rollout", ROLLOUT_REPLICA,
                                                                         backend=side.reuse_backend())))]
    SIDECAR_JOBS = {"rollout", "serial", "pipelined", "rollout_fixed", "serial_fixed", "pipelined_fixed",
                    "pipelined_adaptive", "pipelined_reuse", "pipelined_reuse_rollout"}
    adaptive_n: list[int] = []
    side.rollouts_done_s.clear()
    for r in range(args.repeats):
        for name, fn in (jobs[r % len(jobs):] + jobs[: r % len(jobs)]):
            timed(name, fn)
    layout("single")
    med = {k: statistics.median(v) for k, v in times.items()}
    done_s = {k: statistics.median(v) for k, v in side.rollouts_done_s.items()}
    layout("sidecar")
    processes = side.describe()
    layout("single")

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

    real_noise = measure_real_noise(traces, str(model_dir), args.real_noise_repeats)

    hf_tokens = int(sum(t.num_tokens for t in traces))
    n4_jobs = {"full": "est4", "reuse": "est4_reuse", "reuse_rollout": "est4_reuse_rollout",
               "rollout_kv": "est4_rollout_kv", "rollout_kv_rollout": "est4_rollout_kv_rollout"}

    def model(stat: dict[str, float]) -> dict:
        c_vllm, c_hf = stat["est1"] / hf_tokens, stat["hf"] / hf_tokens
        return {"vllm_s_per_token": c_vllm, "hf_s_per_token": c_hf, "vllm_over_hf_per_token": c_vllm / c_hf,
                "n4_budget_forwarded_tokens": hf_tokens * c_hf / c_vllm,
                "n4_predicted_over_hf": {k: v["forwarded_tokens"] * c_vllm / (hf_tokens * c_hf) for k, v in forwarded_n4.items()},
                "n4_measured_over_hf": {k: stat[j] / stat["hf"] for k, j in n4_jobs.items()}}

    cost_model = {
        "note": "n = 4 cost / HF recompute ~ forwarded_tokens x vllm_s_per_token / (hf_tokens x hf_s_per_token); "
                "per-token costs from full re-scoring at n = 1 (every token forwarded once) and the HF forward; "
                "from the medians and from the minima of the repeats (on a shared machine the least disturbed repeat)",
        "hf_tokens": hf_tokens, "n4_forwarded": forwarded_n4,
        "from_median_s": model(med), "from_min_s": model({k: min(v) for k, v in times.items()}),
    }
    sidecar = {
        "layout": "two AsyncLLM engines (uni executor: model in each engine-core process), one core each; "
                  "finished rollouts streamed into an EstimatorService over the scoring engine",
        "rollout_engine": {"kind": "vllm AsyncLLM + AsyncVllmCapture", "cpus": sorted(rollout_cpus), "dtype": args.dtype},
        "scoring_engine": {"kind": "vllm AsyncLLM + AsyncVllmScorer (force_routes, use_support)",
                           "cpus": sorted(scoring_cpus), "dtype": args.dtype},
        "client": {"kind": "this process: asyncio loop, AsyncLLM front ends, EstimatorService "
                           "(the in-process engine and HF of the other figures live here too, idle meanwhile)",
                   "cpus": sorted(scoring_cpus), "torch_threads": 1},
        "engine_torch_threads": "1 (OMP_NUM_THREADS=1 at spawn, 1-core affinity)",
        "single_engine_figures": {"note": "estimator_s, hf_recompute_s and *_same_engine_s: the in-process engine and HF "
                                          "in this process, unpinned", "cpus": cores, "torch_threads": all_threads},
        "pipelined_rollouts_done_s": done_s["spread"],
        "pipelined_tail_s": med["pipelined"] - done_s["spread"],
        "binding": "CPU affinity (sched_setaffinity on every thread) set before each engine is spawned and inherited; "
                   f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND')!r} "
                   "(not read by the uni executor)",
        "estimator": {"n": SIDECAR_N,
                      "service": {"batch_size": side.svc_cfg.batch_size, "concurrency": side.svc_cfg.concurrency}},
        "lengths": args.lengths, "max_tokens": L,
        "fixed_lengths": {"max_tokens": [args.tokens] * args.requests, "rollout_s": med["rollout_fixed"],
                          "serial_s": med["serial_fixed"], "pipelined_s": med["pipelined_fixed"],
                          "pipelined_overhead": med["pipelined_fixed"] / med["rollout_fixed"] - 1.0,
                          "pipelined_rollouts_done_s": done_s["fixed"],
                          "check": check_fixed},
        "processes": processes,
        "check": check,
    }
    result = {
        "model": "qwen3_moe/bench", "engine_dtype": args.dtype, "engine": args.engine, "requests": args.requests, "tokens": args.tokens,
        "scored_tokens": int(sum(t.num_generated for t in traces)),
        "estimator_s": {str(n): med[f"est{n}"] for n in NS},
        "hf_recompute_s": med["hf"],
        "rollout_s": med["rollout"],
        "serial_s": med["serial"],
        "pipelined_s": med["pipelined"],
        "pipelined_overhead": med["pipelined"] / med["rollout"] - 1.0,
        "pipelined_overhead_target": 0.10,
        "rollout_same_engine_s": med["rollout_same_engine"],
        "serial_same_engine_s": med["serial_same_engine"],
        "pipelined_same_engine_s": med["pipelined_same_engine"],
        "pipelined_same_engine_overhead": med["pipelined_same_engine"] / med["rollout_same_engine"] - 1.0,
        "n4_over_hf_recompute": med["est4"] / med["hf"],
        "estimator_s_reuse": {str(n): med[f"est{n}_reuse"] for n in NS},
        "pipelined_s_reuse": med["pipelined_reuse"],
        "pipelined_overhead_reuse": med["pipelined_reuse"] / med["rollout"] - 1.0,
        "n4_reuse_over_hf_recompute": med["est4_reuse"] / med["hf"],
        "reuse": {"block_size": BLOCK, "note": "prompt reuse: the first replica round of each run computes every "
                  "token and caches whole prompt blocks (fresh salt per run); later replicas read "
                  "floor((P-1)/block)*block prompt tokens and forward the rest",
                  "pipelined_rollouts_done_s": done_s["reuse"], "check": reuse_check, "sidecar_check": check_reuse},
        "estimator_s_reuse_rollout": {str(n): med[f"est{n}_reuse_rollout"] for n in NS if n > 1},
        "n4_reuse_rollout_over_hf_recompute": med["est4_reuse_rollout"] / med["hf"],
        "pipelined_s_reuse_rollout": med["pipelined_reuse_rollout"],
        "pipelined_overhead_reuse_rollout": med["pipelined_reuse_rollout"] / med["rollout"] - 1.0,
        "estimator_s_rollout_kv_rollout": {"4": med["est4_rollout_kv_rollout"]},
        "n4_rollout_kv_rollout_over_hf_recompute": med["est4_rollout_kv_rollout"] / med["hf"],
        "pipelined_same_engine_s_rollout_kv_rollout": med["pipelined_same_engine_rollout_kv_rollout"],
        "pipelined_same_engine_overhead_rollout_kv_rollout":
            med["pipelined_same_engine_rollout_kv_rollout"] / med["rollout_same_engine"] - 1.0,
        "rollout_replica": {"note": "EstimatorConfig(rollout_replica=True): replica 0 is the trace's recorded logprobs "
                            "(what the rollout's sampler scored), so n = 4 costs 3 re-scorings",
                            "pipelined_rollouts_done_s": done_s["reuse_rollout"], "sidecar_check": check_reuse_rollout},
        "cost_model": cost_model,
        "estimator_s_rollout_kv": {"4": med["est4_rollout_kv"]},
        "n4_rollout_kv_over_hf_recompute": med["est4_rollout_kv"] / med["hf"],
        "pipelined_same_engine_s_rollout_kv": med["pipelined_same_engine_rollout_kv"],
        "pipelined_same_engine_overhead_rollout_kv": med["pipelined_same_engine_rollout_kv"] / med["rollout_same_engine"] - 1.0,
        "rollout_kv": {"note": "scoring on the engine that sampled (VllmScorerConfig(read_rollout_kv=True)): every "
                       "replica, the first included, reads the rollout's own unsalted prompt blocks and caches nothing",
                       "timed_stats": dict(rk_scorer.reuse_stats)},
        "estimator_adaptive": {
            "config": {"n": ADAPTIVE.n, "min_n": ADAPTIVE.min_n, "max_n": ADAPTIVE.max_n, "rel_tol": ADAPTIVE.rel_tol},
            "s": med["est_adaptive"], "over_hf_recompute": med["est_adaptive"] / med["hf"],
            "replicas_used_mean": float(np.mean(adaptive_n)) if adaptive_n else None,
            "pipelined_s": med["pipelined_adaptive"],
            "pipelined_overhead": med["pipelined_adaptive"] / med["rollout"] - 1.0,
            "pipelined_rollouts_done_s": done_s["adaptive"],
            "note": "replicas stop where they agree: on this deterministic CPU engine after min_n; under real "
                    "engine noise they double up to max_n, so the cost follows the noise"},
        "variance_ratio": variance_ratio,
        "variance_ratio_target": {str(n): 1.0 / n for n in NS},
        "variance_repeats": args.variance_repeats,
        "noise": noise,
        "real_noise": real_noise,
        "prefill_score_vs_rollout_logprob_max_abs": prefill_vs_decode,
        "sidecar": sidecar,
        "refusals": refusals,
        "repeats": args.repeats,
        "min_s": {k: min(v) for k, v in times.items()},
        "raw_s": times,
    }
    side.shutdown()
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
