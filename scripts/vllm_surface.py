"""Check vLLM releases against the adapter's surface (integrations/vllm/surface/needs.py).

    python scripts/vllm_surface.py                    # every release from 0.26 to the newest published
    python scripts/vllm_surface.py 0.33.0 0.34.0      # those releases
    python scripts/vllm_surface.py --json             # the table as JSON: {"releases": {"0.33.0": {...}}}
    python scripts/vllm_surface.py --json --write     # and store it in the package (surface/table.json)
                                                      # and the support matrix in docs/vllm.md
    python scripts/vllm_surface.py --markdown         # the support matrix of this run
    python scripts/vllm_surface.py --installed        # also the installed vLLM, from its source

Each release's wheel is fetched without dependencies (`pip download --no-deps vllm==X`) into
--wheel-dir unless it is there already (~0.3 GB each), and its Python source is read from the zip
with `ast`, never imported (surface/source.py). The releases come from `pip index versions vllm`.
What a row holds and when a release is accepted: surface/check.py. --write stores every row of
this run; a run over some releases adds them to the table only when the table was made from the
same surface (its `surface_hash`), so a table never mixes rows of two lists.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from moe_replay.integrations.vllm.surface import TABLE, WheelTree, check_installed, check_tree, surface_hash, write_table
from moe_replay.integrations.vllm.surface.check import load_table, matrix_markdown, release_key, replace_matrix, table_document

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "vllm.md"
"""Where the support matrix lives (between surface.check's markers; rewritten by --write)."""

FIRST = (0, 26)
"""The oldest release checked by default: the one GPU runs were made on."""
DEFAULT_WHEELS = Path.home() / ".cache" / "moe_replay" / "vllm_wheels"


def published_releases() -> list[str]:
    """Final releases of `vllm` on the package registry from FIRST on, oldest first."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "vllm"], capture_output=True, text=True)
    m = re.search(r"Available versions:\s*(.+)", out.stdout)
    if out.returncode != 0 or m is None:
        raise SystemExit(f"cannot list vLLM releases with `pip index versions vllm` (rc {out.returncode}): "
                         f"{(out.stderr or out.stdout).strip()[-400:]}; name the releases to check instead")
    found = [v.strip() for v in m.group(1).split(",")]
    return sorted((v for v in found if re.fullmatch(r"\d+\.\d+\.\d+", v) and release_key(v)[:2] >= FIRST),
                  key=release_key)


def wheel_of(release: str, wheel_dir: Path) -> Path:
    """The release's wheel in wheel_dir, fetched without dependencies when it is not there."""
    have = sorted(wheel_dir.glob(f"vllm-{release}-*.whl"))
    if not have:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        print(f"fetching vllm=={release} into {wheel_dir} ...", file=sys.stderr)
        out = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                              "-d", str(wheel_dir), f"vllm=={release}"], capture_output=True, text=True)
        have = sorted(wheel_dir.glob(f"vllm-{release}-*.whl"))
        if out.returncode != 0 or not have:
            raise SystemExit(f"pip download --no-deps vllm=={release} failed (rc {out.returncode}): "
                             f"{(out.stderr or out.stdout).strip()[-400:]}")
    return have[0]


def check_release_wheel(release: str, wheel_dir: Path) -> dict:
    wheel = wheel_of(release, wheel_dir)
    row = check_tree(WheelTree(wheel))
    if row["version"] != release:
        raise SystemExit(f"{wheel.name}: its vllm/_version.py says {row['version']!r}, expected {release!r}")
    return row


def print_table(rows: dict[str, dict]) -> None:
    print(f"surface {surface_hash()}: one row per release (missing names: --json)")
    print(f"{'release':<10} {'accepted':<9} {'runners':<10} {'v1 missing':>10} {'mrv2 missing':>12}  incomplete parts")
    for v in sorted(rows, key=release_key):
        r = rows[v]
        bad = [f"{run}.{p}" for run in ("v1", "mrv2") for p, names in r[f"{run}_parts"].items() if names]
        print(f"{v:<10} {str(r['accepted']):<9} {','.join(r['runners']) or '-':<10} {len(r['v1_missing']):>10} "
              f"{len(r['mrv2_missing']):>12}  {', '.join(bad) or '-'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("releases", nargs="*", help="releases to check (default: every published one from 0.26)")
    ap.add_argument("--json", action="store_true", help="print the table as JSON")
    ap.add_argument("--write", action="store_true", help=f"store the rows in {TABLE.relative_to(ROOT)}")
    ap.add_argument("--wheel-dir", type=Path, default=DEFAULT_WHEELS, help=f"wheel cache (default {DEFAULT_WHEELS})")
    ap.add_argument("--installed", action="store_true", help="also check the installed vLLM from its source")
    ap.add_argument("--markdown", action="store_true", help="print the support matrix (docs/vllm.md) of this run")
    args = ap.parse_args(argv)

    releases = args.releases or published_releases()
    rows = {v: check_release_wheel(v, args.wheel_dir) for v in releases}
    if args.write:
        if not args.releases:
            written = write_table(rows)
        else:
            old = load_table() if TABLE.exists() else {"surface_hash": None, "releases": {}}
            if old["surface_hash"] != surface_hash():
                raise SystemExit(f"{TABLE.name} was made from another surface ({old['surface_hash']}, now "
                                 f"{surface_hash()}): run over every release (no release arguments) to --write")
            written = write_table({**old["releases"], **rows})
        DOCS.write_text(replace_matrix(DOCS.read_text(), matrix_markdown(written)))
    doc = table_document(rows)
    if args.installed:
        from moe_replay.integrations.vllm.versions import installed

        inst = installed()
        doc["installed"] = None if inst is None else {
            "distribution": inst.distribution, "root": str(inst.root),
            **check_installed(inst.root, cpu_build=inst.cpu_build, use_cache=False)}
    if args.json:
        print(json.dumps(doc, indent=1))
    elif args.markdown:
        print(matrix_markdown(doc))
    else:
        print_table(rows)
        if args.installed:
            got = doc["installed"]
            print("installed: none" if got is None else
                  f"installed {got['distribution']} {got['version']} at {got['root']}: accepted {got['accepted']} "
                  f"({','.join(got['runners']) or '-'}), v1 missing {got['v1_missing']}, mrv2 missing {got['mrv2_missing']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
