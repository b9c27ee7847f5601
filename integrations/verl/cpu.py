"""verl on a machine without an accelerator: a CPU platform and the FSDP engine registered for it.

verl 0.9.1 resolves its device through `verl.plugin.platform` (a registry of accelerator
platforms: nvidia, npu, rocm) and picks training engines from `EngineRegistry` by that device;
neither has a CPU entry, so on a CPU-only machine `FSDPEngine` asks torch.cuda for a device and
fails (`torch._C` has no `_cuda_setDevice`). Both registries are verl's own extension points:
`use_cpu()` adds a "cpu" platform (torch.cpu, gloo) and registers verl's FSDP language-model
engine for device "cpu". Nothing of verl is patched. This is what lets the tests and the example
drive verl's real FSDP engine on CPU; on a GPU machine it is not called.

Call it before any verl module that reads the device at import time (engine modules do).
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


def build_engine(model_dir: str, preset: str | None, *, micro_batch_size: int = 4, lr: float = 1e-3,
                 engine_overrides: dict | None = None, model_overrides: dict | None = None) -> Any:
    """verl's FSDP2 actor engine for `model_dir` in this process (world size 1, gloo), under `preset`.

    The config is what a verl user sets (model.override_config.moe_replay; use_remove_padding off
    unless `model_overrides` turn it on),
    built with verl's own dataclasses; the engine comes from verl's EngineRegistry, where
    `registry.install()` put moe_replay's. FSDP1 (`strategy=fsdp`) stops on CPU: it syncs module
    states from rank 0, which torch allows only for parameters on a GPU.
    """
    use_cpu()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    from .registry import install, without_trl_value_head

    install()
    override = {"attn_implementation": "sdpa"}  # verl defaults to flash-attention 2, which has no CPU build
    if preset is not None:
        override["moe_replay"] = preset
    model_kw = {"path": str(model_dir), "use_remove_padding": False, "override_config": override, **(model_overrides or {})}
    model_config = HFModelConfig(**model_kw)
    model_config.model_type = "language_model"
    engine_kw = {"strategy": "fsdp2", "model_dtype": "fp32", "dtype": "float32", "use_torch_compile": False,
                 "use_remove_padding": model_config.use_remove_padding, "use_dynamic_bsz": False,
                 "micro_batch_size_per_gpu": micro_batch_size, "infer_micro_batch_size_per_gpu": micro_batch_size,
                 "seed": 0, **(engine_overrides or {})}
    engine = EngineRegistry.new(model_type="language_model", backend="fsdp2", model_config=model_config,
                                engine_config=FSDPEngineConfig(**engine_kw),
                                optimizer_config=FSDPOptimizerConfig(lr=lr, total_training_steps=1000, weight_decay=0.0),
                                checkpoint_config=CheckpointConfig())
    with without_trl_value_head():
        engine.initialize()
    return engine
