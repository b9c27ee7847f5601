"""Typed payloads of the adapter's worker RPC: dataclasses that travel as plain dicts.

vLLM's collective_rpc pickles (in-process engines) or msgpack-encodes (multi-process engines) its
arguments and replies, so what crosses is a dict of str, int, float, bool, lists and packed
arrays (bytes + dtype + shape). Each payload class names its fields once; `to_dict` / `from_dict`
are the only code that knows the wire shape, so client and worker cannot drift apart on a key.

Every op replies in one envelope (`ok` / `fail`), so a worker-side error reaches the client as
(class name, message) and is re-raised there as the same typed error (link.py).

Legend: S tokens of a sequence, T routed positions, L MoE layers, K top-k, G generated tokens,
N kept ids over the generated tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np


def pack_array(arr: np.ndarray) -> dict[str, Any]:
    """Array as plain bytes + dtype + shape: survives every RPC serialiser vLLM uses unchanged."""
    arr = arr if isinstance(arr, np.ndarray) else np.asarray(arr)
    return {"dtype": arr.dtype.str, "shape": list(arr.shape), "data": arr.tobytes()}  # tobytes: C order, any strides


def unpack_array(d: Any, copy: bool = True) -> np.ndarray:
    """The array of pack_array's dict (a copy, writable; copy False: a read-only view of its bytes)."""
    if isinstance(d, dict) and "data" in d:
        arr = np.frombuffer(d["data"], dtype=d["dtype"]).reshape(d["shape"])
        return arr.copy() if copy else arr
    return np.asarray(d)


_FIELDS: dict[type, tuple[tuple[str, ...], frozenset[str]]] = {}
"""Field names per payload class, read once: dataclasses.fields() builds them anew on every call,
and a take encodes and decodes one CaptureRecord per sample (8 samples: 16 calls per collect)."""


def _fields(cls: type) -> tuple[tuple[str, ...], frozenset[str]]:
    got = _FIELDS.get(cls)
    if got is None:
        names = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
        got = _FIELDS[cls] = (names, frozenset(names))
    return got


class _Wire:
    """to_dict / from_dict for a dataclass whose ARRAYS fields are numpy arrays (or None)."""

    ARRAYS: ClassVar[tuple[str, ...]] = ()
    COPY: ClassVar[bool] = True
    """from_dict copies each array (writable); False: read-only views of the reply's bytes."""

    def to_dict(self) -> dict[str, Any]:
        out = {}
        arrays = self.ARRAYS
        for name in _fields(type(self))[0]:
            v = getattr(self, name)
            out[name] = pack_array(v) if v is not None and name in arrays else (
                list(v) if isinstance(v, tuple) else v)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        names = _fields(cls)[1]
        if not names.issuperset(d):
            raise ValueError(f"{cls.__name__}: unknown wire field(s) {sorted(set(d) - names)}; expected {sorted(names)}")
        arrays, copy = cls.ARRAYS, cls.COPY
        return cls(**{k: unpack_array(v, copy) if v is not None and k in arrays else v for k, v in d.items()})


def ok(value: Any = None) -> dict[str, Any]:
    """Reply envelope of an op that succeeded."""
    return {"ok": True, "value": value}


def fail(e: BaseException) -> dict[str, Any]:
    """Reply envelope of an op that raised: the error's class name and message."""
    return {"ok": False, "kind": type(e).__name__, "error": str(e)}


@dataclass(frozen=True)
class InstallReply(_Wire):
    """What a worker reports after installing capture or scoring on its runner."""

    geometry: dict[str, Any]
    """ModelGeometry.to_dict() of the served model."""
    slot_cache: bool = False
    """Capture keeps routes per KV slot (prefix-cache hits get full routes)."""


