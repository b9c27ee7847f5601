"""Errors of replay: each names the request(s), the layer and the numbers involved.

Shared errors (geometry, expert range, trace format) come from `moe_replay.errors`; these add what
only replay can get wrong: a batch that does not line up with its traces, routes consumed the
wrong number of times, a router nobody taught us.
"""

from __future__ import annotations

from ..errors import MoeReplayError, RegistryError, TraceError, WeightsVersionError  # noqa: F401 (re-exported)


class BatchLayoutError(TraceError, ValueError):
    """The padded batch does not hold the traces' tokens where the plan expects them (order, length, padding)."""


class RouteConsumptionError(MoeReplayError, RuntimeError):
    """Routes were used more or fewer times than once per forward (plus once per activation recompute)."""


class UnsupportedRouterError(RegistryError):
    """A model holds MoE layers whose router class no adapter handles."""


class ScoringInputError(TraceError, ValueError):
    """Scoring input that would give a NaN or a wrong loss: a non-finite logit, a token id outside the
    vocabulary, a kept set without its sampled token or holding an id twice, a temperature that
    contradicts the sampling.

    `row` is the scored row (G axis) at fault, or None when the fault is not one row's."""

    row: int | None = None
