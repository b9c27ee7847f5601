"""One route chunk <-> bytes: the routes of a run of positions that records share, stored once.

A chunk holds, for T consecutive positions, their token ids and routes [T, L, K], and nothing
that differs per sample (kept sets, logprobs, sampling stay in the record). Its payload,
little-endian:

  head    magic b"MRCK" version:u16 reserved:u16 meta_len:u32 meta_crc32:u32          16 bytes
  meta    msgpack {"key", "rows", "layers", "top_k", "num_experts", "token_itemsize",
                   "tokens_crc32", "codec", "params", "layer_crc32": [CRC-32 of each
                   layer's bytes], "data_len"}                                          meta_len
  tokens  T token ids, unsigned, token_itemsize bytes each                             T * itemsize
  data    the layered route codec's payload (codec.routes.LayeredCodec): layer after
          layer, each byte-addressable from params["offsets"]                          data_len

Why its own head and per-part checksums: a reader of some layers (a pipeline stage) reads the
head, the meta, the tokens and the bytes of its layers, never the whole payload, and still checks
everything it reads (the meta against meta_crc32, the tokens and each layer against their CRCs).
A reader of the whole chunk has the store frame's CRC over all of it. Which records use a chunk,
and how it is keyed, is the store's business (store/chunks.py); this module packs and checks bytes.

Legend: T rows (routed positions) of the chunk, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import numpy as np

from ..errors import ChecksumError, SchemaVersionError, TraceFormatError, TruncatedRecordError, Where
from .routes import ROUTE_CODECS, LayeredCodec

CHUNK_MAGIC = b"MRCK"
CHUNK_VERSION = 1
READABLE_CHUNK_VERSIONS = (1,)
HEAD = struct.Struct("<4sHHII")
CHUNK_CODEC = "moe_replay_layered"
class ChunkShape(NamedTuple):
    """What a record expects of a chunk it names: rows, its geometry's L, K, E and token width."""

    rows: int
    layers: int
    top_k: int
    num_experts: int
    token_itemsize: int


def head_read_bytes(want: ChunkShape) -> int:
    """A partial reader's first read: the head, the meta (~220 bytes with the key, ~10 a layer for
    its offset and CRC: 677 bytes at 48 layers, 240 at 2) and the tokens of the chunk it expects;
    a larger meta costs one more read."""
    return HEAD.size + 256 + 12 * want.layers + want.rows * want.token_itemsize


def is_chunk(payload: bytes | memoryview) -> bool:
    """Whether a frame's payload is a chunk (a record's starts with a msgpack map, never b"MRCK")."""
    return bytes(payload[:4]) == CHUNK_MAGIC


@dataclass(frozen=True)
class ChunkMeta:
    """What a chunk's meta says: enough to check it against the record that needs it and to find
    the bytes of any layer range."""

    key: str
    rows: int
    layers: int
    top_k: int
    num_experts: int
    params: dict[str, Any]
    layer_crc32: tuple[int, ...]
    token_itemsize: int
    tokens_crc32: int
    tokens_start: int
    """Offset of the token ids in the payload (HEAD.size + meta_len)."""
    data_len: int

    @property
    def shape(self) -> ChunkShape:
        return ChunkShape(self.rows, self.layers, self.top_k, self.num_experts, self.token_itemsize)

    @property
    def data_start(self) -> int:
        """Offset of the route bytes in the payload (after the tokens)."""
        return self.tokens_start + self.rows * self.token_itemsize

    @property
    def payload_len(self) -> int:
        return self.data_start + self.data_len

    def layer_range(self, first: int, stop: int) -> tuple[int, int]:
        """Payload offsets [start, end) of layers [first, stop)."""
        a, b = _codec().layer_span(self.params, first, stop, self.layers)
        return self.data_start + a, self.data_start + b


def _codec() -> LayeredCodec:
    return ROUTE_CODECS.get(CHUNK_CODEC)  # type: ignore[return-value]


