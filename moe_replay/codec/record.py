"""One trace <-> one self-describing, checksummed record (msgpack envelope, binary payloads).

Layout: outer = msgpack {"format", "v", "crc32", "body"}; body = msgpack of the fields below,
with arrays as little-endian binary payloads. A reader checks the format name and schema
version first (refusing what it cannot interpret), then the CRC-32 of the body, then every
field; any failure is a typed TraceFormatError naming the file, record and field.
"""

from __future__ import annotations

import zlib
from typing import Any

import msgpack
import numpy as np

from ..errors import ChecksumError, SchemaVersionError, TraceFormatError, TruncatedRecordError, Where
from ..geometry import EngineInfo, ModelGeometry, token_dtype
from ..trace import SCHEMA_VERSION, RolloutTrace
from . import support as support_codec
from .routes import ROUTE_CODECS

FORMAT = "moe_replay.trace"
DEFAULT_ROUTE_CODEC = "moe_replay"


def encode_trace(trace: RolloutTrace, route_codec: str = DEFAULT_ROUTE_CODEC, validate: bool = True) -> bytes:
    """Serialise a trace (validated first unless told otherwise)."""
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
        "tokens": np.ascontiguousarray(trace.token_ids_S, dtype=token_dtype(g.vocab_size).newbyteorder("<")).tobytes(),
        "num_tokens": trace.num_tokens,
        "routes": None,
        "support": None,
        "logprobs": None,
    }
    if trace.routes_TLK is not None:
        codec = ROUTE_CODECS.get(route_codec)
        data, params = codec.encode(trace.routes_TLK, g.num_experts)
        body["routes"] = {"codec": codec.name, "params": params, "shape": list(trace.routes_TLK.shape), "data": data}
    if trace.support is not None:
        data, params = support_codec.encode(trace.support, g.vocab_size)
        body["support"] = {"codec": "gap_varint_deflate", "params": params, "data": data}
    if trace.logprobs_G is not None:
        body["logprobs"] = np.ascontiguousarray(trace.logprobs_G, dtype="<f4").tobytes()
    packed = msgpack.packb(body, use_bin_type=True)
    return msgpack.packb({"format": FORMAT, "v": SCHEMA_VERSION, "crc32": zlib.crc32(packed), "body": packed}, use_bin_type=True)


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
    return _field(_check_envelope(data, where), "key", str, where)


def _check_envelope(data: bytes, where: Where) -> dict:
    outer = _unpack(data, where, "record envelope")
    if not isinstance(outer, dict):
        raise TraceFormatError(where.with_(field="envelope"), "a map", type(outer).__name__)
    fmt = outer.get("format")
    if fmt != FORMAT:
        raise TraceFormatError(where.with_(field="format"), repr(FORMAT), repr(fmt))
    version = outer.get("v")
    if version != SCHEMA_VERSION:
        raise SchemaVersionError(
            where.with_(field="v"), f"schema version {SCHEMA_VERSION}", repr(version), "written by a different moe_replay; upgrade the reader"
        )
    body = _field(outer, "body", bytes, where)
    crc = _field(outer, "crc32", int, where)
    if zlib.crc32(body) != crc:
        raise ChecksumError(where.with_(field="crc32"), f"{crc:#010x}", f"{zlib.crc32(body):#010x}", "record bytes are corrupt")
    body_d = _unpack(body, where, "record body")
    if not isinstance(body_d, dict):
        raise TraceFormatError(where.with_(field="body"), "a map", type(body_d).__name__)
    return body_d


def decode_trace(data: bytes, where: Where = Where(), validate: bool = True) -> RolloutTrace:
    """Parse and check one record; every failure is a TraceFormatError (or subclass) with its location."""
    body = _check_envelope(data, where)
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
    num_tokens = _field(body, "num_tokens", int, w)
    tdt = token_dtype(geometry.vocab_size).newbyteorder("<")
    tokens_b = _field(body, "tokens", bytes, w)
    if len(tokens_b) != num_tokens * tdt.itemsize:
        raise TraceFormatError(w.with_(field="tokens"), f"{num_tokens * tdt.itemsize} bytes", len(tokens_b))
    trace = RolloutTrace(
        key=key,
        token_ids_S=np.frombuffer(tokens_b, dtype=tdt),
        prompt_len=_field(body, "prompt_len", int, w),
        route_start=_field(body, "route_start", int, w),
        geometry=geometry,
        engine=engine,
        extra=_field(body, "extra", dict, w),
    )
    routes = body.get("routes")
    if routes is not None:
        rw = w.with_(field="routes")
        shape = _field(routes, "shape", list, rw)
        want = (trace.num_route_rows, geometry.num_moe_layers, geometry.top_k)
        if tuple(shape) != want:
            raise TraceFormatError(rw, f"shape {list(want)}", shape)
        try:
            codec = ROUTE_CODECS.get(_field(routes, "codec", str, rw))
            trace.routes_TLK = codec.decode(_field(routes, "data", bytes, rw), want, geometry.num_experts, _field(routes, "params", dict, rw))
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise TraceFormatError(rw, "decodable route payload", f"{type(e).__name__}: {e}") from None
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
