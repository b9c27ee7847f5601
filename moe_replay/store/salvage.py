"""Find the records a directory store's segments hold that its index does not name.

Each frame is framed and checksummed (directory.py), so an intact frame is a whole record whatever
became of its index entry. Two places hold such frames:

- Holes: bytes between named frames (or a whole segment before the last named one) that no entry
  names, because an entry was damaged. `find_holes` finds them from the entries alone (no segment
  bytes read); `scan_hole` reads a hole frame by frame: intact frames come back as `Found`, damaged
  bytes as typed errors (never as records). Readers and writers both do this.
- The tail: segment bytes after the last named frame (and any later segment files). A crash
  between the segment sync and the index sync of a commit, or a truncated or partly restored
  index.bin, leaves intact frames there. A writer opening the store scans them (`plan_salvage`),
  indexes them again, in file order, and cuts only bytes that are not part of an intact frame.
  Those can only be a torn tail: damaged bytes followed by an intact frame are not a crash, and the
  writer refuses to open rather than delete the frame (`UnindexedDamageError`). Readers leave the
  tail alone: a live writer may be committing there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from ..codec.record import decode_trace
from ..errors import ChecksumError, DuplicateKeyError, TraceError, TraceFormatError, Where
from .fileio import _read_at

SCAN_CHUNK = 4 << 20
"""Bytes read per step when searching damaged bytes for a later intact frame (bounded memory)."""


class UnindexedDamageError(TraceFormatError):
    """Damaged segment bytes lie before intact unindexed records: a writer would have to delete
    intact bytes to append, so it refuses to open."""


class Found(NamedTuple):
    """An intact frame no index entry names."""

    key: str
    segment: int
    offset: int
    length: int
    crc: int


@dataclass
class SalvagePlan:
    """What a writer does with the unindexed bytes it found (applied by DirectoryStore._recover)."""

    found: list[Found] = field(default_factory=list)
    """Intact records to index again, in file order."""
    truncate: dict[int, int] = field(default_factory=dict)
    """segment -> size: a torn tail (no intact frame follows) cut at its first bad byte."""
    remove: list[int] = field(default_factory=list)
    """Segments with no intact frame and a torn header (a crash while creating them)."""
    append_at: tuple[int, int] | None = None
    """(segment, offset) where the writer appends; None: start segment `new_segment`."""
    new_segment: int = 0


class _Layout(NamedTuple):
    """The framing constants, passed in by directory.py (one home for the format)."""

    header_size: int
    check_header: Callable[[bytes, Where], None]
    frame: object  # struct.Struct of the frame head: magic, length, crc
    frame_magic: bytes
    frame_crc: Callable[[bytes], int]


def _frame_at(fd: int, size: int, off: int, lay: _Layout) -> tuple[int, int, bytes] | None:
    """(length, crc, payload) of an intact frame at `off`, else None."""
    head = _read_at(fd, lay.frame.size, off)
    if len(head) < lay.frame.size:
        return None
    magic, length, crc = lay.frame.unpack(head)
    if magic != lay.frame_magic or length > size - off - lay.frame.size:
        return None
    payload = _read_at(fd, length, off + lay.frame.size)
    if len(payload) != length or lay.frame_crc(payload) != crc:
        return None
    return length, crc, payload


def _intact_frame_after(fd: int, size: int, start: int, lay: _Layout) -> int | None:
    """Offset of the first intact frame at or after `start`, searching in SCAN_CHUNK steps."""
    pos = start
    while pos < size:
        chunk = _read_at(fd, min(SCAN_CHUNK + len(lay.frame_magic), size - pos), pos)
        at = chunk.find(lay.frame_magic)
        while at != -1 and at < SCAN_CHUNK:
            if _frame_at(fd, size, pos + at, lay) is not None:
                return pos + at
            at = chunk.find(lay.frame_magic, at + 1)
        pos += SCAN_CHUNK
    return None


def plan_salvage(
    segment_path: Callable[[int], Path], segments: list[int], start: tuple[int, int], lay: _Layout,
    indexed: Callable[[str], bool],
) -> SalvagePlan:
    """Scan `segments` (ascending, all >= start's segment) from `start` = (segment, offset): the
    offset is the end of the last indexed frame, or the header size for a segment scanned whole.

    Raises UnindexedDamageError when damaged bytes come before an intact frame, and TraceError
    (DuplicateKeyError) when an intact unindexed frame holds a key the index already has."""
    plan = SalvagePlan(new_segment=start[0])
    last_good: tuple[int, int] | None = None
    for i, n in enumerate(segments):
        path = segment_path(n)
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            off = start[1] if n == start[0] else lay.header_size
            bad = None
            if off == lay.header_size:
                try:
                    lay.check_header(_read_at(fd, lay.header_size, 0), Where(file=str(path)))
                except TraceError:
                    bad = 0
            while bad is None and off < size:
                got = _frame_at(fd, size, off, lay)
                if got is None:
                    bad = off
                    break
                length, crc, payload = got
                where = Where(file=str(path), field=f"frame at offset {off}")
                key = decode_trace(payload, where).key
                if indexed(key) or any(f.key == key for f in plan.found):
                    raise DuplicateKeyError(
                        where.with_(record=key), "an unindexed record with a new key", "a key already in the store",
                        "the writer refuses to open; read the store with readonly=True",
                    )
                plan.found.append(Found(key, n, off, length, crc))
                off += lay.frame.size + length
            if bad is None:
                last_good = (n, off)
                continue
            later = _intact_frame_after(fd, size, max(bad, lay.header_size), lay)
            later_seg = None
        finally:
            os.close(fd)
        if later is None:
            later_seg = next((m for m in segments[i + 1 :] if _has_intact_frame(segment_path(m), lay)), None)
        if later is not None or later_seg is not None:
            where_ = (n, later) if later is not None else (later_seg, None)
            raise UnindexedDamageError(
                Where(file=str(path), field=f"bytes from offset {bad}"),
                "intact frames up to a torn tail", f"damaged bytes followed by an intact frame (segment {where_[0]}"
                + (f", offset {where_[1]})" if where_[1] is not None else ")"),
                "not a crash: the writer refuses to open rather than delete intact records; read the store "
                "with readonly=True and copy what it holds, or repair the segment by hand",
            )
        if bad < lay.header_size:  # a segment created but never written: nothing to keep
            plan.remove.extend(segments[i:])
        else:
            plan.truncate[n] = bad
            plan.remove.extend(segments[i + 1 :])
            last_good = (n, bad)
        break
    if last_good is not None:
        plan.append_at = last_good
    else:
        plan.new_segment = start[0]
    return plan


def _has_intact_frame(path: Path, lay: _Layout) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        return _intact_frame_after(fd, size, lay.header_size, lay) is not None
    finally:
        os.close(fd)


# -- holes: unnamed bytes between named frames -----------------------------------------------------
class Hole(NamedTuple):
    """Bytes [start, end) of segment `segment` that lie before a named frame but no entry names."""

    segment: int
    start: int
    end: int


class Coverage(NamedTuple):
    """What `find_holes` found between the named frames it was given."""

    holes: list[Hole]
    missing: list[int]
    """Segment files absent although a later segment holds named frames (and no entry names them)."""
    end: tuple[int, int]
    """(segment, offset) just past the last named frame: where the next check starts."""


def find_holes(
    named: list[tuple[int, int, int]], start: tuple[int, int], size_of: Callable[[int], int | None], header_size: int,
) -> Coverage:
    """Holes among `named` = (segment, offset, end) of named frames, sorted by position, checked
    from `start` (the end of coverage checked before). Reads no segment bytes: `size_of(n)` is the
    size of segment n's file (None: absent), asked only of segments left behind. Bytes after the
    last named frame are the tail (`plan_salvage`), not a hole."""
    holes: list[Hole] = []
    missing: list[int] = []
    seg, cur = start
    for n, off, end in named:
        if (n, end) <= (seg, cur):
            continue  # overlaps what is covered already (a second entry for one frame)
        while n > seg:
            size = size_of(seg)
            if size is None:
                if cur == header_size:  # a segment with named frames reports them when they are read
                    missing.append(seg)
            elif size > cur:
                holes.append(Hole(seg, cur, size))
            seg, cur = seg + 1, header_size
        if off > cur:
            holes.append(Hole(seg, cur, off))
        cur = max(cur, end)
    return Coverage(holes, missing, (seg, cur))


def scan_hole(fd: int, path: Path, hole: Hole, lay: _Layout) -> tuple[list[Found], list[tuple[int, TraceError]]]:
    """Read a hole frame by frame: (intact frames, in file order; (offset, error) per stretch of
    damaged bytes). A frame must end inside the hole, so named bytes are never read as part of one."""
    found: list[Found] = []
    damage: list[tuple[int, TraceError]] = []
    off = hole.start
    while off < hole.end:
        got = _frame_at(fd, hole.end, off, lay)
        if got is None:
            later = _intact_frame_after(fd, hole.end, off + 1, lay)
            stop = hole.end if later is None else later
            damage.append((off, _damage_error(fd, path, off, stop, lay)))
            off = stop
            continue
        length, crc, payload = got
        where = Where(file=str(path), field=f"frame at offset {off}")
        try:
            found.append(Found(decode_trace(payload, where).key, hole.segment, off, length, crc))
        except TraceError as err:  # checksummed but not a record this reader can decode
            damage.append((off, err))
        off += lay.frame.size + length
    return found, damage


def _damage_error(fd: int, path: Path, start: int, stop: int, lay: _Layout) -> TraceError:
    """The typed error for damaged bytes [start, stop) that no index entry names."""
    detail = (f"bytes {start}..{stop} lie between indexed records and no index entry names them: "
              "skipped, the record they held is lost")
    where = Where(file=str(path))
    head = _read_at(fd, lay.frame.size, start)
    if len(head) == lay.frame.size:
        magic, length, crc = lay.frame.unpack(head)
        if magic == lay.frame_magic and length <= stop - start - lay.frame.size:
            actual = lay.frame_crc(_read_at(fd, length, start + lay.frame.size))
            return ChecksumError(where.with_(field=f"frame.crc32 at offset {start}"), f"{crc:#010x}", f"{actual:#010x}", detail)
    return TraceFormatError(
        where.with_(field=f"frame at offset {start}"), "an intact frame (magic, length, crc32)",
        f"{stop - start} damaged bytes", detail,
    )
