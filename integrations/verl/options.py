"""Which verl FSDP engine settings moe_replay works with, and a refusal by name for the others.

Checked when the engine is built (before any forward). Everything not named here is verl's own.
"""

from __future__ import annotations

from typing import Any

from ...presets import Preset


class VerlOptionError(ValueError):
    """A verl setting moe_replay cannot honour; the message names the setting, its value and the fix."""

    def __init__(self, option: str, found: Any, expected: str, why: str) -> None:
        self.option, self.found, self.expected = option, found, expected
        super().__init__(f"moe_replay: verl setting {option}={found!r} is not supported (expected {expected}): {why}")


def check_engine(model_config: Any, engine_config: Any, preset: Preset) -> None:
    """Raise VerlOptionError for the first verl setting the preset cannot run with."""
    if engine_config.ulysses_sequence_parallel_size != 1:
        raise VerlOptionError("actor_rollout_ref.actor.ulysses_sequence_parallel_size",
                              engine_config.ulysses_sequence_parallel_size, "1",
                              "sequence parallelism slices each packed sequence across ranks; the route slicing is not wired")
    if engine_config.use_fused_kernels or model_config.use_fused_kernels:
        raise VerlOptionError("actor_rollout_ref.model.use_fused_kernels", True, "False",
                              "fused kernels return logprobs without logits, so nothing can be renormalised over the support")
    if getattr(engine_config, "pad_to_length", False):
        raise VerlOptionError("actor_rollout_ref.actor.fsdp_config.pad_to_length", True, "False",
                              "a static pad appends positions no trace holds to the packed row (not wired)")
    if preset.estimator.enabled:
        raise VerlOptionError("moe_replay", preset.name, "a preset without `estimator` (r3, r3_support, none, ...)",
                              "multi-sample pi_old re-scores on a second engine; the verl adapter does not wire it")
    if not preset.capture.routes and preset.replay.routes:
        raise VerlOptionError("moe_replay", preset.name, "capture.routes: true", "the preset replays routes it does not capture")
    if not preset.capture.support and preset.replay.support:
        raise VerlOptionError("moe_replay", preset.name, "capture.support: true",
                              "the preset renormalises over supports it does not capture")
