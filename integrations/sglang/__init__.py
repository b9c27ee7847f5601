"""SGLang adapter: traces from SGLang's own outputs (routed experts, sampling mask, logprobs over it),
for an in-process `sglang.Engine` or a running server, the same RolloutTrace as vLLM's.

    from moe_replay.integrations.sglang import SglangCapture
    cap = SglangCapture(engine_or_url)
    outputs, traces = cap.generate(prompts, sampling_params, store=store)

Nothing here imports sglang at import time (engine.py does, inside its calls); the server client is
plain HTTP. docs/sglang.md says what is captured, refused and measured.
"""

from __future__ import annotations

from ...capture_config import CaptureConfig
from ...trace import stitch
from .errors import (SglangCollectError, SglangError, SglangPayloadError, SglangRequestError, SglangScoringError,
                     SglangServedError, SglangSourceError)

__all__ = [
    "CaptureConfig", "SglangCapture", "SglangCollectError", "SglangError", "SglangPayloadError", "SglangRequestError",
    "SglangScoringError", "SglangServedError", "SglangSourceError", "check_served", "stitch",
]

_LAZY = {"SglangCapture": "capture", "check_served": "served"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
