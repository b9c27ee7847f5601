"""Build the SGLang test bed: a venv of its own (`.venv/sglang`) with SGLang 0.5.23 on the CPU torch.

A CPU test bed for tests/test_sglang*.py and benchmarks/sglang.py, never a user install: SGLang is a
GPU engine, and here it runs its torch-native paths only because of the stand-ins and fixes in
tests/sglang_bed/ (facts: ../shared/notes/sglang-cpu.md). Why a venv of its own: sglang pins
transformers 5.19 (the project's venv runs 5.24) and torch 2.14.1, whose registry build is the CUDA
one; here torch is the project's CPU 2.13.0 build, held by a constraints file, sglang is installed
with `--no-deps` (its metadata asks for flashinfer, deep-gemm, cutlass, cuda-python, none used on
CPU), then exactly the packages its imports need (SGLANG_DEPS; NO_DEPS_PINS with `--no-deps`), and
moe_replay itself (`-e . --no-deps`), so `moe_replay.enable(preset, llm=<sglang.Engine>)` runs in it.
A stamp keyed by the pins, the interpreter and pyproject.toml makes a second run a no-op (~0.1 s).

Usage: python3 scripts/sglang_bed.py [--venv .venv/sglang] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv" / "sglang"
TORCH = "torch==2.13.0"
TORCH_CONSTRAINT = "torch==2.13.0+cpu"
SGLANG = "sglang==0.5.23"
SGLANG_DEPS = [
    "transformers==5.19.0", "tokenizers==0.23.2", "safetensors", "huggingface_hub", "requests", "tqdm", "pyzmq",
    "psutil", "pydantic", "fastapi", "uvicorn", "uvloop", "orjson", "pybase64", "msgspec", "setproctitle", "aiohttp",
    "packaging", "pillow", "regex", "einops", "sentencepiece==0.2.1", "IPython", "blobfile==3.0.0", "distro",
    "easydict", "interegular", "partial_json_parser", "python-multipart", "prometheus-client", "watchfiles", "xxhash",
    "zstandard", "tiktoken", "openai==2.8.0", "python-dateutil", "scipy", "dill", "apache-tvm-ffi==0.1.11", "gguf",
    "loguru", "jsonschema", "cffi", "msgpack", "pyyaml", "numpy",
]
"""What SGLang's imports on the CPU text-MoE path need (the note's list, found one import error at a time),
plus moe_replay's own core dependencies (msgpack, pyyaml, numpy)."""
NO_DEPS_PINS = ["triton==3.7.1", "compressed-tensors==0.18.0", "xgrammar==0.2.7", "soundfile==0.13.1"]
"""Imported at load by SGLang's modules, installed without their requirements (which ask for CUDA
torch or more GPU packages); no Triton kernel runs on the CPU paths the tests drive."""


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _inputs_hash() -> str:
    """What the venv is made of: the pins, this interpreter, and pyproject.toml (moe_replay's entry points,
    which `-e .` installs from it)."""
    pins = json.dumps([TORCH, SGLANG, SGLANG_DEPS, NO_DEPS_PINS, sys.version]).encode()
    return hashlib.sha256(pins + (ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]


def check_no_cuda(py: str) -> None:
    """SystemExit unless the venv holds the CPU torch and no nvidia-* package."""
    out = subprocess.run([py, "-m", "pip", "list", "--format=freeze"], check=True, capture_output=True, text=True).stdout
    bad = [line for line in out.splitlines() if line.lower().startswith("nvidia-")]
    torch_line = [line for line in out.splitlines() if line.lower().startswith("torch==")]
    if bad or not torch_line or "+cpu" not in torch_line[0]:
        raise SystemExit(f"sglang_bed: expected the CPU torch build and no nvidia-* package, found {torch_line} and {bad}")


def build(venv: Path, force: bool = False) -> Path:
    """Install the test bed into `venv` unless its stamp is current; returns its python."""
    stamp = venv / ".moe_replay-sglang-installed"
    digest = _inputs_hash()
    py = venv / "bin" / "python"
    if not force and stamp.exists() and stamp.read_text().strip() == digest and py.exists():
        print(f"sglang_bed: {venv} is up to date ({digest})")
        return py
    t0 = time.monotonic()
    if not py.exists():
        _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(TORCH_CONSTRAINT + "\n")
        _run(pip + [TORCH])
        _run(pip + ["-c", str(constraints), *SGLANG_DEPS])
        _run(pip + ["--no-deps", SGLANG, *NO_DEPS_PINS])
        _run(pip + ["-c", str(constraints), "--no-deps", "-e", str(ROOT)])
    check_no_cuda(str(py))
    stamp.write_text(digest + "\n")
    print(f"sglang_bed: installed into {venv} in {time.monotonic() - t0:.0f} s")
    return py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=os.environ.get("MOE_REPLAY_SGLANG_VENV", str(VENV)))
    parser.add_argument("--force", action="store_true", help="reinstall even if the stamp matches")
    args = parser.parse_args()
    build(Path(args.venv), args.force)


if __name__ == "__main__":
    main()
