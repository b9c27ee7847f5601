"""One trace <-> one self-describing, checksummed record (msgpack envelope, binary payloads).

Layout: outer = msgpack {"format", "v", "crc32", "body"}; body = msgpack of the fields below,
with arrays as little-endian binary payloads. A reader checks the format name and schema
version first (refusing what it cannot interpret), then the CRC-32 of the body, then every
field; any failure is a typed TraceFormatError naming the file, record and field.

Schema v2 adds "sampling" (a map of Sampling's fields) and "weights_version" (str, int or nil).
A v1 record is migrated on read: its extra["sampling"] (what capture wrote) becomes the typed
field (defaults where absent) and leaves `extra`; its weights_version is None (not recorded).
Schema v3 adds "spans": nil (the single generated span [prompt_len, S)) or a list of [start, end]
pairs, the generated spans of a stitched multi-turn record, which the support rows and logprobs
follow; v1 and v2 records are single-span.
Schema v4 adds "route_chunks": nil (every route row is in "routes") or a list of [start, end, key]
triples, ascending and disjoint: route rows [start, end) are in the store's chunk `key`
(codec/chunk.py; store/chunks.py decides what is shared), and "routes" holds the other rows,
in order ("shape" stays the whole [T, L, K]). Such a record decodes only through a `ChunkSource`
(its store); a reader that is not given one refuses it by name.
Schema v5 adds "rerouted": nil or [positions, stale rows] (two ascending int lists: RolloutTrace.rerouted).
"""

from __future__ import annotations

import zlib
from typing import Any, Protocol, Sequence

import msgpack
import numpy as np

from ..errors import ChecksumError, PartialTraceError, SchemaVersionError, TraceFormatError, TruncatedRecordError, Where
from ..geometry import EngineInfo, ModelGeometry, token_dtype
from ..trace import READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION, Rerouted, RolloutTrace, Sampling
from . import support as support_codec
from .chunk import ChunkShape
from .routes import ROUTE_CODECS

FORMAT = "moe_replay.trace"
DEFAULT_ROUTE_CODEC = "moe_replay"


class ChunkSource(Protocol):
    """Where a v4 record's chunked rows are read from (its store)."""

    def read_chunk(self, key: str, want: ChunkShape, first: int, stop: int, record_where: Where) -> tuple[np.ndarray, np.ndarray]:
        """(token ids [T], routes [T, stop - first, K] of layers [first, stop), indices in geometry
        order) of chunk `key`, checked against what the record expects of it; a typed error naming
        the chunk and `record_where.record` otherwise."""
        ...


def encode_trace(trace: RolloutTrace, route_codec: str = DEFAULT_ROUTE_CODEC, validate: bool = True,
                 chunks: Sequence[tuple[int, int, str]] = ()) -> bytes:
    """Serialise a trace (validated first unless told otherwise). `chunks`: (start, end, key) per
    run of route rows the store keeps in a shared chunk (ascending, disjoint); those rows are left
    out of the record, which names the chunks instead."""
    if trace.route_layer_ids is not None:
        raise PartialTraceError(
            Where(record=trace.key, field="route_layer_ids"), "a whole trace (routes of every MoE layer)",
            f"routes of layers {list(trace.route_layer_ids)} only", "a trace read with layers=... cannot be stored")
    if validate:
        trace.validate()
    g = trace.geometry
    body: dict[str, Any] = {
        "key": trace.key,
        "prompt_len": int(trace.prompt_len),
        "route_start": int(trace.route_start),
        "geometry": g.to_dict(),
        "engine": trace.engine.to_dict(),
        "extra": trace.extra,
        "tokens": None,
        "num_tokens": trace.num_tokens,
        "routes": None,
        "support": None,
        "logprobs": None,
        "sampling": trace.sampling.to_dict(),
        "weights_version": trace.weights_version,
        "spans": [list(s) for s in trace.spans] if trace.multi_span else None,
        "route_chunks": None,
        "rerouted": None if trace.rerouted is None else trace.rerouted.to_list(),
    }
    tokens_S = trace.token_ids_S
    if chunks:
        if trace.routes_TLK is None:
            raise ValueError(f"record {trace.key!r}: chunks given for a trace without routes")
        _check_chunk_refs([list(c) for c in chunks], trace.num_route_rows, Where(record=trace.key, field="route_chunks"))
        body["route_chunks"] = [[int(a), int(b), str(k)] for a, b, k in chunks]
        keep_S = np.ones(trace.num_tokens, dtype=bool)
        for a, b, _ in chunks:  # the chunk holds the tokens of its rows' positions too
            keep_S[trace.route_start + a:trace.route_start + b] = False
        tokens_S = tokens_S[keep_S]
    body["tokens"] = np.ascontiguousarray(tokens_S, dtype=token_dtype(g.vocab_size).newbyteorder("<")).tobytes()
    if trace.routes_TLK is not None:
        codec = ROUTE_CODECS.get(route_codec)
        inline = trace.routes_TLK
        if chunks:
            keep_T = np.ones(trace.num_route_rows, dtype=bool)
            for a, b, _ in chunks:
                keep_T[a:b] = False
            inline = trace.routes_TLK[keep_T]
        data, params = codec.encode(inline, g.num_experts)
        body["routes"] = {"codec": codec.name, "params": params, "shape": list(trace.routes_TLK.shape), "data": data}
    if trace.support is not None:
        data, params = support_codec.encode(trace.support, g.vocab_size)
        body["support"] = {"codec": "gap_varint_deflate", "params": params, "data": data}
    if trace.logprobs_G is not None:
        body["logprobs"] = np.ascontiguousarray(trace.logprobs_G, dtype="<f4").tobytes()
    packed = msgpack.packb(body, use_bin_type=True)
    return msgpack.packb({"format": FORMAT, "v": SCHEMA_VERSION, "crc32": zlib.crc32(packed), "body": packed}, use_bin_type=True)


