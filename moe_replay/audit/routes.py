"""Routes as a pipeline holds them, read into one shape the audit compares: per sample, its tokens and
its route rows [T, C, K], row p being the route of position `start + p` as the pipeline means it.

The columns are the pipeline's layer axis, and what each claims is part of the format: every decoder
layer (vLLM's and SGLang's `routed_experts`: column c is decoder layer c, dense layers included), the
model's MoE layers in order (the project's traces, Megatron's RouterReplay list), or verl's rule (every
decoder layer when there are as many columns as layers, else the MoE layers in order). `LayerAxis`
names the rule; the audit resolves it against the model (`claimed_layers`). Nothing here judges the
values: ids out of range, repeated ids, rows too many or too few are what the audit reports on.

Legend: S tokens, T rows, C columns (the pipeline's layer axis), K top-k.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import GeometryMismatchError, TraceFormatError, Where


class LayerAxis(enum.Enum):
    """What the columns of a pipeline's route rows stand for."""

    DECODER = "decoder"
    """Column c is decoder (route) layer c, dense layers included (vLLM, SGLang)."""
    MOE = "moe"
    """Column j is the model's j-th MoE layer (Megatron's RouterReplay list order)."""
    AUTO = "auto"
    """verl's rule: DECODER when there are as many columns as the model has layers, else MOE."""


@dataclass(frozen=True)
class SampleRoutes:
    """One sample's tokens and route rows as a pipeline holds them."""

    key: str
    token_ids_S: np.ndarray
    """int64 [S]: the tokens the trainer forwards."""
    routes_TCK: np.ndarray
    """int64 [T, C, K]: row p is (the pipeline says) the route of position start + p."""
    start: int = 0
    """Position of row 0 (vLLM's routed_experts_prompt_start, SGLang's routed_experts_start_len)."""
    slots_T: np.ndarray | None = None
    """Where each row sits in the payload when the payload is one flat array (a Megatron list's m), so
    two readings of it can say which sample a row belongs to; None otherwise."""
    prompt_len: int | None = None
    """Tokens of the prompt, where the pipeline says (a trace's `prompt_len`, `prompt_len=` to a reader): the
    prompt / completion boundary the audit checks the rows at; None: not known."""
    boundaries: tuple[int, ...] = ()
    """Positions where a span begins after the first (the completion, a later turn, a turn's tool output):
    the rows just before each are an edge the audit checks (`prompt_len` among them when known)."""

    @property
    def rows_expected(self) -> int:
        """Rows the tokens call for: positions start .. S - 2 (the last token is never forwarded)."""
        return max(len(self.token_ids_S) - 1 - self.start, 0)


@dataclass(frozen=True)
class RoutesBatch:
    """A batch of samples' routes in one format, with what its columns claim."""

    format: str
    samples: tuple[SampleRoutes, ...]
    layers: LayerAxis | tuple[int | None, ...]
    """A rule, or the global layer id each column claims (None: a column no decoder layer owns, e.g.
    an MTP router's entry of Megatron's list)."""
    readings: tuple[tuple[str, "RoutesBatch"], ...] = ()
    """Other readings of the same payload the audit tries when this one does not line up (a Megatron
    list read batch-first); the name goes into the verdict."""

    def __post_init__(self) -> None:
        if not self.samples:
            raise TraceFormatError(Where(field=f"routes ({self.format})"), "at least one sample", "none")
        shape = None
        for b, s in enumerate(self.samples):
            where = Where(record=s.key, field=f"routes ({self.format}) of sample {b}")
            if s.routes_TCK.ndim != 3:
                raise TraceFormatError(where, "rows [T, layers, top_k]", list(s.routes_TCK.shape))
            if s.token_ids_S.ndim != 1 or len(s.token_ids_S) < 2:
                raise TraceFormatError(where.with_(field=f"token ids of sample {b}"), "a sequence of >= 2 token ids",
                                       list(s.token_ids_S.shape))
            if s.prompt_len is not None and not 0 <= s.prompt_len <= len(s.token_ids_S):
                raise TraceFormatError(where.with_(field="prompt_len"), f"a length in [0, {len(s.token_ids_S)}]", s.prompt_len)
            if not 0 <= s.start < len(s.token_ids_S):
                raise TraceFormatError(where.with_(field="start"), f"a position in [0, {len(s.token_ids_S)})", s.start)
            if shape is None:
                shape = s.routes_TCK.shape[1:]
            elif s.routes_TCK.shape[1:] != shape and len(s.routes_TCK):
                raise TraceFormatError(where, f"[T, {shape[0]}, {shape[1]}] as sample 0", list(s.routes_TCK.shape))
        if isinstance(self.layers, tuple) and shape is not None and len(self.layers) != shape[0]:
            raise TraceFormatError(Where(field=f"routes ({self.format}) layers"), f"{shape[0]} layer ids (one per column)",
                                   len(self.layers))

    @property
    def num_columns(self) -> int:
        return int(self.samples[0].routes_TCK.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.samples[0].routes_TCK.shape[2])

    def claimed_layers(self, num_layers: int, moe_layer_ids: Sequence[int]) -> tuple[int | None, ...]:
        """The global layer id each column claims, for a model of `num_layers` route layers."""
        c = self.num_columns
        rule = self.layers
        if rule is LayerAxis.AUTO:
            rule = LayerAxis.DECODER if c == num_layers else LayerAxis.MOE
        if rule is LayerAxis.DECODER:
            return tuple(range(c))
        if rule is LayerAxis.MOE:
            ids = tuple(moe_layer_ids)
            return tuple(ids[j] if j < len(ids) else None for j in range(c))
        return tuple(rule)

    def check_top_k(self, top_k: int) -> None:
        """Rows of another width are not a misalignment but another shape: refused by name."""
        if self.top_k != top_k:
            raise GeometryMismatchError(Where(field=f"routes ({self.format}) top_k"), top_k, self.top_k,
                                        "the model's experts per token vs the routes' last dimension")


def as_rows(routes: object, where: Where) -> np.ndarray:
    """A [T, C, K] integer array from a numpy array, a torch tensor or nested lists (int64, a copy)."""
    arr = routes.detach().cpu().numpy() if hasattr(routes, "detach") else np.asarray(routes)
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            arr = arr.astype(np.int64)
        else:
            raise TraceFormatError(where, "integer expert ids", f"dtype {arr.dtype}")
    if arr.ndim != 3:
        raise TraceFormatError(where, "rows [T, layers, top_k]", list(arr.shape))
    return arr.astype(np.int64)


def as_tokens(token_ids: object, where: Where) -> np.ndarray:
    arr = token_ids.detach().cpu().numpy() if hasattr(token_ids, "detach") else np.asarray(token_ids)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise TraceFormatError(where, "a 1-D sequence of integer token ids", f"{arr.dtype} {list(arr.shape)}")
    return arr.astype(np.int64)
