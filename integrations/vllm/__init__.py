"""vLLM adapter: capture routed experts, exact sampling support and sampled logprobs per request,
and re-score traces under their routes and support (π_old replicas: VllmScorer, AsyncVllmScorer).

The base (this folder) serves two peers that never import each other, capture/ and scoring/.
Importing this package imports them and weights.py (not vLLM; ~30 ms over the core), which register
what a vLLM process needs before any call reaches it: endpoint ops (runner.OPS) and load-time steps
(patch.LOAD_STEPS). vLLM reaches the adapter only through dotted names inside this package (the
`vllm.general_plugins` entry point patch:register_plugin, worker_extension_cls
endpoint.ReplayWorkerExtension), so every such process has run this file first.
"""

from __future__ import annotations

from ...capture_config import CaptureConfig
from ...trace import stitch
from .errors import (CaptureAlignmentError, CaptureError, CaptureEvictedError, CaptureHookError, CollectError,
                     EngineNoiseError, ForceRouteError, NoMoeLayersError, PrefixCacheMissError, RequestAbortedError,
                     ScoreAlignmentError, ScoringError, SupportOverflowError, UnknownRequestError)
from . import capture, noise, scoring, weights  # noqa: F401  (registrations: endpoint ops, load-time steps)

__all__ = [
    "AsyncVllmCapture", "CaptureAlignmentError", "CaptureConfig", "CaptureError", "CaptureEvictedError",
    "CaptureHookError", "CollectError", "EXTENSION", "NoMoeLayersError", "RequestAbortedError",
    "SupportOverflowError", "UnknownRequestError", "VllmCapture", "capture_engine_kwargs", "stitch",
    "AsyncVllmScorer", "ForceRouteError", "ScoreAlignmentError", "ScoringError", "VllmScorer", "VllmScorerConfig",
    "scoring_engine_kwargs", "PrefixCacheMissError", "native_engine_kwargs", "NativeSourceError", "NativeOutputError",
    "EngineNoiseError", "VllmEngineNoise",
]

_LAZY = {"VllmCapture": "capture.api", "AsyncVllmCapture": "capture.api", "capture_engine_kwargs": "engine_kwargs",
         "EXTENSION": "link", "VllmScorer": "scoring.scorer", "AsyncVllmScorer": "scoring.scorer",
         "VllmScorerConfig": "scoring.scorer", "scoring_engine_kwargs": "scoring.scorer",
         "native_engine_kwargs": "capture.native", "NativeSourceError": "capture.native",
         "NativeOutputError": "capture.native", "VllmEngineNoise": "noise"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