FIELDS_SINCE: dict[int, tuple[str, ...]] = {2: ("sampling", "weights_version"), 3: ("spans",), 4: ("route_chunks",), 5: ("rerouted",)}
"""Body fields each schema version introduced (every writer of that version writes them, nil when unset): a body
claiming an older version must not hold them. The checksum covers the body only, so this is what catches a
version byte flipped to another readable version (3 -> 2 or 1)."""


def _unpack(data: bytes, where: Where, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except msgpack.exceptions.ExtraData:
        raise TraceFormatError(where, f"one msgpack {what}", "trailing bytes after it") from None
    except (ValueError, msgpack.exceptions.UnpackException) as e:
        if "incomplete" in str(e).lower() or isinstance(e, msgpack.exceptions.OutOfData):
            raise TruncatedRecordError(where, f"a complete msgpack {what}", f"{len(data)} bytes ending early") from None
        raise TraceFormatError(where, f"a msgpack {what}", f"undecodable bytes ({type(e).__name__}: {e})") from None
    except Exception as e:  # msgpack raises assorted types on hostile input
        raise TraceFormatError(where, f"a msgpack {what}", f"undecodable bytes ({type(e).__name__}: {e})") from None


def _field(d: dict, name: str, types: type | tuple, where: Where) -> Any:
    if not isinstance(d, dict) or name not in d:
        raise TraceFormatError(where.with_(field=name), "present", "missing")
    value = d[name]
    if not isinstance(value, types):
        raise TraceFormatError(where.with_(field=name), f"type {types}", type(value).__name__)
    return value


def peek_key(data: bytes, where: Where = Where()) -> str:
    """The record's key, after the same envelope checks as decode_trace (cheap: no payload decode)."""
    return _field(_check_envelope(data, where)[1], "key", str, where)


def _check_envelope(data: bytes, where: Where) -> tuple[int, dict]:
    outer = _unpack(data, where, "record envelope")
    if not isinstance(outer, dict):
        raise TraceFormatError(where.with_(field="envelope"), "a map", type(outer).__name__)
    fmt = outer.get("format")
    if fmt != FORMAT:
        raise TraceFormatError(where.with_(field="format"), repr(FORMAT), repr(fmt))
    version = outer.get("v")
    if isinstance(version, bool) or version not in READABLE_SCHEMA_VERSIONS:
        raise SchemaVersionError(
            where.with_(field="v"), f"a schema version in {list(READABLE_SCHEMA_VERSIONS)}", repr(version),
            "written by a different moe_replay; upgrade the reader"
        )
    body = _field(outer, "body", bytes, where)
    crc = _field(outer, "crc32", int, where)
    if zlib.crc32(body) != crc:
        raise ChecksumError(where.with_(field="crc32"), f"{crc:#010x}", f"{zlib.crc32(body):#010x}", "record bytes are corrupt")
    body_d = _unpack(body, where, "record body")
    if not isinstance(body_d, dict):
        raise TraceFormatError(where.with_(field="body"), "a map", type(body_d).__name__)
    later = sorted(f for v, fields in FIELDS_SINCE.items() if v > version for f in fields if f in body_d)
    if later:  # the version byte sits outside the checksum: one flipped bit turns a v3 record into a readable v2 or v1
        raise TraceFormatError(where.with_(field="v"), f"a version-{version} body (no {later} field: those came later)",
                               f"a body with {later}", "the version byte is corrupt")
    return version, body_d


def record_chunks(data: bytes, where: Where = Where()) -> list[tuple[int, int, str]]:
    """The (start, end, key) chunks a record refers to ([] for one holding all its rows), after
    the envelope checks of decode_trace (no payload decoded)."""
    version, body = _check_envelope(data, where)
    return _chunk_refs(body, version, where.with_(record=body.get("key") if isinstance(body.get("key"), str) else None))


def _chunk_refs(body: dict, version: int, where: Where) -> list[tuple[int, int, str]]:
    if version < 4:
        return []
    if "route_chunks" not in body:
        raise TraceFormatError(where.with_(field="route_chunks"), "present (nil when every row is inline)", "missing")
    refs = body["route_chunks"]
    if refs is None:
        return []
    rows = body.get("routes", {}).get("shape", [None])[0] if isinstance(body.get("routes"), dict) else None
    if not isinstance(rows, int):
        raise TraceFormatError(where.with_(field="route_chunks"), "chunks of a record with routes", "a record without routes")
    _check_chunk_refs(refs, rows, where.with_(field="route_chunks"))
    return [(a, b, k) for a, b, k in refs]


def _check_chunk_refs(refs: Any, rows: int, where: Where) -> None:
    ok = isinstance(refs, list) and refs and all(
        isinstance(r, list) and len(r) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in r[:2])
        and isinstance(r[2], str) and r[2] for r in refs)
    if ok:
        lo = 0
        for a, b, _ in refs:
            ok = ok and lo <= a < b <= rows
            lo = b
    if not ok:
        raise TraceFormatError(where, f"ascending, disjoint, non-empty [start, end, key] row runs inside [0, {rows})",
                               repr(refs)[:120])


