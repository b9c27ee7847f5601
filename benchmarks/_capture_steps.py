"""Diagnostic: capture's per-step host time on one engine, in a minute (not a benchmark of record).

`benchmarks/capture.py` resolves capture's overhead against a plain engine in lockstep (~5-10
min). This runs one capture-ready engine of the same bench model alone, `--rounds` rounds of 8
requests x 64 tokens after 4 warm-up rounds, capture attached each round, and prints one JSON
object: per part the median microseconds per engine step (`us_per_step`, the parts of
`VllmCapture.timings()`; capture's one hook a step is step.after_sample), the step and collect
times, and `bracket_us`: the runner's execute_model as wrapped by the step bracket, less the
execute_model inside it and less any capture hook timed in there (step.after_forward, which runs
only where capture wraps no sampler), i.e. what the step bracket itself costs. Compare variants of the
code by running this on each, twice or more: whole processes differ by up to ~20% in forward time
on the shared 2-core machine, the per-part times by ~10%.

Usage: python benchmarks/_capture_steps.py [--rounds 16] [--eager]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import capture as bench  # noqa: E402  (the benchmark's engine, workload, phase timers and vLLM env defaults)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (default: compiled)")
    args = ap.parse_args(argv)
    from vllm import SamplingParams

    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture
    from moe_replay.models import build_tiny_model

    model_dir = build_tiny_model("qwen3_moe", Path(tempfile.mkdtemp()) / "bench", seed=0, size="bench")
    llm = bench._engine(model_dir, 8, eager=args.eager, capture=True)
    prompts = bench._workload(8)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=64, ignore_eos=True)
    llm.collective_rpc(bench._time_phases)
    parts: dict[str, list[float]] = {}
    rows: list[dict[str, float]] = []
    clock = time.perf_counter
    for i in range(args.rounds + 4):
        cap = VllmCapture(llm, CaptureConfig())
        try:
            llm.collective_rpc(bench._time_outer_execute)
            llm.collective_rpc(bench._read_phases)
            t0 = clock()
            outs = llm.generate(prompts, params, use_tqdm=False)
            t1 = clock()
            llm.collective_rpc(bench._untime_outer_execute)
            phase = llm.collective_rpc(bench._read_phases)[0]
            cap.collect(outs)
            t2 = clock()
            times, steps = cap.timings(), cap.stats()["steps"]
        finally:
            cap.uninstall()
        if i < 4:
            continue
        per_step = {k: v["s"] / steps for k, v in times.items()}
        for k, v in per_step.items():
            parts.setdefault(k, []).append(v)
        rows.append({"step": (t1 - t0) / steps, "collect": t2 - t1,
                     "outside": (phase["execute_out"] - phase["execute_in"]) / steps
                     - per_step.get("step.after_forward", 0.0)})
    us = lambda xs: round(statistics.median(xs) * 1e6, 2)  # noqa: E731
    print(json.dumps({
        "model": "qwen3_moe/bench", "enforce_eager": args.eager, "rounds": args.rounds,
        "step_ms": round(statistics.median(r["step"] for r in rows) * 1e3, 3),
        "collect_ms": round(statistics.median(r["collect"] for r in rows) * 1e3, 3),
        "bracket_us": us([r["outside"] for r in rows]),
        "us_per_step": {k: us(v) for k, v in sorted(parts.items(), key=lambda kv: -sum(kv[1]))},
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
