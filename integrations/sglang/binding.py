"""How `moe_replay.enable` attaches to an `sglang.Engine`: capture from its outputs, and π_old scoring
(scoring.py: forced routes through the hook in its scheduler) when the preset has the estimator. Registered through the `moe_replay.bindings` entry point (pyproject.toml), so the core
names no adapter; a running server is attached with `SglangCapture(url)` directly."""

from __future__ import annotations

from typing import Any

from ...bindings import ROLLOUT_BINDINGS, RolloutBinding, made_by


def _attach(engine: Any, preset: Any) -> tuple[Any, Any]:
    from .capture import SglangCapture
    from .scoring import scorer_for

    scorer = scorer_for(engine, preset.estimator) if preset.estimator.enabled else None  # refusals come first
    return SglangCapture(engine, preset.capture), scorer


ROLLOUT_BINDINGS.add("sglang.Engine", RolloutBinding(2, lambda o: made_by(o, "sglang", "Engine"), _attach))