def decode_trace(data: bytes, where: Where = Where(), validate: bool = True, chunks: ChunkSource | None = None,
                 layers: Sequence[int] | None = None) -> RolloutTrace:
    """Parse and check one record; every failure is a TraceFormatError (or subclass) with its location.

    A record whose rows are partly in shared chunks (schema v4 `route_chunks`) reads them from
    `chunks` (its store); without one it is refused by name. `layers`: MoE layer ids to read the
    routes of (a pipeline stage's); the trace then holds only those (`route_layer_ids`), and of
    each chunk only their bytes are read."""
    version, body = _check_envelope(data, where)
    key = _field(body, "key", str, where)
    w = where.with_(record=key)
    try:
        geometry = ModelGeometry.from_dict(_field(body, "geometry", dict, w))
    except (TypeError, ValueError) as e:
        raise TraceFormatError(w.with_(field="geometry"), "a valid ModelGeometry", str(e)) from None
    try:
        engine = EngineInfo.from_dict(_field(body, "engine", dict, w))
    except TypeError as e:
        raise TraceFormatError(w.with_(field="engine"), "a valid EngineInfo", str(e)) from None
    extra = _field(body, "extra", dict, w)
    sampling, weights_version = _identity(body, version, extra, w)
    num_tokens = _field(body, "num_tokens", int, w)
    route_start = _field(body, "route_start", int, w)
    refs = _chunk_refs(body, version, w)
    index_L = _layer_index(geometry, layers, w)
    tdt = token_dtype(geometry.vocab_size).newbyteorder("<")
    tokens_b = _field(body, "tokens", bytes, w)
    covered = sum(b - a for a, b, _ in refs)
    if len(tokens_b) != (num_tokens - covered) * tdt.itemsize:
        held = f" (the {covered} tokens of its chunks left out)" if refs else ""
        raise TraceFormatError(w.with_(field="tokens"), f"{(num_tokens - covered) * tdt.itemsize} bytes{held}", len(tokens_b))
    tokens_S = np.frombuffer(tokens_b, dtype=tdt)
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    if refs:
        if chunks is None:
            raise TraceFormatError(w.with_(field="route_chunks"), "a record holding all its routes, or a chunk source (its store)",
                                   f"{len(refs)} shared chunks, {covered} of its route rows",
                                   "read the record through the store that wrote it")
        first, stop = (0, geometry.num_moe_layers) if index_L is None else (int(index_L[0]), int(index_L[-1]) + 1)
        parts = [chunks.read_chunk(ck, ChunkShape(b - a, geometry.num_moe_layers, geometry.top_k, geometry.num_experts,
                                                  tdt.itemsize), first, stop, w) for a, b, ck in refs]
        tokens_S = _join_tokens(tokens_S, refs, [t for t, _ in parts], route_start, num_tokens)
    trace = RolloutTrace(
        key=key,
        generated_spans=_spans(body, version, w),
        token_ids_S=tokens_S,
        prompt_len=_field(body, "prompt_len", int, w),
        route_start=route_start,
        geometry=geometry,
        engine=engine,
        extra=extra,
        sampling=sampling,
        weights_version=weights_version,
        rerouted=_rerouted(body, version, w),
    )
    trace.validate_spans(w)  # the support and logprobs sizes below follow the spans
    routes = body.get("routes")
    if routes is not None:
        rw = w.with_(field="routes")
        shape = _field(routes, "shape", list, rw)
        want = (trace.num_route_rows, geometry.num_moe_layers, geometry.top_k)
        if tuple(shape) != want:
            raise TraceFormatError(rw, f"shape {list(want)}", shape)
        inline_rows = want[0] - sum(b - a for a, b, _ in refs)
        try:
            codec = ROUTE_CODECS.get(_field(routes, "codec", str, rw))
            inline_TLK = codec.decode(_field(routes, "data", bytes, rw), (inline_rows, *want[1:]), geometry.num_experts,
                                      _field(routes, "params", dict, rw))
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise TraceFormatError(rw, "decodable route payload", f"{type(e).__name__}: {e}") from None
        if refs:
            trace.routes_TLK = _assemble(inline_TLK, refs, [r for _, r in parts], index_L, want)
        else:
            trace.routes_TLK = inline_TLK if index_L is None else inline_TLK[:, index_L]
        if index_L is not None:
            trace.route_layer_ids = tuple(geometry.moe_layer_ids[j] for j in index_L)
    sup = body.get("support")
    if sup is not None:
        sw = w.with_(field="support")
        try:
            trace.support = support_codec.decode(_field(sup, "data", bytes, sw), geometry.vocab_size, _field(sup, "params", dict, sw))
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise TraceFormatError(sw, "decodable support payload", f"{type(e).__name__}: {e}") from None
    lp = body.get("logprobs")
    if lp is not None:
        if not isinstance(lp, bytes) or len(lp) != 4 * trace.num_generated:
            raise TraceFormatError(w.with_(field="logprobs"), f"{4 * trace.num_generated} bytes", len(lp) if isinstance(lp, bytes) else type(lp).__name__)
        trace.logprobs_G = np.frombuffer(lp, dtype="<f4").astype(np.float32, copy=False)
    if validate:
        trace.validate(where)
    return trace


