"""The copyable examples run as shipped (subprocess, real engine and models)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_grpo_loop():
    out = run("grpo_loop.py", "--steps", "1", "--preset", "r3_support")
    assert "step 0: reward" in out


def test_verl_style_preset():
    assert "'loss'" in run("verl_style_preset.py")


def test_capture_to_store(tmp_path):
    out = run("capture_to_store.py", str(tmp_path / "traces"))
    assert "6 traces in" in out and (tmp_path / "traces" / "index.bin").exists()


def test_ray_sidecar():
    out = run("ray_sidecar.py")
    assert out.count("n = 4") == 8
