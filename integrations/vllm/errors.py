"""Typed errors of the vLLM adapter: each says what was expected, what was found and where."""

from __future__ import annotations

from ...errors import MoeReplayError


class CaptureError(MoeReplayError):
    """Root of the vLLM capture errors."""


class CaptureHookError(CaptureError, RuntimeError):
    """Capture cannot be installed on this engine (no hook point, unsupported feature)."""


class VllmReleaseError(CaptureHookError):
    """The vLLM release lacks names the adapter relies on for a runner path or part (versions.py:
    the surface table, or the installed source's check), or was never checked; names them."""


class NoMoeLayersError(CaptureHookError, ValueError):
    """The served model has no MoE layer with a capturable router."""


class UnknownRequestError(CaptureError, KeyError):
    """No capture record exists for a request id."""

    def __str__(self) -> str:
        return Exception.__str__(self)


class RequestAbortedError(CaptureError):
    """A trace was requested for a request that was aborted before it finished."""


class CaptureEvictedError(CaptureError):
    """The record was dropped on the worker (max_unclaimed exceeded) before it was collected."""


class SupportOverflowError(CaptureError):
    """A sampling-support row exceeded CaptureConfig.max_support under the 'error' policy."""


class CaptureAlignmentError(CaptureError):
    """Captured rows do not line up with the request's final tokens (missing or mismatched)."""


class CollectError(CaptureError):
    """Some requests of a batch failed; `traces` holds every trace that succeeded."""

    def __init__(self, traces: list, failures: dict[str, Exception]) -> None:
        self.traces, self.failures = traces, failures
        first = next(iter(failures.items()))
        super().__init__(
            f"{len(failures)} of {len(failures) + len(traces)} requests failed to produce a trace "
            f"(first: {first[0]!r}: {type(first[1]).__name__}: {first[1]}); "
            f"the {len(traces)} good traces are in .traces (and in the store, if one was given)"
        )


class WeightSyncError(MoeReplayError, RuntimeError):
    """The engine did not take every new weight; it must not be sampled from until rebuilt."""


class ScoringError(CaptureError):
    """Root of the scoring errors (forced-route re-scoring of traces on a vLLM engine)."""


class ForceRouteError(ScoringError, CaptureHookError):
    """Routes cannot be forced on this engine (router rule not reproducible, bad registration)."""


class ScoreAlignmentError(ScoringError):
    """A trace's scores are incomplete or do not line up with its tokens; names the trace."""


class PrefixCacheMissError(ScoreAlignmentError):
    """Prompt reuse was promised for a trace (an earlier replica cached its prompt) and missed."""


class EngineNoiseError(CaptureHookError):
    """The engine-noise model cannot be installed as asked (noise.py): already installed, a compiled
    forward for route flips, or a capture on the engine that would record perturbed traces as clean."""
