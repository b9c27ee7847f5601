"""The copyable examples run as shipped (subprocess, real engine and models)."""

from __future__ import annotations

import re
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


STEP_LINE = re.compile(r"step (\d+): reward (\S+)  mean \|A\| (\S+)  loss (.+?)  grad norm (.+?)  train/rollout k3-KL (\S+)")


@pytest.mark.mrv2
def test_grpo_loop_learns_from_non_zero_advantages():
    """Every step has advantages, a gradient, and (on the second update, ratio != 1) a loss that are not 0."""
    out = run("grpo_loop.py", "--steps", "2", "--preset", "r3_support")
    steps = [STEP_LINE.search(line) for line in out.splitlines() if line.startswith("step ")]
    assert [int(m.group(1)) for m in steps if m] == [0, 1], out[-2000:]
    for m in steps:
        losses = [float(x) for x in m.group(4).split(" -> ")]
        norms = [float(x) for x in m.group(5).split(" -> ")]
        assert float(m.group(3)) > 0, m.group(0)
        assert len(losses) == len(norms) == 2 and losses[1] != 0.0, m.group(0)
        assert min(norms) > 0, m.group(0)


def test_verl_style_preset():
    assert "'loss'" in run("verl_style_preset.py")


@pytest.mark.mrv2
def test_capture_to_store(tmp_path):
    out = run("capture_to_store.py", str(tmp_path / "traces"))
    assert "6 traces in" in out and (tmp_path / "traces" / "index.bin").exists()


def test_ray_sidecar():
    out = run("ray_sidecar.py")
    assert out.count("n = 4") == 8
