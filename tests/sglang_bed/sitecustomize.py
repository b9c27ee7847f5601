"""SGLang CPU test bed: import stand-ins and fixes, applied in every SGLang process. Test infrastructure only.

SGLang 0.5.23 is a GPU engine; on this CPU (no CUDA, no CPU build of `sgl_kernel` on any registry) its
torch-native paths run once four things are taken care of (measured: ../shared/notes/sglang-cpu.md):

  stand-ins  `torchvision` (the registry's wheel links CUDA torch; imported at module level for multimodal
             configs only) and `sgl_kernel` (names imported at module load, none called on the CPU paths):
             modules that resolve every name; calling a stand-in raises, so a path that needs one fails loudly.
  fixes      the routed-experts host buffer (allocated pinned through `torch.cuda.cudart()`: a plain CPU
             tensor instead), and qwen2_moe's shared-expert gate (a Triton kernel off AMX/NPU: its torch
             equivalent, HF's op order).

SGLang spawns its scheduler and detokenizer: Python imports this file at start-up in every process whose
PYTHONPATH holds this folder (scripts/sglang_bed.py `bed_env()`), so each gets the same stand-ins and
fixes, applied when the module they fix is first imported (moe_replay's import hook, the one that loads its
force hook in a scoring engine: integrations/sglang/import_hook.py). `SGLANG_USE_CPU_ENGINE=1`
is set here too (without it `is_cpu()` is false and RoPE imports vLLM's ops). Nothing here runs
outside the test bed's venv: it does nothing unless `sglang` is importable.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

STAND_INS = ("torchvision", "sgl_kernel")
"""Top-level packages replaced by modules that resolve every name (and their submodules)."""


def _refuse(qual: str):
    def stand_in(*args, **kwargs):
        raise RuntimeError(f"{qual} is an SGLang test-bed stand-in (tests/sglang_bed): it was called, so this path "
                           "needs the real package, which the CPU test bed does not have")

    return stand_in


class _StandInType(type):
    """Classes whose every attribute is another stand-in class (`InterpolationMode.NEAREST_EXACT`), and
    whose instantiation or call refuses."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in_class(f"{cls.__qualname__}.{name}", cls.__module__)

    def __call__(cls, *args, **kwargs):
        _refuse(f"{cls.__module__}.{cls.__qualname__}")()


def _stand_in_class(qual: str, module: str) -> type:
    return _StandInType(qual.rpartition(".")[2], (), {"__qualname__": qual, "__module__": module})


class _StandIn(types.ModuleType):
    """A module (and package) whose every attribute is a stand-in class that refuses to run."""

    __path__: list[str] = []
    __version__ = "0.0.0+stand.in"
    """Read where no package metadata is found (transformers' torchvision version checks): older than any."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        attr = _stand_in_class(name, self.__name__)
        setattr(self, name, attr)
        return attr


def _fix_host_buffer(module: types.ModuleType) -> None:
    """Routed-experts host buffer: pinned memory needs CUDA; a plain CPU tensor holds the same ids."""
    import torch

    def alloc_cpu(shape, dtype, device="cpu", pin_memory=False, allocator=None):
        return torch.empty(shape, dtype=dtype, device="cpu")

    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_cpu


def _fix_qwen2_moe(module: types.ModuleType) -> None:
    """qwen2_moe's shared-expert gate: sigmoid(x @ w) * shared, as HF's Qwen2MoeSparseMoeBlock computes it."""
    import torch
    import torch.nn.functional as F

    def gate(hidden_states: torch.Tensor, gate_weight: torch.Tensor, shared_output: torch.Tensor) -> torch.Tensor:
        return F.sigmoid(F.linear(hidden_states, gate_weight.reshape(1, -1))) * shared_output

    def gate_add(hidden_states, gate_weight, shared_output, final_hidden_states) -> None:
        final_hidden_states.add_(gate(hidden_states, gate_weight, shared_output))

    module.fused_gate_sigmoid_mul = gate
    module.fused_gate_sigmoid_mul_add = gate_add


FIXES = {
    "sglang.srt.mem_cache.pool_host.common": _fix_host_buffer,
    "sglang.srt.models.qwen2_moe": _fix_qwen2_moe,
}
"""Module -> the fix applied right after it is first imported (in every process: patch_on_import)."""


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return _StandIn(spec.name)

    def exec_module(self, module) -> None:
        pass


class _StandInFinder(importlib.abc.MetaPathFinder):
    """STAND_INS and their submodules, before any other finder looks."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(name, _StandInLoader(), is_package=True)
        return None


FORCE_ENV = "MOE_REPLAY_SGLANG_FORCE"
"""=1: also load moe_replay's force hook (integrations/sglang/force.py: π_old scoring), as a scoring engine's
PYTHONPATH=SITE_DIR does outside the bed (one sitecustomize per process: this one chains it)."""


def install() -> None:
    """Once per process: the stand-ins first on sys.meta_path, the fixes on import (moe_replay's import hook,
    integrations/sglang/import_hook.py), SGLANG_USE_CPU_ENGINE on; the force hook on request."""
    if any(isinstance(f, _StandInFinder) for f in sys.meta_path) or importlib.util.find_spec("sglang") is None:
        return
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    sys.meta_path.insert(0, _StandInFinder())
    from moe_replay.integrations.sglang.import_hook import patch_on_import

    patch_on_import(FIXES)
    if os.environ.get(FORCE_ENV) == "1":
        from moe_replay.integrations.sglang.force import install_on_import

        install_on_import()


install()
