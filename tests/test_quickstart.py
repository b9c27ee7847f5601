"""The README's quick start is examples/quickstart.py, and that file runs as written in a fresh
interpreter with none of the environment the tests set (what a fresh clone has)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart.py"
FRESH_UNSET = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "MOE_REPLAY_VERBOSE")
"""What conftest.py or a developer's shell sets and a fresh clone does not."""


def readme_quick_start() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"expected one python block in the README's quick start, found {len(blocks)}"
    return blocks[0]


def test_readme_quick_start_is_the_example_file():
    assert readme_quick_start() == QUICKSTART.read_text()


MRV2_RUNNER = "vllm.v1.worker.cpu.model_runner.CPUModelRunner"
"""vLLM-CPU's Model Runner V2 class, which the MRV2 test bed reports building (MOE_REPLAY_RUNNER_PROBE)."""


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.mrv2
def test_quick_start_runs_verbatim_in_a_fresh_interpreter(tmp_path, runner):
    """On the session's runner: the MRV2 session's environment (tests/runners.py) reaches the child."""
    probe = tmp_path / "runners.txt"
    env = {**{k: v for k, v in os.environ.items() if k not in FRESH_UNSET}, "MOE_REPLAY_RUNNER_PROBE": str(probe)}
    proc = subprocess.run([sys.executable, str(QUICKSTART)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = re.findall(r"^loss (\S+)$", proc.stdout, flags=re.M)
    assert len(found) == 1 and math.isfinite(float(found[0])), proc.stdout[-2000:]
    assert "force killing" not in proc.stdout + proc.stderr  # the engine closed with the script
    if runner == "mrv2":  # the bed saw MRV2's runner built (the V1 session has no Triton: vLLM runs V1 there)
        assert probe.read_text().split() == [MRV2_RUNNER], probe.read_text()
    else:
        assert not probe.exists()