def _layer_index(geometry: ModelGeometry, layers: Sequence[int] | None, where: Where) -> np.ndarray | None:
    """Indices on the L axis of the layer ids asked for (None: every layer)."""
    if layers is None:
        return None
    index = {lid: j for j, lid in enumerate(geometry.moe_layer_ids)}
    wanted = sorted(set(int(i) for i in layers))
    unknown = [i for i in wanted if i not in index]
    if unknown or not wanted:
        raise TraceFormatError(where.with_(field="layers"), f"MoE layer ids of {list(geometry.moe_layer_ids)}",
                               unknown or "no layer", "the layers asked for are not the record's")
    if len(wanted) == len(index):
        return None
    return np.array([index[i] for i in wanted], dtype=np.int64)


def _join_tokens(inline_S: np.ndarray, refs: list[tuple[int, int, str]], chunk_tokens: list[np.ndarray], route_start: int,
                 num_tokens: int) -> np.ndarray:
    """All token ids: the record's own and its chunks' (chunk rows [a, b) are positions route_start + a..)."""
    out_S = np.empty(num_tokens, dtype=np.int64)
    pos = done = 0
    for (a, b, _), toks in zip(refs, chunk_tokens):
        a, b = route_start + a, route_start + b
        out_S[pos:a] = inline_S[done:done + a - pos]
        done += a - pos
        out_S[a:b] = toks
        pos = b
    out_S[pos:] = inline_S[done:]
    return out_S


