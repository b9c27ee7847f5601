"""The canonical rollout trace: what one sequence's rollout did, in one self-describing record.

Shape legend (used in every tensor/array name of the project):
  S  tokens in the sequence (prompt + generated)
  T  routed positions: S - 1 - route_start (the last sampled token is never forwarded)
  L  MoE layers (global ids in geometry.moe_layer_ids)
  K  experts per token (top_k), in the engine's column order
  E  experts per layer
  V  vocabulary (logits width)
  G  generated tokens: S - prompt_len, or the sum of `generated_spans` in a multi-turn record
  N  kept tokens over all generated positions (CSR payload of the sampling support)

Position p of routes_TLK is the route of token route_start + p, i.e. the forward pass that
produced the logits for token route_start + p + 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .errors import ExpertIdOutOfRangeError, MultiSpanTraceError, PartialTraceError, TraceAlignmentError, TraceFormatError, Where
from .geometry import EngineInfo, ModelGeometry, token_dtype
from .sampling_support import SamplingSupport  # noqa: F401  (re-exported: the trace's kept sets)

SCHEMA_VERSION = 5
"""Bumped on any change a reader of the previous version could misread. v2 added the typed
`sampling` parameters and `weights_version` (v1 kept the sampling in extra["sampling"]); v3 added
`generated_spans` (a v2 reader would take a multi-turn record's support rows for S - prompt_len
contiguous tokens); v4 added `route_chunks`, the rows a record's store keeps in shared chunks (a
v3 reader would take the inline rows for all of them). The trace itself is unchanged by v4; v5
added `rerouted` (positions whose route a later forward changed, and the tokens sampled before:
a v4 reader would score those tokens as exact)."""
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4, 5)
"""Versions this reader decodes (v1 records are migrated on read; v1/v2 records are single-span)."""


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters the scoring math depends on, as the engine applied them.

    Why typed: a trainer or scorer that scores at another temperature than the sampler's gets a
    wrong π_old (a rollout sampled at temperature 0.7 and scored at 1 is off at every token). The kept set itself is in
    `RolloutTrace.support`; these say how it was made and how to scale the logits.
    """

    temperature: float = 1.0
    """Logits are divided by it before softmax; 0 = greedy (the argmax alone is kept; scored unscaled)."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 or 0 = off (vLLM's conventions)."""
    top_p: float = 1.0
    """Keep the smallest set with probability mass >= top_p; 1 = off."""
    min_p: float = 0.0
    """Drop tokens below min_p * the top token's probability; 0 = off."""
    seed: int | None = None
    """The request's sampling seed, when it had one (informative)."""
    adjusted: tuple[str, ...] = ()
    """The request's options that changed the sampler's logits besides temperature and the cut
    above (repetition / presence / frequency penalties, logit_bias, allowed or bad words, min_tokens,
    structured outputs, logits processors), by vLLM's parameter names; an engine-level logits
    processor (vLLM's `LLM(logits_processors=[cls])`) as "logits_processors:<class name>". The
    kept set is still what the sampler drew from, but the recorded logprobs are of those adjusted
    logits, which no scorer reproduces: a recorded logprob then cannot stand in for a replica (EstimatorConfig.rollout_replica).
    Empty in records written before it was recorded (schema <= 2)."""

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float, np.floating, np.integer)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"Sampling.temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < -1:
            raise ValueError(f"Sampling.top_k must be an int >= -1 (-1 or 0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float, np.floating)) and 0 < self.top_p <= 1):
            raise ValueError(f"Sampling.top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.min_p, (int, float, np.floating)) and 0 <= self.min_p <= 1):
            raise ValueError(f"Sampling.min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))):
            raise ValueError(f"Sampling.seed must be an int or None, got {self.seed!r}")
        for name, kind in (("temperature", float), ("top_k", int), ("top_p", float), ("min_p", float)):
            object.__setattr__(self, name, kind(getattr(self, name)))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))
        if isinstance(self.adjusted, str) or not all(isinstance(a, str) for a in self.adjusted):
            raise ValueError(f"Sampling.adjusted must be a sequence of option names, got {self.adjusted!r}")
        object.__setattr__(self, "adjusted", tuple(sorted(set(self.adjusted))))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict[str, Any]:
        d = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p, "seed": self.seed}
        if self.adjusted:  # written only when set: a record without adjustments encodes as before
            d["adjusted"] = list(self.adjusted)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sampling":
        """From a dict of these keys (unknown keys are ignored: v1's extra["sampling"] is free-form)."""
        return cls(**{k: d[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed", "adjusted") if k in d})


_DEFAULT_SAMPLING = Sampling()
"""Every trace built without sampling parameters shares this one (frozen; building one runs its
checks, ~10 us, and capture builds a trace per sample)."""


@dataclass(frozen=True)
class Rerouted:
    """Positions whose route a later forward of the same token changed, and the sampled tokens
    that saw the earlier route.

    Where it happens: a recompute preemption's re-prefill (capture: integrations/vllm/capture/
    row_log.py) or a later turn that forwards an earlier turn's tokens again (`stitch`), on an
    engine whose numerics vary with the batch (bf16 GPU kernels picked by GEMM shape route near-tied
    tokens otherwise). The rule: `routes_TLK` holds the later route at each position, the one every
    later token was sampled with; a token sampled before a route it depended on changed (a token at
    position q depends on every position <= q - 1) is stale: its token, kept set and logprob came
    from a forward that no replay of this trace reproduces. Trainers mask stale tokens from the loss
    (RoutePlan.stale_G; verl's response_mask, TRL's completion mask) and count them; nothing scores
    them as exact.
    """

    positions: tuple[int, ...]
    """Ascending positions (of token_ids_S) whose route changed."""
    stale: tuple[int, ...]
    """Ascending generated rows g (rows of `support` / `logprobs_G`) sampled before a route they
    depended on changed."""

    def __post_init__(self) -> None:
        for name in ("positions", "stale"):
            v = getattr(self, name)
            try:
                v = tuple(int(x) for x in v)
            except (TypeError, ValueError) as e:
                raise ValueError(f"Rerouted.{name} must be a sequence of ints, got {v!r}") from e
            if list(v) != sorted(set(v)):
                raise ValueError(f"Rerouted.{name} must be ascending and distinct, got {list(v)[:16]}")
            object.__setattr__(self, name, v)

    def to_list(self) -> list[list[int]]:
        return [list(self.positions), list(self.stale)]


@dataclass
class RolloutTrace:
    """One sequence's rollout: tokens, routes per MoE layer, sampling support, engine logprobs."""

    key: str
    """Rollout / request id; the store key."""
    token_ids_S: np.ndarray
    """Prompt then generated tokens."""
    prompt_len: int
    geometry: ModelGeometry
    routes_TLK: np.ndarray | None = None
    """Expert ids per routed position, MoE layer and top-k column (engine column order)."""
    route_start: int = 0
    """First position with a route (> 0 when a turn records only its new tokens)."""
    support: SamplingSupport | None = None
    """Kept token ids per generated token (G rows, in position order over `spans`)."""
    logprobs_G: np.ndarray | None = None
    """The engine's logprob of each sampled token, float32 (G, like `support`)."""
    engine: EngineInfo = field(default_factory=EngineInfo)
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form msgpack-able metadata (step, turns, ...)."""
    sampling: Sampling = field(default_factory=lambda: _DEFAULT_SAMPLING)
    """The sampling parameters of the request (schema v2; v1 records migrate extra["sampling"])."""
    weights_version: str | int | None = None
    """Which weights sampled this rollout: a step or checkpoint fingerprint the user or trainer sets
    and capture records (schema v2; None = not recorded). Replay refuses another version unless
    told the batch is off-policy on purpose."""
    generated_spans: tuple[tuple[int, int], ...] | None = None
    """Positions [start, end) of token_ids_S the engine sampled, when they are not one span from
    prompt_len to the end: a stitched conversation whose turns are separated by text the engine
    did not sample (tool output). Ascending, non-empty, separated (adjacent spans are one span),
    inside [prompt_len, S). None = the single span [prompt_len, S) (schema v3; v1/v2 records)."""
    rerouted: Rerouted | None = None
    """Positions whose route a later forward changed and the tokens sampled before it (schema v5;
    None = none, or not checked: records before v5)."""
    route_layer_ids: tuple[int, ...] | None = None
    """The MoE layers `routes_TLK` holds when it was read for some of them only (a pipeline stage
    reads its own: `store.get(key, layers=...)`), in geometry order; None = every layer of
    `geometry.moe_layer_ids`. A partial trace is for reading: the codec (so every store) and
    `stitch` refuse it by name (PartialTraceError), and `build_plan(..., layers=...)` takes it.
    Never written to a record."""

    def __post_init__(self) -> None:
        if self.generated_spans is not None:
            try:
                self.generated_spans = tuple((int(a), int(b)) for a, b in self.generated_spans)
            except (TypeError, ValueError) as e:
                raise TraceFormatError(Where(record=self.key, field="generated_spans"), "(start, end) int pairs",
                                       repr(self.generated_spans)[:80], str(e)) from None
        self.token_ids_S = np.asarray(self.token_ids_S).astype(np.int64, copy=False)
        if self.route_layer_ids is not None:
            try:
                self.route_layer_ids = tuple(int(i) for i in self.route_layer_ids)
            except (TypeError, ValueError) as e:
                raise TraceFormatError(Where(record=self.key, field="route_layer_ids"), "a sequence of layer ids",
                                       repr(self.route_layer_ids)[:80], str(e)) from None
            if self.route_layer_ids == self.geometry.moe_layer_ids:
                self.route_layer_ids = None  # every layer: a whole trace
        if self.routes_TLK is not None:
            self.routes_TLK = _as_routes(self.routes_TLK, self.geometry, Where(record=self.key, field="routes_TLK"))
        if self.logprobs_G is not None:
            self.logprobs_G = np.asarray(self.logprobs_G, dtype=np.float32)
        if self.support is not None:
            self.support = SamplingSupport(
                np.asarray(self.support.offsets_G1, dtype=np.int64), np.asarray(self.support.ids_N, dtype=np.int32),
                self.support.whole_G,
            ).canonical(self.geometry.vocab_size)

    # -- derived sizes -----------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids_S)

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """The generated spans [start, end), the single-span default included."""
        return self.generated_spans if self.generated_spans is not None else ((self.prompt_len, self.num_tokens),)

    @property
    def multi_span(self) -> bool:
        """True when the generated tokens are not the one span [prompt_len, S) (a stitched conversation)."""
        return self.spans != ((self.prompt_len, self.num_tokens),)

    @property
    def num_generated(self) -> int:
        """G: rows of `support` and `logprobs_G` (S - prompt_len for a single-span record)."""
        return sum(b - a for a, b in self.spans)

    def generated_positions(self) -> np.ndarray:
        """int64 [G]: the position in token_ids_S of each generated token (support / logprobs row g)."""
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self.spans] or [np.zeros(0, np.int64)])

    def require_single_span(self, reader: str) -> None:
        """Refuse a multi-span record by name for a reader that scores positions prompt_len..S-1 only."""
        if self.multi_span:
            raise MultiSpanTraceError(
                Where(record=self.key, field="generated_spans"), f"one generated span [{self.prompt_len}, {self.num_tokens})",
                f"{len(self.spans)} spans {list(self.spans)[:4]}",
                f"{reader} scores a single contiguous span; score multi-turn records with build_plan / score_tokens")

    @property
    def route_layers(self) -> tuple[int, ...]:
        """The MoE layer ids of `routes_TLK`'s L axis: `route_layer_ids`, or every MoE layer."""
        return self.geometry.moe_layer_ids if self.route_layer_ids is None else self.route_layer_ids

    def require_all_layers(self, reader: str) -> None:
        """Refuse a trace read for some layers only (`route_layer_ids`) by name, for a reader that
        needs every MoE layer's routes."""
        if self.route_layer_ids is not None:
            raise PartialTraceError(
                Where(record=self.key, field="route_layer_ids"), f"routes of every MoE layer {list(self.geometry.moe_layer_ids)}",
                f"routes of layers {list(self.route_layer_ids)} only (read with layers=...)",
                f"{reader} needs whole traces; read the record without layers=")

    @property
    def num_route_rows(self) -> int:
        return max(self.num_tokens - 1 - self.route_start, 0)

    # -- checks --------------------------------------------------------------------------------
    def validate(self, where: Where | None = None) -> "RolloutTrace":
        """Check every invariant a reader relies on; raise a typed error naming the field."""
        return self._check((where or Where()).with_(record=self.key), arrays=True)

    def _check(self, w: Where, arrays: bool) -> "RolloutTrace":
        """validate(); `arrays` False leaves out the checks of array contents (token and expert id
        ranges, distinct expert ids, the kept sets), which `validate_traces` ran over a batch."""
        g = self.geometry
        if not isinstance(self.key, str) or not self.key:
            raise TraceFormatError(w.with_(field="key"), "a non-empty str", repr(self.key))
        if self.token_ids_S.ndim != 1 or self.num_tokens < 1:
            raise TraceFormatError(w.with_(field="token_ids_S"), "a 1-D array with >= 1 token", list(self.token_ids_S.shape))
        if arrays and self.num_tokens and (self.token_ids_S.min() < 0 or self.token_ids_S.max() >= g.vocab_size):
            raise TraceFormatError(
                w.with_(field="token_ids_S"),
                f"token ids in [0, {g.vocab_size})",
                f"range [{int(self.token_ids_S.min())}, {int(self.token_ids_S.max())}]",
            )
        if not 0 <= self.prompt_len <= self.num_tokens:
            raise TraceFormatError(w.with_(field="prompt_len"), f"0 <= prompt_len <= {self.num_tokens}", self.prompt_len)
        if not 0 <= self.route_start <= max(self.num_tokens - 1, 0):
            raise TraceFormatError(w.with_(field="route_start"), f"0 <= route_start <= {self.num_tokens - 1}", self.route_start)
        if self.route_layer_ids is not None:
            ids, known = self.route_layer_ids, set(g.moe_layer_ids)
            if not ids or any(i not in known for i in ids) or any(b <= a for a, b in zip(ids, ids[1:])):
                raise TraceFormatError(w.with_(field="route_layer_ids"),
                                       f"increasing MoE layer ids of geometry.moe_layer_ids {list(g.moe_layer_ids)}", list(ids))
            if self.routes_TLK is None:
                raise TraceFormatError(w.with_(field="routes_TLK"), "the routes of route_layer_ids", None)
        if self.routes_TLK is not None:
            want = (self.num_route_rows, len(self.route_layers), g.top_k)
            if self.routes_TLK.shape != want:
                layers = "L" if self.route_layer_ids is None else f"{len(self.route_layers)} layers read"
                raise TraceFormatError(w.with_(field="routes_TLK"), f"shape {list(want)} [S-1-route_start, {layers}, K]",
                                       list(self.routes_TLK.shape))
            if arrays:
                rw = w.with_(field="routes_TLK")
                check_expert_range(self.routes_TLK, g.num_experts, rw)
                check_distinct_rows(self.routes_TLK, rw)
        self.validate_spans(w)
        if arrays and self.support is not None:
            self.support.validate(g.vocab_size, self.num_generated, w)
        if not isinstance(self.sampling, Sampling):
            raise TraceFormatError(w.with_(field="sampling"), "a moe_replay.trace.Sampling", type(self.sampling).__name__)
        v = self.weights_version
        if v is not None and (isinstance(v, bool) or not isinstance(v, (str, int))):
            raise TraceFormatError(w.with_(field="weights_version"), "a str, an int or None", repr(v))
        if self.logprobs_G is not None and self.logprobs_G.shape != (self.num_generated,):
            raise TraceFormatError(w.with_(field="logprobs_G"), f"shape [{self.num_generated}]", list(self.logprobs_G.shape))
        r = self.rerouted
        if r is not None:
            if not isinstance(r, Rerouted):
                raise TraceFormatError(w.with_(field="rerouted"), "a moe_replay.trace.Rerouted or None", type(r).__name__)
            if r.positions and not (self.route_start <= r.positions[0] and r.positions[-1] < self.num_tokens - 1):
                raise TraceFormatError(w.with_(field="rerouted.positions"),
                                       f"routed positions in [{self.route_start}, {self.num_tokens - 1})", list(r.positions[:8]))
            if r.stale and r.stale[-1] >= self.num_generated:
                raise TraceFormatError(w.with_(field="rerouted.stale"), f"generated rows in [0, {self.num_generated})",
                                       list(r.stale[-8:]))
        return self

    @property
    def stale_G(self) -> np.ndarray:
        """bool [G]: the generated rows `rerouted` names stale (all False when none)."""
        out = np.zeros(self.num_generated, dtype=bool)
        if self.rerouted is not None and self.rerouted.stale:
            out[list(self.rerouted.stale)] = True
        return out

    def validate_spans(self, w: Where) -> None:
        """Check `generated_spans` against the tokens (the codec runs it before sizing support and logprobs)."""
        if self.generated_spans is None:
            return
        sw, spans = w.with_(field="generated_spans"), self.generated_spans
        if not spans:
            raise TraceFormatError(sw, ">= 1 span (None for the single span [prompt_len, S))", "an empty tuple")
        lo = self.prompt_len
        for i, (a, b) in enumerate(spans):
            if not (max(lo, 1) <= a < b <= self.num_tokens):
                after = f"after span {i - 1} ends at {lo - 1}" if i else f"from prompt_len {self.prompt_len} (and >= 1)"
                raise TraceFormatError(sw.with_(field=f"generated_spans[{i}]"),
                                       f"a non-empty span inside [{lo}, {self.num_tokens}), {after}", (a, b),
                                       "spans are ascending and separated by text the engine did not sample")
            lo = b + 1  # adjacent spans are one span: at least one unsampled token between two

    def equals(self, other: "RolloutTrace") -> bool:
        """Exact equality of every field (arrays bit for bit, NaN logprobs compared by bits)."""

        def same(a, b) -> bool:
            if a is None or b is None:
                return a is None and b is None
            return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()

        return (
            self.key == other.key
            and same(self.token_ids_S, other.token_ids_S)
            and self.prompt_len == other.prompt_len
            and self.route_start == other.route_start
            and self.geometry == other.geometry
            and self.engine == other.engine
            and self.extra == other.extra
            and self.sampling == other.sampling
            and self.weights_version == other.weights_version
            and self.spans == other.spans
            and self.route_layer_ids == other.route_layer_ids
            and self.rerouted == other.rerouted
            and same(self.routes_TLK, other.routes_TLK)
            and same(self.logprobs_G, other.logprobs_G)
            and ((self.support is None and other.support is None) or (
                self.support is not None and other.support is not None
                and self.support.canonical(self.geometry.vocab_size).equals(other.support.canonical(self.geometry.vocab_size))))
        )

    @property
    def token_dtype(self) -> np.dtype:
        return token_dtype(self.geometry.vocab_size)


def validate_traces(traces: Sequence[RolloutTrace]) -> dict[int, Exception]:
    """`trace.validate()` of every trace, as {index: the error it raises} for those that fail.

    The array checks (token and expert id ranges, distinct expert ids, kept sets) run once over
    all the traces' arrays laid end to end, then each trace runs validate's other checks; only when
    a batch check fails does every trace run its own validate(), which names the first bad place
    as always. Why: these checks are ~25 numpy calls per trace whatever its length, and capture
    validates every collected trace (8 bench traces of ~230 tokens: ~3x cheaper together than one
    by one, 0.47 vs 1.5 ms on a loaded 2-core host). A trace refused here is refused by validate()
    with the same error, and one validate() accepts is accepted here."""
    errors: dict[int, Exception] = {}
    if len(traces) > 1 and _arrays_ok(traces):
        for i, t in enumerate(traces):
            try:
                t._check(Where(record=t.key), arrays=False)
            except Exception as e:
                errors[i] = e
        return errors
    for i, t in enumerate(traces):
        try:
            t.validate()
        except Exception as e:
            errors[i] = e
    return errors


def _arrays_ok(traces: Sequence[RolloutTrace]) -> bool:
    """Whether every array check of validate() passes on the traces laid end to end (False also
    where they cannot be laid end to end: other geometries, shapes or dtypes)."""
    g = traces[0].geometry
    if any(t.geometry is not g and t.geometry != g for t in traces):
        return False
    try:
        tokens = [t.token_ids_S for t in traces]
        if any(a.ndim != 1 for a in tokens):
            return False
        tok_X = np.concatenate(tokens)
        if len(tok_X) and (tok_X.min() < 0 or tok_X.max() >= g.vocab_size):
            return False
        routes = [t.routes_TLK for t in traces if t.routes_TLK is not None]
        if routes:
            w = Where(field="routes_TLK")
            routes_XLK = np.concatenate(routes)
            check_expert_range(routes_XLK, g.num_experts, w)
            check_distinct_rows(routes_XLK, w)
        sup = [(t.support, t.num_generated) for t in traces if t.support is not None]
        if sup:
            for s, G in sup:  # each its own CSR (then end to end, every trace's last offset is the next one's first)
                off = s.offsets_G1
                if off.ndim != 1 or len(off) != G + 1 or off[0] != 0 or off[-1] != len(s.ids_N):
                    return False
                if s.whole_G is not None and (s.whole_G.shape != (G,) or (s.whole_G & (np.diff(off) > 0)).any()):
                    return False
            base = np.cumsum([0] + [len(s.ids_N) for s, _ in sup[:-1]])
            off_X1 = np.concatenate([s.offsets_G1 for s, _ in sup]) + np.repeat(base, [G + 1 for _, G in sup])
            SamplingSupport(off_X1, np.concatenate([s.ids_N for s, _ in sup])).validate(g.vocab_size, len(off_X1) - 1, Where())
    except Exception:  # noqa: BLE001 - any refusal, or arrays that do not lay end to end: each trace checks itself
        return False
    return True


def _as_routes(routes: Any, geometry: ModelGeometry, where: Where) -> np.ndarray:
    """Convert to the canonical narrow dtype, refusing values that would wrap."""
    arr = routes.detach().cpu().numpy() if hasattr(routes, "detach") else np.asarray(routes)
    if arr.dtype.kind not in "iu":
        raise TraceFormatError(where, "integer expert ids", f"dtype {arr.dtype}")
    check_expert_range(arr, geometry.num_experts, where)
    return arr.astype(geometry.route_dtype, copy=False)


def check_expert_range(routes: np.ndarray, num_experts: int, where: Where) -> None:
    if routes.size == 0:
        return
    if int(routes.max()) >= num_experts or (routes.dtype.kind != "u" and int(routes.min()) < 0):  # unsigned: >= 0
        bad = np.argwhere((routes < 0) | (routes >= num_experts))[0].tolist()
        raise ExpertIdOutOfRangeError(
            where.with_(field=f"{where.field or 'routes'}{bad}"), f"expert ids in [0, {num_experts})", int(routes[tuple(bad)])
        )


def check_distinct_rows(routes_TLK: np.ndarray, where: Where) -> None:
    """Top-k never picks one expert twice for a token; a repeat means a corrupt or misaligned trace.

    Columns compared K - 1 times, each column against the one s to its right, on a contiguous
    [K, T*L] copy: ~2K numpy calls whatever T, 4-10x faster than sorting every row ([100, 8, 4]:
    ~45 vs ~180 us; [4000, 48, 8]: ~6 vs ~60 ms), and capture validates every collected trace.
    Only a trace that fails is sorted, to name its first repeated row."""
    K = routes_TLK.shape[-1]
    if K < 2 or routes_TLK.size == 0:
        return
    cols_KX = np.ascontiguousarray(routes_TLK.reshape(-1, K).T)
    if not any(np.count_nonzero(cols_KX[s:] == cols_KX[:-s]) for s in range(1, K)):
        return
    srt = np.sort(routes_TLK, axis=-1)
    dup = np.argwhere(np.any(srt[..., 1:] == srt[..., :-1], axis=-1))
    if len(dup):
        t, l = dup[0].tolist()
        raise TraceFormatError(where.with_(field=f"{where.field}[{t}, {l}]"), "distinct expert ids per token-layer", routes_TLK[t, l].tolist())


def stitch(previous: RolloutTrace, turn: RolloutTrace) -> RolloutTrace:
    """Join a multi-turn conversation: `turn` recorded only its new routes (route_start > 0).

    `turn`'s tokens must extend `previous`'s, and its routes must start at or before the last token
    of `previous` (that token was never forwarded in the previous turn: invariant 1). The result
    has the first turn's prompt_len, the earliest route_start and all routes, and every turn's
    generated span with its kept sets and logprobs (`generated_spans`; the text between two turns,
    a tool's output, has none); the previous turn's key goes to extra['turns']. Turns that do not
    line up, or that hold different things (routes, kept sets or logprobs in one turn only, other
    sampling parameters or weights), raise TraceAlignmentError: one record holds one policy's
    sampling. A turn whose kept sets capture omitted (extra['support_omitted']) makes the record's
    kept sets absent, as capture's 'omit' policy does for a single turn.
    """
    where = Where(record=turn.key)
    previous.require_all_layers("stitch")
    turn.require_all_layers("stitch")
    P = previous.num_tokens
    if turn.num_tokens < P or not np.array_equal(turn.token_ids_S[:P], previous.token_ids_S):
        raise TraceAlignmentError(where.with_(field="token_ids_S"), f"an extension of the {P} tokens of {previous.key!r}",
                                  f"{turn.num_tokens} tokens whose prefix differs")
    if previous.routes_TLK is None or turn.routes_TLK is None:
        raise TraceAlignmentError(where.with_(field="routes_TLK"), "routes in both turns",
                                  f"routes in {previous.key!r}: {previous.routes_TLK is not None}, "
                                  f"in {turn.key!r}: {turn.routes_TLK is not None}")
    if not previous.route_start <= turn.route_start <= P - 1:
        raise TraceAlignmentError(where.with_(field="route_start"), f"in [{previous.route_start}, {P - 1}]",
                                  turn.route_start, f"the previous turn covers positions up to {P - 2}")
    if turn.num_generated and turn.spans[0][0] < P:
        raise TraceAlignmentError(where.with_(field="prompt_len"), f">= {P} (the tokens of {previous.key!r} were sampled there)",
                                  turn.spans[0][0], "a turn samples only tokens after the previous turn's")
    previous.geometry.check_matches(turn.geometry, where)
    if previous.weights_version != turn.weights_version:  # one record holds one policy's routes
        raise TraceAlignmentError(
            where.with_(field="weights_version"), "one weights_version over the turns (their routes form one record)",
            f"weights_version {turn.weights_version!r} in {turn.key!r}, {previous.weights_version!r} in "
            f"the turn before it ({previous.key!r})")
    a, b = previous.sampling.to_dict(), turn.sampling.to_dict()
    a.pop("seed"), b.pop("seed")  # informative; the rest says how every turn's rows are scored
    if a != b:
        raise TraceAlignmentError(where.with_(field="sampling"), f"the sampling of {previous.key!r}: {a}", b,
                                  "one record is scored at one temperature / top-k / top-p / min-p")
    head = previous.routes_TLK[: turn.route_start - previous.route_start]
    routes = np.concatenate([head, turn.routes_TLK], axis=0)
    rerouted = _join_rerouted(previous, turn)
    extra = dict(turn.extra)
    extra["turns"] = [*previous.extra.get("turns", []), previous.key]
    support, omitted = _join_supports(previous, turn, where)
    if omitted is not None:
        extra["support_omitted"] = omitted
    spans = _merge_spans([*previous.spans, *turn.spans])
    prompt_len = previous.prompt_len if spans else turn.num_tokens
    one = len(spans) == 1 and spans[0] == (prompt_len, turn.num_tokens)
    return RolloutTrace(
        key=turn.key, token_ids_S=turn.token_ids_S, prompt_len=prompt_len, geometry=turn.geometry,
        routes_TLK=routes, route_start=previous.route_start, support=support,
        logprobs_G=_join_present(previous.logprobs_G, turn.logprobs_G, "logprobs_G", previous.key, where),
        engine=turn.engine, extra=extra, sampling=turn.sampling, weights_version=turn.weights_version,
        generated_spans=None if one or not spans else tuple(spans), rerouted=rerouted,
    ).validate()


def _join_rerouted(previous: RolloutTrace, turn: RolloutTrace) -> Rerouted | None:
    """`Rerouted` of a stitched record: each turn's own, plus the positions both turns routed (the
    turn forwarded them again) where the turn's route differs from the previous turn's: the record
    keeps the turn's route there, so every previous-turn token sampled after the first such position
    is stale too (it was sampled with the previous turn's route)."""
    prev_g = previous.num_generated
    positions = set(previous.rerouted.positions) if previous.rerouted else set()
    positions = {p for p in positions if p < turn.route_start}  # the turn's routes replace the rest
    stale = set(previous.rerouted.stale) if previous.rerouted else set()
    if turn.rerouted is not None:
        positions |= set(turn.rerouted.positions)
        stale |= {prev_g + g for g in turn.rerouted.stale}
    lo = turn.route_start - previous.route_start
    both = previous.routes_TLK[lo:]  # positions turn.route_start .. previous.num_tokens - 2
    changed_T = (both != turn.routes_TLK[: len(both)]).any(axis=(1, 2))
    if changed_T.any():
        moved = turn.route_start + np.flatnonzero(changed_T)
        positions |= {int(p) for p in moved}
        q_G = previous.generated_positions()
        stale |= {int(g) for g in np.flatnonzero(q_G - 1 >= int(moved[0]))}
    if not positions and not stale:
        return None
    return Rerouted(tuple(sorted(positions)), tuple(sorted(stale)))


def _merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Drop empty spans and join adjacent ones (a resumed generation continues its span)."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _join_present(a: np.ndarray | None, b: np.ndarray | None, name: str, prev_key: str, where: Where) -> np.ndarray | None:
    if a is None and b is None:
        return None
    if a is None or b is None:
        raise TraceAlignmentError(where.with_(field=name), f"{name} in every turn or in none",
                                  f"in {prev_key!r}: {a is not None}, in this turn: {b is not None}")
    return np.concatenate([a, b])


def _join_supports(previous: RolloutTrace, turn: RolloutTrace, where: Where) -> tuple[SamplingSupport | None, Any]:
    """(the turns' kept sets, row after row, or None; the 'support_omitted' entry that made it None)."""
    p, t = previous.support, turn.support
    if p is not None and t is not None:
        off = np.concatenate([p.offsets_G1, t.offsets_G1[1:] + p.offsets_G1[-1]])
        return SamplingSupport(off, np.concatenate([p.ids_N, t.ids_N]),
                               np.concatenate([p.whole_flags(), t.whole_flags()])), None
    omitted = turn.extra.get("support_omitted", previous.extra.get("support_omitted"))
    if (p is None and t is None) or omitted is not None:
        return None, omitted
    raise TraceAlignmentError(where.with_(field="support"), "kept sets in every turn or in none",
                              f"in {previous.key!r}: {p is not None}, in {turn.key!r}: {t is not None}",
                              "and no extra['support_omitted'] saying capture dropped them")
