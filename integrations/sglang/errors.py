"""Typed errors of the SGLang adapter: each names the request (SGLang's rid) and the position or field."""

from __future__ import annotations

from ...errors import MoeReplayError, TraceFormatError


class SglangError(MoeReplayError):
    """Root of the SGLang adapter's errors."""


class SglangPayloadError(TraceFormatError, SglangError):
    """One request's `meta_info` from SGLang is malformed or does not line up with its tokens (a route
    payload of the wrong length or layer count, undecodable base64, a kept set without its token)."""


class SglangSourceError(SglangError, ValueError):
    """The capture config asks for something SGLang's outputs cannot give (worker hooks: SGLang has none)."""


class SglangServedError(SglangError, ValueError):
    """A checkpoint SGLang 0.5.23 does not serve as its config says (named before any rollout)."""


class SglangScoringError(SglangError, ValueError):
    """π_old re-scoring on SGLang is refused, with the reason."""


class SglangRequestError(SglangError, RuntimeError):
    """SGLang answered a request with an error, or the server could not be reached."""


class SglangCollectError(SglangError):
    """Some requests of a batch gave no trace; `traces` holds every trace that succeeded (already stored)."""

    def __init__(self, traces: list, failures: dict[str, Exception]) -> None:
        self.traces, self.failures = traces, failures
        key, err = next(iter(failures.items()))
        super().__init__(f"{len(failures)} of {len(failures) + len(traces)} requests gave no trace "
                         f"(first: {key!r}: {type(err).__name__}: {err})")
