"""Reading of the directory store: record and chunk frames checked against their index entries,
partial-layer chunk reads, the decoded-chunk cache, and what reads cost (`ReadStats`).

Every function reads through `pread(entry, size, offset, key)`, the store's positioned read of
the segment an entry names (it counts `ReadStats.bytes_read`); the file I/O names tests patch stay
directory.py's. A chunk read for every layer reads its whole frame and checks its CRC; one for
some layers (a pipeline stage's) reads the chunk's head, meta and tokens, then only the bytes of
those layers (each CRC-checked by the codec), so `ReadStats.by_kind["chunk_routes"]` counts just them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from ..codec.chunk import ChunkShape, decode_layers, decode_tokens, head_read_bytes, read_meta
from ..errors import ChecksumError, TraceError, TraceFormatError, TruncatedRecordError, Where
from .chunks import check_meta, decode_whole, label
from .framing import FRAME, FRAME_MAGIC, Entry, frame_crc

DEFAULT_CHUNK_CACHE_BYTES = 64 << 20
"""Decoded chunk routes a reader keeps (the prefix of a 16-sample group of 8k-token Qwen3-30B-A3B
rollouts is ~3 MiB decoded per 1k tokens)."""

Pread = Callable[[Entry, int, int, str | None], bytes]
"""pread(entry, size, offset, key): up to `size` bytes at `offset` of the segment `entry` names."""


def crc_of(frame: bytes) -> int:
    """The CRC-32 a frame's head says its length and payload have."""
    return FRAME.unpack_from(frame)[2]


@dataclass
class ReadStats:
    """What a store's reads cost: bytes read from segment files, chunk reads and cache hits."""

    bytes_read: int = 0
    chunks_read: int = 0
    chunk_cache_hits: int = 0
    by_kind: dict[str, int] = field(default_factory=lambda: {"records": 0, "chunks": 0, "chunk_routes": 0})
    """bytes_read split into record frames and chunk frames; chunk_routes: of the chunks' bytes,
    those of the route layers read (the rest: their heads and tokens, which every stage reads)."""


class ChunkCache:
    """Decoded chunk routes, least recently used out first, at most `budget` bytes (0: none kept),
    so the n samples of a prompt decode its prefix once. Keys: (chunk key, first layer, stop layer);
    values: (tokens, routes), read-only (records copy out of them, never alias them). Not locked: the
    store calls it under its own mutex, which its reading threads share."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._items: OrderedDict[tuple[str, int, int], tuple] = OrderedDict()
        self._bytes = 0

    def get(self, cache_key: tuple[str, int, int]):
        """The cached (tokens, routes), or None."""
        hit = self._items.get(cache_key)
        if hit is not None:
            self._items.move_to_end(cache_key)
        return hit

    def put(self, cache_key: tuple[str, int, int], got) -> None:
        size = sum(a.nbytes for a in got)
        if size > self.budget:
            return
        if cache_key in self._items:
            return
        self._items[cache_key] = got
        self._bytes += size
        while self._bytes > self.budget:
            _, old = self._items.popitem(last=False)
            self._bytes -= sum(a.nbytes for a in old)

    def clear(self) -> None:
        self._items.clear()
        self._bytes = 0


def read_frame(pread: Pread, e: Entry, key: str | None, where: Where, field_prefix: str = "") -> memoryview:
    """The payload of the frame entry `e` names, checked against the entry (magic, length, CRC)."""
    data = pread(e, FRAME.size + e.length, e.offset, key)
    f = field_prefix
    if len(data) < FRAME.size + e.length:
        want = f"{FRAME.size + e.length} bytes at offset {e.offset}"
        raise TruncatedRecordError(where.with_(field=f"{f}frame"), want, f"{len(data)} bytes")
    check_frame_head(data, e, where, f)
    payload = memoryview(data)[FRAME.size :]
    actual = frame_crc(payload)
    if crc_of(data) != e.crc or actual != e.crc:
        found = f"{actual:#010x} (frame says {crc_of(data):#010x})"
        raise ChecksumError(where.with_(field=f"{f}frame.crc32"), f"{e.crc:#010x}", found,
                            "chunk bytes are corrupt" if f else "record bytes are corrupt")
    return payload


def check_frame_head(data: bytes, e: Entry, where: Where, f: str) -> None:
    magic, length, _ = FRAME.unpack_from(data)
    if magic != FRAME_MAGIC:
        raise TraceFormatError(where.with_(field=f"{f}frame.magic"), repr(FRAME_MAGIC), repr(magic), f"at offset {e.offset}")
    if length != e.length:
        raise TraceFormatError(where.with_(field=f"{f}frame.length"), e.length, length, "frame and index disagree")


def chunk_field(key: str, e: Entry) -> str:
    """How a chunk's errors name it in their field: the chunk and the offset of its frame (their
    file is its segment's), so every chunk error says which chunk, which segment, which offset."""
    return f"{label(key)} at offset {e.offset}"


