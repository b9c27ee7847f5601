"""Megatron's own routing replay (`trainer_path: megatron_native`) side by side with the project's path.

CPU, gloo, a GPTModel of 4 layers (MoE layers 1 and 3, 8 experts, top-2, softmax before top-k,
scaled), train mode; two micro-batches of random traces (so replay must force the routes), each
forward then both backward, as Megatron's schedule does. Per config (fp32 / bf16 parameters in
Float16Module, full activation recompute on / off), world size 1:

  native_vs_project_max_abs_diff  max |logits native - logits project| over both micro-batches (target 0)
  native_grad_max_abs_diff        max |router weight grad native - project| (target 0)
  all_grads_equal                 every parameter's gradient bit-identical on both paths
  native_forces                   free routing gives other logits than the native replay (the routes were forced)
  native_over_plain, project_over_plain
                                  median step time under each replay path / a plain (free-routing) step,
                                  the three arms interleaved round by round in rotating order (target <= 1.05);
                                  timed on the routes the model itself chooses (recorded with RouterReplay's
                                  RECORD), so every arm does the same expert work by construction and the
                                  ratio is replay's own cost
  bypass_refused                  {fused_router, sinkhorn}: each set on the model is refused by name by
                                  both paths and `auto`, before any forward

With --ranks (default), the same diffs for two gloo ranks (tests/megatron_native_worker.py, one spawn):
EP = 2 with the all-to-all dispatcher per config (`ep2_<config>`, each rank its own micro-batch shapes;
no timing: two processes on a 2-core machine time the machine), PP = 2 x VPP = 2 (`pp2_vpp2`), and verl
0.9.1's R3 helpers fed the project's traces (`verl_r3`).

Usage: python benchmarks/megatron_native.py --json [--hidden 128] [--rounds 15] [--no-ranks]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _time_arms(model, micro, rounds: int) -> dict[str, float]:
    """Median seconds per step of each arm, the arms interleaved in rotating order every round.
    `micro` replays the model's own routes, so every arm does the same expert work."""
    from tests.megatron_native_worker import step

    arms = [None, "megatron_native", "project"]
    for arm in arms:  # warm-up
        step(model, micro, arm, grads=False)
    seconds: dict[Any, list[float]] = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm in arms[r % 3:] + arms[:r % 3]:
            t0 = time.perf_counter()
            step(model, micro, arm, grads=False)
            seconds[arm].append(time.perf_counter() - t0)
    return {str(arm or "plain"): statistics.median(v) for arm, v in seconds.items()}


def run_one_process(hidden: int, rounds: int, lengths) -> dict[str, Any]:
    from moe_replay.integrations.megatron import model_geometry
    from moe_replay.replay import build_plan
    from tests import megatron_gloo as gloo
    from tests.megatron_native_worker import (VOCAB, bypass_refusals, compare, config_name, fresh_registry, gpt, own_route_traces,
                                              random_traces, refused_by_name)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gloo.init(0, 1, f"tcp://127.0.0.1:{port}")  # one thread: less exposed to a shared machine's load
    try:
        configs = {}
        for bf16 in (False, True):
            for recompute in (False, True):
                fresh_registry()
                model = gpt(bf16=bf16, recompute=recompute, hidden=hidden)
                geometry = model_geometry(model, vocab_size=VOCAB)
                traces = random_traces(lengths, geometry, "b")
                micro = [build_plan(t, geometry) for t in traces]
                figures = compare(model, micro)  # random routes: replay must force them
                own = [build_plan(own_route_traces(model, t, geometry), geometry) for t in traces]
                times = _time_arms(model, own, rounds)
                figures.update(
                    native_over_plain=round(times["megatron_native"] / times["plain"], 4),
                    project_over_plain=round(times["project"] / times["plain"], 4),
                    plain_step_ms=round(times["plain"] * 1e3, 2),
                    bypass_refused=refused_by_name(bypass_refusals(model, micro)),
                )
                configs[config_name(bf16, recompute)] = figures
        return configs
    finally:
        gloo.close()


def run_ranks() -> dict[str, Any]:
    from tests.megatron_native_worker import run

    with tempfile.TemporaryDirectory() as work:
        ranks = run(work)
    out: dict[str, Any] = {}
    for name in ranks[0]["ep2"]:
        per_rank = [r["ep2"][name] for r in ranks]
        out[f"ep2_{name}"] = {
            "native_vs_project_max_abs_diff": max(x["native_vs_project_max_abs_diff"] for x in per_rank),
            "native_grad_max_abs_diff": max(x["native_grad_max_abs_diff"] for x in per_rank),
            "all_grads_equal": all(x["all_grads_equal"] for x in per_rank),
            "native_forces": all(x["native_forces"] for x in per_rank),
            "shapes_per_rank": [x["shapes"] for x in per_rank],
        }
    out["pp2_vpp2"] = {"native_vs_project_max_abs_diff": max(r["vpp"]["native_vs_project_max_abs_diff"] for r in ranks),
                       "chunk_layers_per_rank": [r["vpp"]["chunk_layers"] for r in ranks]}
    out["verl_r3"] = {
        "routes_to_own_layer": all(v["mismatched_layers"] == [] for r in ranks for v in r["verl"]["lookups"].values())
        and all(r["verl"]["r3_nested"]["mismatched_layers"] == [] for r in ranks),
        "native_over_verl_registry_max_abs_diff": max(r["verl"]["native_vs_vpp_native_max_abs_diff"] for r in ranks),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (FFN and expert FFN: 2x)")
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds (each runs the three arms once)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--tokens", type=int, default=64, help="tokens of the longest sequence")
    ap.add_argument("--ranks", action=argparse.BooleanOptionalAction, default=True, help="also the two-rank cells")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    lengths = [tuple(max(4, args.tokens - 7 * i - 3 * m) for i in range(args.batch)) for m in range(2)]
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "setting": {"hidden": args.hidden, "micro_batches": 2, "lengths": lengths, "rounds": args.rounds, "cpu_threads": 1},
        "configs": run_one_process(args.hidden, args.rounds, lengths),
    }
    if args.ranks:
        result["ranks"] = run_ranks()
    result["wall_seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
