"""vLLM adapter: capture routed experts, exact sampling support and sampled logprobs per request,
and re-score traces under their routes and support (π_old replicas: VllmScorer, AsyncVllmScorer).

Importing this package does not import vLLM; vLLM is imported when capture or scoring is attached.
It does import the worker-side parts, because importing them registers what a vLLM process needs
before any call reaches it: their endpoint ops (runner.OPS: worker.py `capture.*`, force.py
`score.*`, weights.py `weights.*`) and the load-time forcing step (patch.LOAD_STEPS, from
force_step.py). They cost ~30 ms on top of the core, which has already imported torch. vLLM
reaches the adapter only through dotted names inside this package (the `vllm.general_plugins`
entry point patch:register_plugin, worker_extension_cls endpoint.ReplayWorkerExtension), so
every such process has run this file first.
"""

from __future__ import annotations

from ...capture_config import CaptureConfig
from ...trace import stitch
from .errors import (
    CaptureAlignmentError,
    CaptureError,
    CaptureEvictedError,
    CaptureHookError,
    CollectError,
    ForceRouteError,
    NoMoeLayersError,
    PrefixCacheMissError,
    RequestAbortedError,
    ScoreAlignmentError,
    ScoringError,
    SupportOverflowError,
    UnknownRequestError,
)
from . import force, weights, worker  # noqa: F401  (registrations: endpoint ops, load-time steps)

__all__ = [
    "AsyncVllmCapture", "CaptureAlignmentError", "CaptureConfig", "CaptureError", "CaptureEvictedError",
    "CaptureHookError", "CollectError", "EXTENSION", "NoMoeLayersError", "RequestAbortedError",
    "SupportOverflowError", "UnknownRequestError", "VllmCapture", "capture_engine_kwargs", "stitch",
    "AsyncVllmScorer", "ForceRouteError", "ScoreAlignmentError", "ScoringError", "VllmScorer", "VllmScorerConfig",
    "scoring_engine_kwargs", "PrefixCacheMissError", "native_engine_kwargs", "NativeSourceError", "NativeOutputError",
]

_LAZY = {"VllmCapture": "api", "AsyncVllmCapture": "api", "capture_engine_kwargs": "engine_kwargs", "EXTENSION": "link",
         "VllmScorer": "scorer", "AsyncVllmScorer": "scorer", "VllmScorerConfig": "scorer",
         "scoring_engine_kwargs": "scorer", "native_engine_kwargs": "native", "NativeSourceError": "native",
         "NativeOutputError": "native"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
