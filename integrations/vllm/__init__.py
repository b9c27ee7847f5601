"""vLLM adapter: capture routed experts, exact sampling support and sampled logprobs per request,
and re-score traces under their routes and support (π_old replicas: VllmScorer, AsyncVllmScorer).

Importing this package does not import vLLM; vLLM is imported when capture or scoring is attached.
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

__all__ = [
    "AsyncVllmCapture", "CaptureAlignmentError", "CaptureConfig", "CaptureError", "CaptureEvictedError",
    "CaptureHookError", "CollectError", "EXTENSION", "NoMoeLayersError", "RequestAbortedError",
    "SupportOverflowError", "UnknownRequestError", "VllmCapture", "capture_engine_kwargs", "stitch",
    "AsyncVllmScorer", "ForceRouteError", "ScoreAlignmentError", "ScoringError", "VllmScorer", "VllmScorerConfig",
    "scoring_engine_kwargs", "PrefixCacheMissError", "native_engine_kwargs", "NativeSourceError", "NativeOutputError",
]

_LAZY = {"VllmCapture": "api", "AsyncVllmCapture": "api", "capture_engine_kwargs": "api", "EXTENSION": "api",
         "VllmScorer": "scorer", "AsyncVllmScorer": "scorer", "VllmScorerConfig": "scorer",
         "scoring_engine_kwargs": "scorer", "native_engine_kwargs": "native", "NativeSourceError": "native",
         "NativeOutputError": "native"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
