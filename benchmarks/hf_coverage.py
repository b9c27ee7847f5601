"""Coverage of HF replay over every MoE family of the installed transformers; prints JSON.

    python benchmarks/hf_coverage.py            # JSON only
    python benchmarks/hf_coverage.py --write    # and regenerate docs/hf_coverage.md
    python benchmarks/hf_coverage.py qwen3_moe deepseek_v3   # a few families

Keys: families_total, families_replayed (self-replay bit-identical, other routes change the output,
backward finite, router gradient non-zero), families_refused ({family: reason}, refusals and
errors). Target (issue 14): families_replayed >= 30 on transformers 5.19, no family replayed
wrongly. CPU, one torch thread, tiny random models built from config classes (no download).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="model types to check (default: every MoE family)")
    parser.add_argument("--write", action="store_true", help="regenerate docs/hf_coverage.md")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    from moe_replay.integrations.hf.coverage import markdown, moe_families, run_all, summary

    families = moe_families()
    unknown = sorted(set(args.families) - set(families))
    if unknown:
        parser.error(f"not MoE families of transformers {transformers.__version__}: {unknown}; known: {sorted(families)}")
    chosen = {f: families[f] for f in args.families} if args.families else families
    results = run_all(chosen)
    if args.write:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "hf_coverage.md")
        with open(path, "w") as f:
            f.write(markdown(results, chosen))
    print(json.dumps(summary(results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
