"""Two capture settings in lockstep: where a difference in capture's overhead comes from.

benchmarks/capture.py compares capture against no capture; this diagnostic compares two settings
of it (a variant against its base), on two eager vLLM-CPU engines of the bench model stepped in
lockstep exactly as there (`capture._lockstep_round`: same requests, same sampled tokens, the
roles swapped every two rounds), and prints each phase's variant-minus-base seconds over the base
side's step time (median over pairs, with the 95% interval of that median), as capture.py's
`phases`. Why: capture.py's eager `phases` put the forward +0.45-0.68% slower with capture attached
(five runs), more than capture's route functions explain; each variant below removes one
candidate cause. (Leading underscore: a diagnostic, not one of the benchmarks `moe-replay bench` runs.)

Variants (VARIANTS; base first, variant second):
  routes       capture without routes  vs  capture (held router ids, the route functions, land, the route flush)
  step_buffer  router ids held         vs  copied into a host step buffer by the route function (one torch copy_ a layer)
  copy_at_land router ids held until the flush  vs  copied at `land` and dropped (the hold ends with the step)
  call_only    no route function       vs  `len` as every router's capture function (it runs torch.Tensor.__len__,
                                           a Python frame), nothing held
                                           (both sides capture without routes)

Usage: python benchmarks/_capture_ab.py --variant routes [--pairs 24]   (prints one JSON object)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _routers(worker: Any) -> list[Any]:
    from moe_replay.integrations.vllm.model import find_moe_layers

    return [moe.router for _, moe in find_moe_layers(worker.model_runner.model)]


def _route_mode(worker: Any) -> str:
    from moe_replay.integrations.vllm.runner import runner_state

    routes = runner_state(worker.model_runner).capture.routes
    return "none" if routes is None else routes.mode


def _copy_at_land(worker: Any, on: bool) -> None:
    """On: `land` copies the step's held ids (by address) into an array of their own and drops the tensors."""
    import numpy as np

    from moe_replay.integrations.vllm.capture.route_hook import _ID_NUMPY
    from moe_replay.integrations.vllm.runner import runner_state
    from moe_replay.integrations.vllm.step import copy_from_addresses

    if not on:
        return
    rc = runner_state(worker.model_runner).capture.routes
    land = type(rc)._land

    def copying_land(offset: int, num_tokens: int) -> str | None:
        problem = land(rc, offset, num_tokens)
        if problem is not None:
            return problem
        n, held, ptrs, dtype = rc._landed[-1]
        if all(ptrs):
            K = held[0].shape[1]
            out = np.empty((len(held) * n, K), dtype=_ID_NUMPY[dtype])
            copy_from_addresses(out, ptrs, [n * K * out.itemsize] * len(ptrs))
            views = [out[j * n : (j + 1) * n] for j in range(len(held))]
            rc._landed[-1] = (n, views, [v.ctypes.data for v in views], dtype)
        return None

    rc.__dict__["_land"] = copying_land


def _call_only(worker: Any, on: bool) -> None:
    for router in _routers(worker):
        router.set_capture_fn(len if on else None)


VARIANTS: dict[str, dict[str, Any]] = {
    "routes": {"config": ({"routes": False}, {}), "modes": ("none", "hold")},
    "step_buffer": {"config": ({}, {}), "modes": ("hold", "step buffer"), "hold_devices": ({"cpu"}, set())},
    "copy_at_land": {"config": ({}, {}), "modes": ("hold", "hold"), "patch": _copy_at_land},
    "call_only": {"config": ({"routes": False}, {"routes": False}), "modes": ("none", "none"), "patch": _call_only},
}
"""name -> CaptureConfig fields (base, variant), the route modes each side must report, and either
route_hook.HOLD_DEVICES for each side's install or a worker patch (args: on) run after it."""

