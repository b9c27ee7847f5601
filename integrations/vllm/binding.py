"""How `moe_replay.enable` attaches to vLLM engines (`vllm.LLM`, `AsyncLLM`): capture, and the π_old
scorer when the preset has the estimator. Registered through the `moe_replay.bindings` entry point
(pyproject.toml), so the core names no adapter."""

from __future__ import annotations

from typing import Any

from ...bindings import ROLLOUT_BINDINGS, RolloutBinding, made_by


def _scorer_config(preset: Any) -> Any:
    from .scoring.scorer import VllmScorerConfig

    return VllmScorerConfig(force_routes=preset.estimator.force_routes, use_support=preset.estimator.use_support)


def _vllm_sync(llm: Any, preset: Any) -> tuple[Any, Any]:
    from .capture.api import VllmCapture
    from .scoring.scorer import VllmScorer

    capture = VllmCapture(llm, preset.capture)
    try:  # a scorer that refuses (forced scoring under data parallelism) leaves no capture behind
        scorer = VllmScorer(llm, _scorer_config(preset)) if preset.estimator.enabled else None
    except BaseException:
        capture.uninstall()
        raise
    return capture, scorer


async def _vllm_async(engine: Any, preset: Any) -> tuple[Any, Any]:
    from .capture.api import AsyncVllmCapture
    from .scoring.scorer import AsyncVllmScorer

    capture = await AsyncVllmCapture.attach(engine, preset.capture)
    try:  # as in _vllm_sync: a refusing scorer leaves no capture behind
        scorer = await AsyncVllmScorer.attach(engine, _scorer_config(preset)) if preset.estimator.enabled else None
    except BaseException:
        await capture.uninstall()
        raise
    return capture, scorer


ROLLOUT_BINDINGS.add("vllm.LLM", RolloutBinding(0, lambda o: made_by(o, "vllm", "LLM"), _vllm_sync))
ROLLOUT_BINDINGS.add("vllm.AsyncLLM", RolloutBinding(1, lambda o: made_by(o, "vllm", "AsyncLLM"), _vllm_async,
                                                     is_async=True))
