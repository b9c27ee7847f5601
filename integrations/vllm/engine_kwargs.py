"""The engine kwargs capture needs: `capture_engine_kwargs()` for LLM(...) / AsyncEngineArgs(...).

They name the worker extension (endpoint.ReplayWorkerExtension, or a framework's extension that
mixes it in) and put CAPTURE_FLAG in `additional_config`, so the load hook (patch.py) runs the
load-time steps before a compiled forward is traced. Capture (capture/api.py, capture/native.py)
and scoring (scoring/scorer.py: scoring_engine_kwargs) build on them.
"""

from __future__ import annotations

import importlib
from typing import Any

from .endpoint import ReplayWorkerExtension
from .link import EXTENSION
from .patch import CAPTURE_FLAG, flag_value, install_load_hook
from .versions import check_vllm_version


def capture_engine_kwargs(**engine_kwargs: Any) -> dict[str, Any]:
    """Engine kwargs for capture (LLM(...), AsyncEngineArgs(...)): the worker extension (the RPC
    endpoint) and `additional_config[CAPTURE_FLAG]`, which makes the load hook bind the route step
    buffer before the forward is compiled (needed for enforce_eager=False; patch.py). Also installs
    that hook in this process, for in-process engines."""
    check_vllm_version()
    ext = engine_kwargs.get("worker_extension_cls") or EXTENSION
    if ext != EXTENSION and not _serves_endpoint(ext):
        raise ValueError(f"worker_extension_cls is already set to {ext!r}; capture needs {EXTENSION!r} "
                         "or a subclass of it (vLLM takes one extension: mix ReplayWorkerExtension into yours)")
    extra = engine_kwargs.get("additional_config") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"additional_config must be a dict to add {CAPTURE_FLAG!r}, got {type(extra).__name__}")
    install_load_hook()
    return {**engine_kwargs, "worker_extension_cls": ext,
            "additional_config": {**extra, CAPTURE_FLAG: flag_value(CAPTURE_FLAG)}}


def _serves_endpoint(qualname: Any) -> bool:
    """Whether a worker extension named by its qualified name mixes in moe_replay's endpoint (verl's
    rollout does: its colocate extension + ReplayWorkerExtension, integrations/verl/extension.py)."""
    module, _, name = str(qualname).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"worker_extension_cls {qualname!r} cannot be imported: {e}") from e
    return isinstance(cls, type) and issubclass(cls, ReplayWorkerExtension)
