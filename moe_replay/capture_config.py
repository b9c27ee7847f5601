"""What a rollout engine captures and how much of it to keep: one dataclass, validated on construction.

In the core so presets (and any engine adapter) share one definition; the vLLM adapter re-exports
it as `moe_replay.integrations.vllm.CaptureConfig`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

SupportOverflowPolicy = Literal["error", "omit"]
CaptureSource = Literal["auto", "hooks", "native"]
CAPTURE_SOURCES = ("auto", "hooks", "native")


@dataclass
class CaptureConfig:
    """Capture settings shipped to every worker (a plain dict on the wire).

    Shape legend for the adapter: T tokens forwarded in one engine step, L MoE layers, K top-k,
    B requests sampled in one step, V vocabulary, N kept tokens of a step (CSR payload).
    """

    routes: bool = True
    """Record the top-k expert ids of every forwarded token at every MoE layer."""
    support: bool = True
    """Record the exact sampling support (finite logits after temperature/min-p/top-k/top-p)."""
    logprobs: bool = True
    """Record the sampled token's logprob under the distribution it was drawn from."""
    max_support: int = 4096
    """Largest support row kept sparse; a row above it follows `on_support_overflow`."""
    on_support_overflow: SupportOverflowPolicy = "error"
    """'error': collecting that request's trace raises SupportOverflowError (other requests are
    unaffected). 'omit': the trace carries support=None and extra['support_omitted'] names the
    first overflowing row and its size. Rows are never truncated."""
    prefix_cache_routes: bool = True
    """Keep routes per KV slot so requests that hit the prefix cache still get full routes."""
    flush_bytes: int = 16 << 20
    """Budget of each per-step staging buffer (route arena, truncated logit rows): steps accumulate
    until one would overflow, then a flush maps them to requests in one batched pass. Each buffer
    always holds at least one full step, whatever the budget: with a large vocabulary the logit stage
    is max_num_seqs x V x 4 bytes on the logits' device (e.g. 256 x 152k -> 155 MB), flushed every
    step, where per-op overhead no longer matters."""
    source: CaptureSource = "auto"
    """Where routes, support and logprobs come from. 'hooks': moe_replay's worker hooks.
    'native': the engine's own outputs (vLLM: `enable_return_routed_experts` for routes,
    `return_sampling_mask` with `logprobs_mode="processed_logprobs"` for support and logprobs); an
    engine without the flag a wanted part needs is refused, naming the flag. 'auto': each part from
    the engine where its flag is on, from hooks otherwise (vLLM 0.26 returns routes but no mask)."""
    max_unclaimed: int = 65536
    """Finished requests held on the worker until collected; beyond it the oldest is dropped and
    collecting it raises CaptureEvictedError (never a silent gap)."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_support, int) or self.max_support < 1:
            raise ValueError(f"CaptureConfig.max_support must be a positive int, got {self.max_support!r}")
        if self.on_support_overflow not in ("error", "omit"):
            raise ValueError(
                f"CaptureConfig.on_support_overflow must be 'error' or 'omit', got {self.on_support_overflow!r}"
            )
        if not isinstance(self.flush_bytes, int) or self.flush_bytes < 0:
            raise ValueError(f"CaptureConfig.flush_bytes must be a non-negative int, got {self.flush_bytes!r}")
        if not isinstance(self.max_unclaimed, int) or self.max_unclaimed < 1:
            raise ValueError(f"CaptureConfig.max_unclaimed must be a positive int, got {self.max_unclaimed!r}")
        if self.source not in CAPTURE_SOURCES:
            raise ValueError(f"CaptureConfig.source must be one of {CAPTURE_SOURCES}, got {self.source!r}")
        if not (self.routes or self.support or self.logprobs):
            raise ValueError("CaptureConfig captures nothing: routes, support and logprobs are all False")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CaptureConfig":
        return cls(**d)
