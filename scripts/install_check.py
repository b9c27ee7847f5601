"""Which of README.md's pip install lines resolve against the registry, and to what: prints JSON.

Builds the wheel from this checkout (the running interpreter's setuptools, no build isolation), then asks
pip's resolver for each line of README.md's Install table (`pip install --dry-run --ignore-installed
--report`, nothing installed) and reports, per line, whether it resolves and the versions it picks of the
packages that matter (torch, transformers, vLLM, TRL, verl's neighbours, SGLang, megatron-core, Ray).
Needs the registry (minutes: vLLM's and SGLang's lines each resolve a few hundred packages); not run by
the test suite, whose tests/test_install.py checks the built wheel's contents offline.

Usage: python scripts/install_check.py [--only NAME,NAME] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moe_replay.extras import VERL, VLLM_GPU  # noqa: E402

LINES = {
    "hf": ("hf", []),
    "ray": ("ray", []),
    "megatron": ("megatron", []),
    "trl": ("trl", []),
    "dev": ("dev", []),
    "docs": ("docs", []),
    "verl": ("verl", []),
    "sglang": ("sglang,hf", []),
    "vllm": ("vllm,hf", [VLLM_GPU]),
    "trl_vllm": ("trl,vllm", [VLLM_GPU]),
    "vllm_0_34": ("vllm,hf", ["vllm==0.34.0"]),  # the newest MRV2 release of the surface table
    "verl_hf_trl_ray": ("verl,hf,trl,ray", []),
}
"""Line name -> (the wheel's extras, packages named beside it): README.md's Install table."""
SHOWN = ("torch", "transformers", "tokenizers", "vllm", "trl", "accelerate", "omegaconf", "hydra-core", "peft",
         "tensordict", "sglang", "megatron-core", "ray")


def build_wheel(out: Path) -> Path:
    code = "import sys; from setuptools import build_meta; print('BUILT', build_meta.build_wheel(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, capture_output=True, text=True, check=True)
    return out / next(line for line in proc.stdout.splitlines() if line.startswith("BUILT ")).split()[1]


def resolve(wheel: Path, extras: str, beside: list[str], report: Path) -> dict:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", str(report), f"{wheel}[{extras}]", *beside], capture_output=True, text=True)
    out: dict = {"resolves": proc.returncode == 0, "wall_s": round(time.monotonic() - t0, 1)}
    if proc.returncode == 0:
        picked = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
        out["versions"] = {k: picked[k] for k in SHOWN if k in picked}
        out["nvidia_packages"] = sum(k.startswith("nvidia-") for k in picked)
    else:
        out["error"] = [line for line in proc.stderr.splitlines() if not line.startswith("WARNING: Location")][-12:]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated line names (default: all): " + ", ".join(LINES))
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(LINES)
    unknown = sorted(set(names) - set(LINES))
    if unknown:
        parser.error(f"unknown line names {unknown}; known: {', '.join(LINES)}")
    with tempfile.TemporaryDirectory() as tmp:
        wheel = build_wheel(Path(tmp))
        lines = {}
        for name in names:
            extras, beside = LINES[name]
            lines[name] = {"install": f"'{wheel.name}[{extras}]' " + " ".join(beside), **resolve(wheel, extras, beside, Path(tmp) / f"{name}.json")}
            print(f"install_check: {name}: {'resolves' if lines[name]['resolves'] else 'does NOT resolve'} "
                  f"({lines[name]['wall_s']} s)", file=sys.stderr, flush=True)
    result = {"wheel": wheel.name, "pip": subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True,
                                                          text=True).stdout.split(" from ")[0],
              "extras_resolving": {n: line["resolves"] for n, line in lines.items()}, "lines": lines,
              "then": {"verl": f"pip install --no-deps {VERL}"}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