def run(variant: str, pairs: int) -> dict[str, Any]:
    import capture as bench

    from moe_replay.models import build_tiny_model
    from moe_replay.report.bench import median_ci95

    spec = VARIANTS[variant]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model("qwen3_moe", Path(tmp) / "bench", seed=0, size="bench")
        engines = [bench._engine(model_dir, 8, eager=True, capture=True) for _ in range(2)]
        try:
            rows, same_all = _pairs(bench, engines, spec, variant, pairs)
        finally:
            for engine in engines:
                engine.llm_engine.engine_core.shutdown()
    delta = {p: [(r[True][p] - r[False][p]) / r[False]["step"] for r in rows] for p in (*bench.PHASES, "total")}
    return {
        "diagnostic": "capture_ab", "variant": variant, "pairs": pairs, "identical_tokens": same_all,
        "variant_minus_base": {p: round(statistics.median(v), 5) for p, v in delta.items()},
        "variant_minus_base_ci95": {p: median_ci95(v) for p, v in delta.items()},
    }


def _pairs(bench: Any, engines: list[Any], spec: dict[str, Any], variant: str, pairs: int) -> tuple[list, bool]:
    """Per pair, each phase's seconds on both sides (capture._phase_row, plus collect and total)."""
    from vllm import SamplingParams

    import moe_replay.integrations.vllm.capture.route_hook as route_hook
    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture

    prompts = bench._workload(8)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=64, ignore_eos=True)
    for engine in engines:
        engine.collective_rpc(bench._time_phases)
    rows, same_all = [], True
    hold_default = route_hook.HOLD_DEVICES
    for i in range(-4, pairs):
        c = (i // 2) % 2  # the engine that runs the variant this round
        sides = {True: engines[c], False: engines[1 - c]}
        caps = {}
        try:
            for flag, llm in sides.items():
                route_hook.HOLD_DEVICES = spec.get("hold_devices", (hold_default, hold_default))[flag]
                caps[flag] = VllmCapture(llm, CaptureConfig(**spec["config"][flag]))
                if "patch" in spec:
                    llm.collective_rpc(spec["patch"], args=(flag,))
                mode = llm.collective_rpc(_route_mode)[0]
                if mode != spec["modes"][flag]:
                    raise RuntimeError(f"{variant}: the {'variant' if flag else 'base'} side captures routes in "
                                       f"mode {mode!r}, expected {spec['modes'][flag]!r}")
        finally:
            route_hook.HOLD_DEVICES = hold_default
        try:
            for llm in sides.values():
                llm.collective_rpc(bench._time_outer_execute)
            got = bench._lockstep_round(sides, prompts, params, f"ab{i}", first=i % 2 == 0)
            for llm in sides.values():
                llm.collective_rpc(bench._untime_outer_execute)
            collect_s = {}
            for flag, cap in caps.items():
                outs = [got[flag]["outputs"][k] for k in sorted(got[flag]["outputs"])]
                t0 = time.perf_counter()
                cap.collect(outs)
                collect_s[flag] = time.perf_counter() - t0
        finally:
            for flag, cap in caps.items():
                cap.uninstall()
                if "patch" in spec:
                    sides[flag].collective_rpc(spec["patch"], args=(False,))
        phases = {flag: llm.collective_rpc(bench._read_phases)[0] for flag, llm in sides.items()}
        if i < 0:
            continue
        row = bench._phase_row(phases, got, 0.0)
        for flag in sides:
            row[flag]["collect"] = collect_s[flag]
            row[flag]["total"] = row[flag]["step"] + collect_s[flag]
        rows.append(row)
        same_all &= all(got[False]["outputs"][k].outputs[0].token_ids == o.outputs[0].token_ids
                        for k, o in got[True]["outputs"].items())
    return rows, same_all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    ap.add_argument("--pairs", type=int, default=24, help="lockstep pairs (4 warm-up rounds before them)")
    args = ap.parse_args(argv)
    print(json.dumps(run(args.variant, args.pairs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
