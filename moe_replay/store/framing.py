"""The byte format of a directory store: file headers, record frames and index entries.

Little-endian:
  file header   magic[8] version:u32 crc32:u32 (of the 12 bytes before it)            16 bytes
  record frame  b"MRRF" length:u64 crc32:u32 (of length and payload) payload[length]   16 + length
  index entry   b"MRIE" key_len:u32 segment:u32 offset:u64 length:u64 record_crc32:u32
                key[key_len] (UTF-8) crc32:u32 (of every earlier byte of the entry)     36 + key_len
Packing, parsing and checking these, and nothing about files or locks (directory.py).
"""

from __future__ import annotations

import re
import struct
import zlib
from typing import NamedTuple

from ..errors import ChecksumError, SchemaVersionError, TraceError, TraceFormatError, TruncatedRecordError, Where

FORMAT_VERSION = 2
"""Version of the directory layout and framing (not of the record schema, which records carry).
v1: every frame is a record holding all its routes. v2: frames are records or route chunks
(codec/chunk.py), a chunk's index key starts with store.chunks.CHUNK_KEY_PREFIX, and a record may
name chunks for some of its rows (schema v4 `route_chunks`); each chunk precedes, in the files and
in the index, the first record naming it. A store keeps the version it was created with (its
index header's, and each segment file's): a writer opening a v1 store writes whole records, as v1
says; `rescue_store` copies one into a new v2 store."""
READABLE_FORMAT_VERSIONS = (1, 2)
INDEX_NAME, LOCK_NAME = "index.bin", "writer.lock"
INDEX_MAGIC, SEGMENT_MAGIC = b"MRINDEX\x00", b"MRSEGMT\x00"
FRAME_MAGIC, ENTRY_MAGIC = b"MRRF", b"MRIE"
HEADER = struct.Struct("<8sII")
FRAME = struct.Struct("<4sQI")
ENTRY = struct.Struct("<4sIIQQI")
CRC = struct.Struct("<I")
MAX_KEY_BYTES = 1 << 16
_SEGMENT_RE = re.compile(r"^seg-(\d{6,})\.bin$")


class Entry(NamedTuple):
    """Where one record lives: its frame starts at `offset` of segment `segment`."""

    segment: int
    offset: int
    length: int
    """Payload bytes (the frame is FRAME.size longer)."""
    crc: int
    """CRC-32 of the frame (length and payload), repeated here so an entry pins its exact record."""


# -- framing ---------------------------------------------------------------------------------------
def pack_header(magic: bytes, version: int = FORMAT_VERSION) -> bytes:
    head = HEADER.pack(magic, version, 0)[:8 + 4]
    return head + CRC.pack(zlib.crc32(head))


def check_header(data: bytes, magic: bytes, where: Where) -> int:
    """Refuse a file that is not of this kind, is damaged, or has a layout version we cannot read;
    return its layout version."""
    if len(data) < HEADER.size:
        raise TruncatedRecordError(where.with_(field="header"), f"a {HEADER.size}-byte header", f"{len(data)} bytes")
    found, version, crc = HEADER.unpack_from(data)
    if found != magic:
        raise TraceFormatError(
            where.with_(field="header.magic"), repr(magic), repr(found), "not a moe_replay store file of this kind"
        )
    if zlib.crc32(data[:12]) != crc:
        actual = zlib.crc32(data[:12])
        raise ChecksumError(where.with_(field="header.crc32"), f"{crc:#010x}", f"{actual:#010x}", "file header is corrupt")
    if version not in READABLE_FORMAT_VERSIONS:
        raise SchemaVersionError(
            where.with_(field="header.version"), f"a store format version in {list(READABLE_FORMAT_VERSIONS)}", version,
            "written by a different moe_replay; upgrade the reader",
        )
    return version


def frame_crc(payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(struct.pack("<Q", len(payload))))


def pack_entry(key_bytes: bytes, e: Entry) -> bytes:
    head = ENTRY.pack(ENTRY_MAGIC, len(key_bytes), e.segment, e.offset, e.length, e.crc) + key_bytes
    return head + CRC.pack(zlib.crc32(head))


def _parse_entry(buf: bytes, pos: int, where: Where) -> tuple[str, Entry, int] | TraceError | None:
    """The entry at `pos` as (key, entry, end); None if the bytes stop before it does; else a
    TraceError (returned, not raised) saying what is wrong with it."""
    if len(buf) - pos < ENTRY.size:
        return None
    magic, key_len, seg, off, length, rcrc = ENTRY.unpack_from(buf, pos)
    if magic != ENTRY_MAGIC:
        return TraceFormatError(where.with_(field="index entry magic"), repr(ENTRY_MAGIC), repr(magic))
    if not 0 < key_len <= MAX_KEY_BYTES:
        return TraceFormatError(where.with_(field="index entry key_len"), f"1..{MAX_KEY_BYTES}", key_len)
    end = pos + ENTRY.size + key_len + CRC.size
    if end > len(buf):
        return None
    key_b = buf[pos + ENTRY.size : end - CRC.size]
    stored, actual = CRC.unpack_from(buf, end - CRC.size)[0], zlib.crc32(buf[pos : end - CRC.size])
    if stored != actual:
        key = key_b.decode("utf-8", errors="replace")
        return ChecksumError(where.with_(record=key, field="index entry crc32"), f"{stored:#010x}", f"{actual:#010x}")
    try:
        key = key_b.decode("utf-8")
    except UnicodeDecodeError:
        return TraceFormatError(where.with_(field="index entry key"), "UTF-8 key", repr(key_b[:40]))
    return key, Entry(seg, off, length, rcrc), end


class _Parsed(NamedTuple):
    entries: list[tuple[str, Entry]]
    problems: list[tuple[int, TraceError]]
    """(number of good entries before it, error) per damaged stretch of the index."""
    end: int
    """Offset (in buf) where parsing stopped: the end of the last good entry, or a torn tail."""


def parse_index(buf: bytes, base: int, where: Where) -> _Parsed:
    """Parse index bytes that start at file offset `base`. A bad entry followed by a good one is
    damage (reported, skipped by resynchronising on the next good entry); a bad or short stretch
    that no good entry follows is a torn tail (or one still being written): parsing stops there."""
    entries: list[tuple[str, Entry]] = []
    problems: list[tuple[int, TraceError]] = []
    pos = 0
    while pos < len(buf):
        got = _parse_entry(buf, pos, where)
        if isinstance(got, tuple):
            entries.append(got[:2])
            pos = got[2]
            continue
        nxt = _next_good(buf, pos + 1, where)
        if nxt is None:
            break
        err = got or TruncatedRecordError(where.with_(field="index entry"), "a complete entry", "one overlapping the next")
        detail = f"damaged index entry at byte {base + pos}: {nxt - pos} bytes skipped to the next good entry"
        problems.append((len(entries), type(err)(err.where, err.expected, err.found, detail)))
        pos = nxt
    return _Parsed(entries, problems, pos)


def _next_good(buf: bytes, start: int, where: Where) -> int | None:
    pos = buf.find(ENTRY_MAGIC, start)
    while pos != -1:
        if isinstance(_parse_entry(buf, pos, where), tuple):
            return pos
        pos = buf.find(ENTRY_MAGIC, pos + 1)
    return None


def segment_name(n: int) -> str:
    return f"seg-{n:06d}.bin"


# -- the store -------------------------------------------------------------------------------------
