"""Coverage of HF replay over every MoE family of the installed transformers, per precision mode; prints JSON.

    python benchmarks/hf_coverage.py --json     # JSON only (the default output)
    python benchmarks/hf_coverage.py --write    # and regenerate docs/hf_coverage.md
    python benchmarks/hf_coverage.py qwen3_moe deepseek_v3 --modes bf16   # a few families, one mode
    python benchmarks/hf_coverage.py minimax --modes fsdp2_bf16 --update    # re-run those rows of docs/hf_coverage.md

Keys: families_total and families_replayed per mode (fp32; bf16 weights as from_pretrained loads them;
autocast_bf16: fp32 weights, forward under bf16 autocast; fsdp2_bf16: sharded with fully_shard over 2 gloo
ranks before attach, fp32 weights under a bf16 MixedPrecisionPolicy; fsdp2_autocast_bf16: sharded likewise,
fp32 weights, forward under bf16 autocast). Replayed: attach and first-forward verification pass,
self-replay bit-identical, other routes change the output, backward finite, router gradient non-zero.
seconds per mode; modes.<mode>.replayed, .families_refused ({family: reason}: replay refuses it by name),
.families_builder (the tiny model does not build, or HF's own forward fails with nothing attached: the builder's
failure, not the family's), .families_error (anything else) and .families_by_status (counts).
Target: every mode, FSDP2 ones included, replays as many families as fp32, at least 45, and no family is
accepted in a mode where its self-replay is not bit-identical. CPU, one torch thread per process, tiny
random models built from config classes (no download); the FSDP2 modes run in one spawn of 2 ranks that
loops over every family.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="model types to check (default: every MoE family)")
    parser.add_argument("--json", action="store_true", help="print the JSON summary (the default output; kept for scripts)")
    parser.add_argument("--write", action="store_true", help="regenerate docs/hf_coverage.md (every family, every mode)")
    parser.add_argument("--update", action="store_true", help="re-run the named families' rows of docs/hf_coverage.md in --modes "
                        "and rewrite those rows and the counts (the rest of the table as it is)")
    parser.add_argument("--modes", default=None, help="comma-separated precision modes (default: all)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    from moe_replay.integrations.hf.coverage import PRECISIONS, markdown, moe_families, read_table, run_all, summary

    families = moe_families()
    unknown = sorted(set(args.families) - set(families))
    if unknown:
        parser.error(f"not MoE families of transformers {transformers.__version__}: {unknown}; known: {sorted(families)}")
    modes = args.modes.split(",") if args.modes else list(PRECISIONS)
    bad = sorted(set(modes) - set(PRECISIONS))
    if bad:
        parser.error(f"unknown modes {bad}; known: {list(PRECISIONS)}")
    if args.write and (args.families or len(modes) != len(PRECISIONS)):
        parser.error("--write regenerates the whole table: every family, every mode")
    if args.update and (args.write or not args.families):
        parser.error("--update re-runs named families (and --modes) in the table; --write regenerates all of it")
    chosen = {f: families[f] for f in args.families} if args.families else families
    t0 = time.perf_counter()
    results = run_all(chosen, modes)
    out = summary(results)
    out["wall_seconds"] = round(time.perf_counter() - t0, 1)
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "hf_coverage.md")
    if args.write:
        with open(path, "w") as f:
            f.write(markdown(results, chosen))
    if args.update:
        table = read_table(path)
        for mode, rs in results.items():
            fresh = {r.family: r for r in rs}
            table[mode] = [fresh.pop(r.family, r) for r in table.get(mode, [])] + list(fresh.values())
        with open(path, "w") as f:
            f.write(markdown({p: table[p] for p in PRECISIONS if p in table}, families))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