def naming_chunk(err: TraceError, where: Where) -> TraceError:
    """`err` (raised reading the chunk `where` names) with the chunk in its field, if it lacks it:
    a segment that is missing or has a damaged header fails before any chunk byte is read."""
    f = err.where.field or ""
    if f.startswith(where.field or ""):
        return err
    w = Where(file=err.where.file or where.file, record=where.record, field=f"{where.field}: {f}" if f else where.field)
    return type(err)(w, err.expected, err.found, err.detail)


def check_chunk_frame(pread: Pread, e: Entry, key: str, where: Where) -> None:
    """Raise the typed error of a damaged chunk frame: magic, length and CRC-32 of the whole frame
    against its entry, then its meta's CRC and key. What a writer checks before a record names a
    chunk it did not write (one pread of the frame and one CRC pass: ~0.1 ms for a 64 KiB chunk,
    docs/trace.md), and what `moe-replay inspect` checks of every chunk."""
    try:
        payload = read_frame(pread, e, None, where, f"{where.field}: ")
        meta = read_meta(payload, where)
        if isinstance(meta, int):
            raise TruncatedRecordError(where.with_(field=f"{where.field}: chunk meta"), f"{meta} bytes", len(payload))
        if meta.key != key:
            raise TraceFormatError(where.with_(field=f"{where.field}: chunk.key"), label(key), label(meta.key),
                                   "the frame holds another chunk")
    except TraceError as err:
        raise naming_chunk(err, where) from None


def read_chunk(pread: Pread, stats: ReadStats, e: Entry, key: str, want: ChunkShape, first: int, stop: int, where: Where):
    """(tokens, routes of layers [first, stop)) of the chunk frame `e` names, read-only: the whole
    frame (CRC-checked) for every layer, else the chunk's head, meta, tokens and the bytes of those
    layers (each CRC-checked). `where` names the chunk (field) and the record reading it."""
    before = stats.bytes_read
    if first == 0 and stop == want.layers:
        payload = read_frame(pread, e, where.record, where, f"{where.field}: ")
        got = decode_whole(payload, key, want, first, stop, where, checked=True)
        meta = read_meta(payload, where)
        stats.by_kind["chunk_routes"] += meta.data_len  # type: ignore[union-attr]
    else:
        got = read_chunk_layers(pread, stats, e, key, want, first, stop, where)
    stats.chunks_read += 1
    stats.by_kind["chunks"] += stats.bytes_read - before
    for array in got:
        array.flags.writeable = False  # cached: records copy out of it, never alias it
    return got


def read_chunk_layers(pread: Pread, stats: ReadStats, e: Entry, key: str, want: ChunkShape, first: int, stop: int,
                      where: Where):
    """Of a chunk's frame, read the head, meta and tokens, then the bytes of layers [first, stop)."""
    size = min(FRAME.size + head_read_bytes(want), FRAME.size + e.length)
    data = pread(e, size, e.offset, where.record)
    if len(data) < FRAME.size:
        raise TruncatedRecordError(where.with_(field=f"{where.field}: frame"), f"{FRAME.size} bytes at {e.offset}", len(data))
    check_frame_head(data, e, where, f"{where.field}: ")
    meta = read_meta(memoryview(data)[FRAME.size:], where)
    if isinstance(meta, int):
        data = pread(e, FRAME.size + min(meta, e.length), e.offset, where.record)
        meta = read_meta(memoryview(data)[FRAME.size:], where)
        if isinstance(meta, int):
            raise TruncatedRecordError(where.with_(field=f"{where.field}: chunk meta"), f"{meta} bytes", len(data) - FRAME.size)
    if meta.payload_len != e.length:
        raise TraceFormatError(where.with_(field=f"{where.field}: chunk meta"), f"a payload of {e.length} bytes",
                               f"{meta.payload_len}", "chunk meta and index disagree")
    check_meta(meta, key, want, where)
    a, b = meta.layer_range(first, stop)
    stats.by_kind["chunk_routes"] += b - a
    head = memoryview(data)[FRAME.size:]
    if a == meta.data_start:  # the first layers follow the tokens: one range
        part = payload_range(pread, e, head, meta.tokens_start, b, where)
        split = meta.data_start - meta.tokens_start
        tokens_b, routes_b = part[:split], part[split:]
    else:
        tokens_b = payload_range(pread, e, head, meta.tokens_start, meta.data_start, where)
        routes_b = payload_range(pread, e, head, a, b, where)
    return decode_tokens(meta, tokens_b, where), decode_layers(meta, routes_b, first, stop, where)


def payload_range(pread: Pread, e: Entry, head: memoryview, lo: int, hi: int, where: Where) -> memoryview:
    """Payload bytes [lo, hi) of the frame `e` names: what the first read `head` holds of them,
    and one pread of the rest."""
    if hi <= len(head):
        return head[lo:hi]
    start = max(lo, len(head))
    rest = pread(e, hi - start, e.offset + FRAME.size + start, where.record)
    return memoryview(bytes(head[lo:start]) + rest if start > lo else rest)