def _assemble(inline_TLK: np.ndarray, refs: list[tuple[int, int, str]], chunk_routes: list[np.ndarray],
              index_L: np.ndarray | None, shape_TLK: tuple[int, int, int]) -> np.ndarray:
    """The record's routes: its inline rows and its chunks' rows, in row order (a fresh array)."""
    t, l, k = shape_TLK
    first, stop = (0, l) if index_L is None else (int(index_L[0]), int(index_L[-1]) + 1)
    pick = None if index_L is None or len(index_L) == stop - first else index_L - first
    lsub = l if index_L is None else len(index_L)
    out_TLK = np.empty((t, lsub, k), dtype=inline_TLK.dtype)
    row = done = 0
    for (a, b, _), part_TLK in zip(refs, chunk_routes):
        if a > row:
            out_TLK[row:a] = inline_TLK[done:done + a - row] if index_L is None else inline_TLK[done:done + a - row][:, index_L]
            done += a - row
        out_TLK[a:b] = part_TLK if pick is None else part_TLK[:, pick]
        row = b
    if row < t:
        out_TLK[row:] = inline_TLK[done:] if index_L is None else inline_TLK[done:][:, index_L]
    return out_TLK


def _rerouted(body: dict, version: int, where: Where) -> Rerouted | None:
    """A v5 body's rerouted positions and stale rows (checked against the trace by validate); None before v5."""
    if version < 5:
        return None
    if "rerouted" not in body:
        raise TraceFormatError(where.with_(field="rerouted"), "present (nil when no route changed)", "missing")
    r = body["rerouted"]
    if r is None:
        return None
    ints = lambda xs: isinstance(xs, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in xs)  # noqa: E731
    if not (isinstance(r, list) and len(r) == 2 and ints(r[0]) and ints(r[1])):
        raise TraceFormatError(where.with_(field="rerouted"), "nil or [positions, stale rows] (two int lists)", repr(r)[:80])
    try:
        return Rerouted(tuple(r[0]), tuple(r[1]))
    except ValueError as e:
        raise TraceFormatError(where.with_(field="rerouted"), "ascending, distinct ints", str(e)) from None


def _spans(body: dict, version: int, where: Where) -> tuple[tuple[int, int], ...] | None:
    """A v3 body's generated spans (checked against the tokens by validate); None before v3."""
    if version < 3:
        return None
    if "spans" not in body:
        raise TraceFormatError(where.with_(field="spans"), "present (nil for one span)", "missing")
    spans = body["spans"]
    if spans is None:
        return None
    if not isinstance(spans, list) or not all(
            isinstance(s, list) and len(s) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in s) for s in spans):
        raise TraceFormatError(where.with_(field="spans"), "nil or a list of [start, end] int pairs", repr(spans)[:80])
    return tuple((a, b) for a, b in spans)


def _identity(body: dict, version: int, extra: dict, where: Where) -> tuple[Sampling, str | int | None]:
    """(sampling, weights_version) of a v2 body, or migrated from a v1 body's extra (which loses "sampling")."""
    if version == 1:
        raw = extra.pop("sampling", {})
        sw = where.with_(field="extra.sampling")
        if not isinstance(raw, dict):
            raise TraceFormatError(sw, "a map of sampling parameters", type(raw).__name__)
        try:
            return Sampling.from_dict(raw), None
        except (TypeError, ValueError) as e:
            raise TraceFormatError(sw, "valid sampling parameters", str(e)) from None
    try:
        sampling = Sampling.from_dict(_field(body, "sampling", dict, where))
    except (TypeError, ValueError) as e:
        raise TraceFormatError(where.with_(field="sampling"), "valid sampling parameters", str(e)) from None
    if "weights_version" not in body:
        raise TraceFormatError(where.with_(field="weights_version"), "present (nil when not recorded)", "missing")
    wv = body["weights_version"]
    if wv is not None and (isinstance(wv, bool) or not isinstance(wv, (str, int))):
        raise TraceFormatError(where.with_(field="weights_version"), "a str, an int or nil", type(wv).__name__)
    return sampling, wv