def encode_chunk(key: str, tokens_T: np.ndarray, token_dtype: np.dtype, routes_TLK: np.ndarray, num_experts: int) -> bytes:
    """The payload of one chunk holding `tokens_T` (as `token_dtype`) and `routes_TLK` under `key`."""
    t, l, k = routes_TLK.shape
    if len(tokens_T) != t:
        raise ValueError(f"chunk {key!r}: expected {t} token ids (one per route row), found {len(tokens_T)}")
    tokens_b = np.ascontiguousarray(tokens_T, dtype=np.dtype(token_dtype).newbyteorder("<")).tobytes()
    data, params = _codec().encode(routes_TLK, num_experts)
    offsets = params["offsets"]
    view = memoryview(data)
    meta = msgpack.packb({
        "key": key, "rows": t, "layers": l, "top_k": k, "num_experts": num_experts,
        "token_itemsize": np.dtype(token_dtype).itemsize, "tokens_crc32": zlib.crc32(tokens_b), "codec": CHUNK_CODEC,
        "params": params, "layer_crc32": [zlib.crc32(view[a:b]) for a, b in zip(offsets, offsets[1:])], "data_len": len(data),
    }, use_bin_type=True)
    return HEAD.pack(CHUNK_MAGIC, CHUNK_VERSION, 0, len(meta), zlib.crc32(meta)) + meta + tokens_b + data


def read_meta(prefix: bytes | memoryview, where: Where) -> ChunkMeta | int:
    """The meta of the chunk whose payload starts with `prefix`, or the number of bytes the prefix
    must have to hold it (when it is shorter). Typed errors for anything else."""
    if len(prefix) < HEAD.size:
        return HEAD.size
    magic, version, _, meta_len, meta_crc = HEAD.unpack_from(prefix)
    if magic != CHUNK_MAGIC:
        raise TraceFormatError(_at(where, "chunk.magic"), repr(CHUNK_MAGIC), repr(magic))
    if version not in READABLE_CHUNK_VERSIONS:
        raise SchemaVersionError(_at(where, "chunk.version"), f"a chunk version in {list(READABLE_CHUNK_VERSIONS)}",
                                 version, "written by a different moe_replay; upgrade the reader")
    if len(prefix) < HEAD.size + meta_len:
        return HEAD.size + meta_len
    meta_b = bytes(prefix[HEAD.size:HEAD.size + meta_len])
    if zlib.crc32(meta_b) != meta_crc:
        raise ChecksumError(_at(where, "chunk.meta_crc32"), f"{meta_crc:#010x}", f"{zlib.crc32(meta_b):#010x}",
                            "chunk bytes are corrupt")
    try:
        m = msgpack.unpackb(meta_b, raw=False, strict_map_key=True)
        meta = ChunkMeta(
            key=_typed(m, "key", str), rows=_typed(m, "rows", int), layers=_typed(m, "layers", int),
            top_k=_typed(m, "top_k", int), num_experts=_typed(m, "num_experts", int), params=_typed(m, "params", dict),
            layer_crc32=tuple(_typed(m, "layer_crc32", list)), token_itemsize=_typed(m, "token_itemsize", int),
            tokens_crc32=_typed(m, "tokens_crc32", int), tokens_start=HEAD.size + meta_len, data_len=_typed(m, "data_len", int))
        codec = _typed(m, "codec", str)
    except (KeyError, TypeError, ValueError, msgpack.exceptions.UnpackException) as e:
        raise TraceFormatError(_at(where, "chunk.meta"), "a chunk meta map", f"{type(e).__name__}: {e}") from None
    if codec != CHUNK_CODEC:
        raise TraceFormatError(_at(where, "chunk.codec"), repr(CHUNK_CODEC), repr(codec))
    if (len(meta.layer_crc32) != meta.layers or min(meta.rows, meta.layers, meta.top_k, meta.num_experts) < 1
            or meta.token_itemsize not in (2, 4)):
        raise TraceFormatError(_at(where, "chunk.meta"), f"{meta.layers} layer checksums and positive sizes",
                               f"{len(meta.layer_crc32)} checksums, rows={meta.rows}, layers={meta.layers}, "
                               f"token_itemsize={meta.token_itemsize}")
    return meta


