"""Find the records a directory store's segments hold that its index does not name.

Each frame is framed and checksummed (directory.py), so an intact frame is a whole record whatever
became of its index entry. Two places hold such frames:

- Holes: bytes between named frames (or a whole segment before the last named one) that no entry
  names, because an entry was damaged. `find_holes` finds them from the entries alone (no segment
  bytes read); `scan_hole` reads a hole frame by frame: intact frames come back as `Found`, damaged
  bytes as typed errors (never as records). Readers and writers both do this.
- The tail: segment bytes after the last named frame (and any later segment files). A crash
  between the segment sync and the index sync of a commit, or a truncated, damaged or partly
  restored index.bin, leaves intact frames there. A writer opening the store reads them all
  (`survey_tail`), indexes them again, in file order, and cuts only bytes that are not part of an
  intact frame (`plan_salvage`). Those can only be a torn tail: damaged bytes followed by an intact
  frame are not a crash, and the writer refuses to open rather than delete the frame
  (`UnindexedDamageError`, whose advice, `RESCUE_ADVICE`, copies every intact record to a new
  store). Plain readers leave the tail alone: a live writer may be committing there; a reader
  opened with `survey=True` reads it as the next writer would, and changes nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from ..errors import ChecksumError, DuplicateKeyError, TraceError, TraceFormatError, Where
from .chunks import frame_key
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
    """What a writer does with the unindexed bytes it found (applied by recovery.recover)."""

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


class Damage(NamedTuple):
    """Bytes [start, stop) of segment `segment` that are no part of an intact frame, or (with
    `checksummed`) one frame whose checksum holds but whose record this reader cannot decode."""

    segment: int
    start: int
    stop: int
    error: TraceError
    checksummed: bool = False


@dataclass
class TailSurvey:
    """Everything past the last indexed frame, read frame by frame: every intact frame and every
    damaged stretch, in file order (what a writer would index, cut or refuse over; `plan_salvage`)."""

    start: tuple[int, int]
    """(segment, offset) where the tail starts: the end of the last indexed frame."""
    header_size: int
    segments: list[int] = field(default_factory=list)
    paths: dict[int, Path] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)
    """segment -> file size in bytes."""
    found: list[Found] = field(default_factory=list)
    damage: list[Damage] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        """Segment bytes of the tail, file headers excluded."""
        return sum(max(0, size - (self.start[1] if n == self.start[0] else self.header_size))
                   for n, size in self.sizes.items())

    def found_after(self, pos: tuple[int, int]) -> list[Found]:
        return [f for f in self.found if (f.segment, f.offset) > pos]


TAIL_DAMAGE = ("bytes past the last indexed record that are no part of an intact frame: a torn write "
               "when no intact frame follows them (a writer cuts them), damage otherwise")
HOLE_DAMAGE = ("bytes {start}..{stop} lie between indexed records and no index entry names them: "
               "skipped, the record they held is lost")
RESCUE_ADVICE = ("copy every intact record to a new store with moe_replay.store.rescue_store(src, dst) "
                 "(command line: moe-replay rescue STORE NEW_STORE)")
"""What a refusal advises: the copy keeps every intact record, indexed or not (store/rescue.py)."""


def survey_tail(segment_path: Callable[[int], Path], segments: list[int], start: tuple[int, int], lay: _Layout) -> TailSurvey:
    """Read `segments` (ascending, all >= start's segment) from `start` = (segment, offset): the
    offset is the end of the last indexed frame, or the header size for a segment read whole.
    Reads only, and goes on past damage, so nothing beyond it goes unseen."""
    survey = TailSurvey(start, lay.header_size)
    for n in segments:
        path = segment_path(n)
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            survey.segments.append(n)
            survey.paths[n], survey.sizes[n] = path, size
            off = start[1] if n == start[0] else lay.header_size
            if off == lay.header_size:
                try:
                    lay.check_header(_read_at(fd, lay.header_size, 0), Where(file=str(path)))
                except TraceError as err:
                    later = _intact_frame_after(fd, size, lay.header_size, lay)
                    off = size if later is None else later
                    survey.damage.append(Damage(n, 0, off, err))
            while off < size:
                got = _frame_at(fd, size, off, lay)
                if got is None:
                    later = _intact_frame_after(fd, size, off + 1, lay)
                    stop = size if later is None else later
                    survey.damage.append(Damage(n, off, stop, _damage_error(fd, path, off, stop, lay, TAIL_DAMAGE)))
                    off = stop
                    continue
                length, crc, payload = got
                end = off + lay.frame.size + length
                try:
                    key = frame_key(payload, Where(file=str(path), field=f"frame at offset {off}"))
                except TraceError as err:  # checksummed but not a record this reader can decode
                    survey.damage.append(Damage(n, off, end, err, checksummed=True))
                else:
                    survey.found.append(Found(key, n, off, length, crc))
                off = end
        finally:
            os.close(fd)
    return survey


def plan_salvage(survey: TailSurvey, indexed: Callable[[str], bool]) -> SalvagePlan:
    """What a writer does with the tail `survey` found: index its intact frames again, cut a torn
    tail (damaged bytes no intact frame follows), remove segments created but never written.

    Raises UnindexedDamageError when cutting would delete a checksummed byte (damaged bytes
    followed by an intact frame, or a checksummed frame this reader cannot decode), and
    DuplicateKeyError when an intact unindexed frame holds a key the index already has."""
    first = survey.damage[0] if survey.damage else None
    if first is not None:
        after = survey.found_after((first.segment, first.start))
        kept = next((d for d in survey.damage if d.checksummed), None)
        if after or kept is not None:
            if after:
                found = (f"damaged bytes followed by {len(after)} intact frame(s) (the first: segment {after[0].segment}, "
                         f"offset {after[0].offset})")
            else:
                found = f"a checksummed frame this reader cannot decode ({kept.error})"
            raise UnindexedDamageError(
                first.error.where.with_(field=f"bytes from offset {first.start}"), "intact frames up to a torn tail",
                found, "not a crash: the writer refuses to open rather than delete intact records; " + RESCUE_ADVICE,
            )
    seen: set[str] = set()
    for f in survey.found:
        if indexed(f.key) or f.key in seen:
            raise DuplicateKeyError(
                Where(file=str(survey.paths[f.segment]), record=f.key, field=f"frame at offset {f.offset}"),
                "an unindexed record with a new key", "a key already in the store",
                "the writer refuses to open rather than choose between two intact records; " + RESCUE_ADVICE,
            )
        seen.add(f.key)
    plan = SalvagePlan(found=list(survey.found), new_segment=survey.start[0])
    if first is None:
        if survey.segments:
            last = survey.segments[-1]
            plan.append_at = (last, survey.sizes[last])
        return plan
    i = survey.segments.index(first.segment)
    if first.start < survey.header_size:  # a segment created but never written: nothing to keep
        plan.remove = survey.segments[i:]
        if i:
            plan.append_at = (survey.segments[i - 1], survey.sizes[survey.segments[i - 1]])
    else:
        plan.truncate[first.segment] = first.start
        plan.remove = survey.segments[i + 1 :]
        plan.append_at = (first.segment, first.start)
    return plan


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
            damage.append((off, _damage_error(fd, path, off, stop, lay, HOLE_DAMAGE.format(start=off, stop=stop))))
            off = stop
            continue
        length, crc, payload = got
        where = Where(file=str(path), field=f"frame at offset {off}")
        try:
            found.append(Found(frame_key(payload, where), hole.segment, off, length, crc))
        except TraceError as err:  # checksummed but not a record this reader can decode
            damage.append((off, err))
        off += lay.frame.size + length
    return found, damage


def _damage_error(fd: int, path: Path, start: int, stop: int, lay: _Layout, detail: str) -> TraceError:
    """The typed error for damaged bytes [start, stop) that no index entry names."""
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