@dataclass(frozen=True)
class WeightSyncReply(_Wire):
    """What a worker did to finish a weight sync (weights.py)."""

    repacked: int = 0
    """CPU MoE layers whose experts were prepacked again (0 off the CPU backend)."""
    reloaded_directly: list[str] = field(default_factory=list)
    """Layers loaded straight from the checkpoint (PLAIN_COPY_KEYS), not through the reload."""
    slot_routes_cleared: bool = False
    """Whether a capture route cache of the old weights was dropped."""


@dataclass(frozen=True)
class CaptureRecord(_Wire):
    """One request's capture record as the worker hands it over (status 'ok'), or why not."""

    ARRAYS: ClassVar[tuple[str, ...]] = ("routes_TLK", "routes_filled_T", "tokens_G", "logprobs_G",
                                         "support_sizes_G", "support_offsets_G1", "support_ids_N")
    COPY: ClassVar[bool] = False
    """Read-only views: the client reads every array once and copies only the cut it keeps
    (assemble.build_trace), so a copy of each on decoding would be a second one (7 per record)."""

    status: Literal["ok", "evicted", "ambiguous", "unknown"]
    key: str = ""
    """The id the client asked for (engine request id without vLLM's random suffix)."""
    known: int = 0
    """Records held on the worker (status 'unknown' / 'evicted')."""
    matches: list[str] = field(default_factory=list)
    """Engine request ids matching `key` (status 'ambiguous')."""
    req_id: str = ""
    prompt_len: int = 0
    route_start: int = 0
    routes_TLK: np.ndarray | None = None
    """Routes by position from route_start, as many rows as the worker saw."""
    routes_filled_T: np.ndarray | None = None
    """Rows of routes_TLK that were written (a gap is an error, never zeros)."""
    tokens_G: np.ndarray | None = None
    """Sampled tokens, as the sampler drew them."""
    logprobs_G: np.ndarray | None = None
    support_sizes_G: np.ndarray | None = None
    support_offsets_G1: np.ndarray | None = None
    support_ids_N: np.ndarray | None = None
    problems: list[str] = field(default_factory=list)
    """Why the record cannot make a trace (misaligned rows, unwritten layers, ...); empty if it can."""
    rerouted: list[int] = field(default_factory=list)
    """Positions whose route a later forward of the same token changed (a recompute preemption's
    re-prefill): routes_TLK holds the later one (capture/row_log.py, provenance)."""
    stale: list[int] = field(default_factory=list)
    """Generated rows g sampled from a forward that saw a route in `rerouted` before it changed."""
    preempted: bool = False
    """The scheduler preempted and recomputed the request (routes the engine returns itself cannot
    say where a re-prefill changed them: capture/preemption.py)."""


@dataclass(frozen=True)
class ScoreRequest(_Wire):
    """One scoring request registered on the worker before the engine runs it."""

    ARRAYS: ClassVar[tuple[str, ...]] = ("tokens_S", "routes_TLK", "support_offsets_G1", "support_ids_N")

    key: str
    """Engine request id of the scoring request."""
    tokens_S: np.ndarray
    prompt_len: int
    temperature: float
    max_cached: int = 0
    """Prompt tokens the request may read from the prefix cache (prompt reuse: prompt_len - 1)."""
    route_start: int = 0
    routes_TLK: np.ndarray | None = None
    """Forced expert ids of positions [route_start, S - 1); None: free routing."""
    support_offsets_G1: np.ndarray | None = None
    support_ids_N: np.ndarray | None = None
    """The trace's kept sets (CSR); None: score over the vocabulary."""


@dataclass(frozen=True)
class ScoreResult(_Wire):
    """A finished scoring request's log-probabilities (status 'ok'), or 'unknown'."""

    ARRAYS: ClassVar[tuple[str, ...]] = ("logprobs_G",)

    status: Literal["ok", "unknown"]
    logprobs_G: np.ndarray | None = None
    problems: list[str] = field(default_factory=list)
    cached: int = 0
    """Tokens the engine read from the prefix cache (the first forwarded position); -1: never seen."""
    known: int = 0
    """Scoring requests registered on the worker (status 'unknown')."""