def _at(where: Where, part: str) -> Where:
    """`where` naming `part` of the chunk its field names (a store names the chunk there)."""
    return where.with_(field=f"{where.field}: {part}" if where.field else part)


def _typed(m: dict, name: str, kind: type) -> Any:
    value = m[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"{name}: expected {kind.__name__}, found {type(value).__name__}")
    return value


def check_shape(meta: ChunkMeta, want: ChunkShape, where: Where) -> None:
    """Refuse a chunk that is not the one a record asked for (rows, geometry, token width)."""
    if want != meta.shape:
        raise TraceFormatError(_at(where, "chunk shape"), f"(rows, layers, top_k, experts, token bytes) = {tuple(want)}",
                               tuple(meta.shape), "the chunk is not the one the record refers to")


def decode_tokens(meta: ChunkMeta, part: bytes | memoryview, where: Where, checked: bool = False) -> np.ndarray:
    """The chunk's T token ids (int64) from `part`, its payload bytes [tokens_start, data_start)."""
    if len(part) != meta.rows * meta.token_itemsize:
        raise TruncatedRecordError(_at(where, "chunk tokens"), f"{meta.rows * meta.token_itemsize} bytes", len(part))
    if not checked and zlib.crc32(part) != meta.tokens_crc32:
        raise ChecksumError(_at(where, "chunk tokens crc32"), f"{meta.tokens_crc32:#010x}", f"{zlib.crc32(part):#010x}",
                            "chunk bytes are corrupt")
    return np.frombuffer(part, dtype=f"<u{meta.token_itemsize}").astype(np.int64)


def decode_layers(meta: ChunkMeta, part: bytes | memoryview, first: int, stop: int, where: Where,
                  checked: bool = False) -> np.ndarray:
    """Routes [T, stop - first, K] of layers [first, stop) from `part`, the payload bytes
    meta.layer_range(first, stop) names, each layer checked against its CRC (unless `checked`:
    a CRC over all of them held already)."""
    a, _ = meta.layer_range(first, stop)
    view = memoryview(part)
    offsets = meta.params["offsets"]
    for j in range(first, stop) if not checked else ():
        lo, hi = offsets[j] - (a - meta.data_start), offsets[j + 1] - (a - meta.data_start)
        crc = zlib.crc32(view[lo:hi])
        if crc != meta.layer_crc32[j]:
            raise ChecksumError(_at(where, f"chunk layer {j} crc32"), f"{meta.layer_crc32[j]:#010x}", f"{crc:#010x}",
                                "chunk bytes are corrupt")
    try:
        return _codec().decode_layers(view, (meta.rows, meta.layers, meta.top_k), meta.num_experts, meta.params, first, stop)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise TraceFormatError(_at(where, "chunk routes"), "decodable chunk routes", f"{type(e).__name__}: {e}") from None


def decode_chunk(payload: bytes | memoryview, where: Where, first: int = 0, stop: int | None = None,
                 checked: bool = True) -> tuple[ChunkMeta, np.ndarray, np.ndarray]:
    """(meta, token ids, routes of layers [first, stop)) of a whole payload; `checked`: a CRC over
    the whole payload held already (the store frame's), so the per-part CRCs are not computed again."""
    meta = read_meta(payload, where)
    if isinstance(meta, int) or len(payload) != meta.payload_len:
        want = meta if isinstance(meta, int) else meta.payload_len
        raise TruncatedRecordError(_at(where, "chunk"), f"{want} bytes", f"{len(payload)} bytes")
    stop = meta.layers if stop is None else stop
    a, b = meta.layer_range(first, stop)
    view = memoryview(payload)
    tokens_T = decode_tokens(meta, view[meta.tokens_start:meta.data_start], where, checked)
    return meta, tokens_T, decode_layers(meta, view[a:b], first, stop, where, checked)


def peek_chunk_key(payload: bytes | memoryview, where: Where) -> str:
    """The chunk's key, after the checks of its head and meta."""
    meta = read_meta(payload, where)
    if isinstance(meta, int):
        raise TruncatedRecordError(_at(where, "chunk"), f"{meta} bytes", f"{len(payload)} bytes")
    return meta.key
