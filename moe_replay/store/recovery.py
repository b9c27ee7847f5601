"""Crash recovery of the directory store: what an open finds that the index does not say.

Damaged index entries (a bad entry followed by good ones) are never trusted, and lose no record:
every open checks, from the entries alone, that the named frames tile the segments up to the last
one; bytes they leave uncovered (holes) are read frame by frame, and each intact frame there is a
record again (reader and writer alike; readers keep it in memory). A writer that recovered records
or saw damaged entries replaces index.bin by a clean one (written to a temporary file, synced, then
renamed), so the next open finds no holes and reads no segment bytes. Readers open before that
switch to the new index on refresh(). Damaged bytes in a hole, and a record whose bytes fail their
CRC, are typed errors naming the file, key (where known) and field, raised only at their place.

At open a writer also cuts a torn index tail and scans the segment bytes past the last indexed
record (salvage.py): intact frames are indexed again, only bytes that are no part of an intact
frame are cut, and damaged bytes followed by an intact frame make it refuse to open
(UnindexedDamageError). A survey reader (readonly, survey=True) runs the same steps in memory only.

Plain functions: `fill_holes(store, new)` and `recover(store, index_size)` take the store they
repair (any object with the state and file methods `RecoveringStore` names; DirectoryStore calls
them), their helpers take only the pieces of state they read and update. The index itself is
written through the store (_append_index, _rewrite_index): directory.py holds the file I/O names
tests patch.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Container, Protocol

from ..errors import DuplicateKeyError, TraceError, TruncatedRecordError, Where
from .chunks import is_chunk_key
from .fileio import _sync, _sync_dir
from .framing import FRAME, FRAME_MAGIC, HEADER, SEGMENT_MAGIC, _SEGMENT_RE, Entry, check_header, frame_crc, pack_entry, segment_name
from .options import DirectoryStoreOptions
from .salvage import Found, TailSurvey, UnindexedDamageError, _Layout, find_holes, plan_salvage, scan_hole, survey_tail

log = logging.getLogger("moe_replay.store.directory")
"""The store's logger: recovery warnings read as the store's own."""

_LAYOUT = _Layout(HEADER.size, lambda data, where: check_header(data, SEGMENT_MAGIC, where), FRAME, FRAME_MAGIC,
                  lambda payload: frame_crc(payload))

Damage = list[tuple[tuple[int, int], TraceError]]
"""((segment, offset), error) of each damaged stretch, placed in file order."""


class RecoveringStore(Protocol):
    """What recovery reads and updates of a store: its view (`_entries`, `_problems`, `_damaged`,
    `_index_*`, `recovery`) and its file methods (`segment_path`, `_segment_fd`, `_new_segment`,
    `_append_index`, `_rewrite_index`)."""

    path: Path
    readonly: bool
    options: DirectoryStoreOptions
    recovery: dict[str, object]
    _entries: dict[str, Entry]
    _problems: list[tuple[int, TraceError]]
    _damaged: dict[str, TraceError]
    _index_stale: bool
    _covered: tuple[int, int]
    _index_end: int
    _index_fd: int | None
    _fds: dict[int, int]
    _seg: int
    _seg_size: int

    def segment_path(self, n: int) -> Path: ...
    def _segment_fd(self, n: int, key: str | None = None) -> int: ...
    def _new_segment(self, n: int) -> None: ...
    def _append_index(self, data: bytes) -> None: ...
    def _rewrite_index(self) -> None: ...


# -- holes: intact frames no index entry names ----------------------------------------------------
def fill_holes(store: RecoveringStore, new: list[Entry]) -> int:
    """Check that the frames of `new` entries (and those before) tile their segments; read the
    bytes they leave uncovered and add each intact frame there as a record. Return how many.

    The check reads no segment bytes: a sort and a walk over the entries (0.5 s per million
    entries on a 2-core CPU, a quarter of the 2 s that parsing those entries takes) plus one
    stat per segment file passed. Scanning every frame instead would read and CRC the whole
    store on every open (zlib.crc32 alone: 0.25 s per GiB at ~4 GB/s, before the disk reads
    and one decode per record to learn its key); so only uncovered bytes are read."""
    named = sorted((e.segment, e.offset, e.offset + FRAME.size + e.length) for e in new)
    coverage = find_holes(named, store._covered, lambda n: segment_size(store.segment_path(n)), HEADER.size)
    store._covered = coverage.end
    if not coverage.holes and not coverage.missing:
        return 0
    found: list[Found] = []
    damage: Damage = []
    for n in coverage.missing:
        where = Where(file=str(store.segment_path(n)), field="segment")
        damage.append(((n, 0), TruncatedRecordError(where, "the segment file (later segments hold records)", "no such file")))
    for hole in coverage.holes:
        try:
            fd = store._segment_fd(hole.segment)
        except TraceError as err:  # a damaged segment header: its records cannot be read
            damage.append(((hole.segment, 0), err))
            continue
        got, bad = scan_hole(fd, store.segment_path(hole.segment), hole, _LAYOUT)
        found += got
        damage += [((hole.segment, off), err) for off, err in bad]
    recovered = keep_new_keys(found, store._entries, store.recovery)
    store._entries, store._problems = insert_in_file_order(store._entries, store._problems, store._damaged, recovered, damage)
    if recovered:
        store._index_stale = True
        keys = store.recovery.setdefault("records_recovered", [])
        keys += [f.key for f in recovered]  # type: ignore[operator]
        log.warning("store %s: %d records no index entry named were recovered from their frames", store.path, len(recovered))
    return len(recovered)


def keep_new_keys(found: list[Found], indexed: Container[str], recovery: dict[str, object]) -> list[Found]:
    """Frames whose key an index entry names are earlier copies the writer wrote again after
    losing their entry (the entry wins); of two unnamed frames with one key the later wins."""
    latest = {f.key: f for f in found if f.key not in indexed}
    superseded = [f.key for f in found if latest.get(f.key) is not f]
    if superseded:
        recovery["frames_superseded"] = superseded
    return [f for f in found if latest.get(f.key) is f]


def insert_in_file_order(entries: dict[str, Entry], problems: list[tuple[int, TraceError]], damaged: dict[str, TraceError],
                         found: list[Found], damage: Damage) -> tuple[dict[str, Entry], list[tuple[int, TraceError]]]:
    """(entries, problems) with recovered records and damaged stretches placed before the first
    indexed record that follows them in the files (index order is file order: appends only);
    a recovered key leaves `damaged`."""
    events = sorted([((f.segment, f.offset), 0, f) for f in found] + [(pos, 1, err) for pos, err in damage],
                    key=lambda ev: (ev[0], ev[1]))
    problems = sorted(problems, key=lambda p: p[0])
    out: dict[str, Entry] = {}
    new_problems: list[tuple[int, TraceError]] = []
    e = p = 0
    for i, (key, entry) in enumerate([*entries.items(), (None, None)]):
        while p < len(problems) and problems[p][0] <= i:
            new_problems.append((len(out), problems[p][1]))
            p += 1
        while e < len(events) and (entry is None or events[e][0] < (entry.segment, entry.offset)):
            _, kind, item = events[e]
            if kind == 0:
                out[item.key] = Entry(item.segment, item.offset, item.length, item.crc)
                damaged.pop(item.key, None)
            else:
                new_problems.append((len(out), item))
            e += 1
        if key is not None:
            out[key] = entry
    return out, new_problems


def segment_size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


# -- the tail: what a writer finds past the index at open --------------------------------------
def recover(store: RecoveringStore, index_size: int) -> None:
    """Writer: cut the torn index tail, index again the intact frames of the tail
    (salvage.py), rewrite the index if it has damaged entries or missed records in holes
    (fill_holes found them already), cut bytes that are no part of an intact frame, then pick
    the segment to append to. Bytes that pass their checksum are never removed.
    A survey reader (readonly, survey=True) runs the same steps and writes nothing."""
    dry, recovery = store.readonly, store.recovery
    if index_size > store._index_end and "index_header_damaged" not in recovery:
        recovery["index_bytes_truncated"] = index_size - store._index_end
        if not dry:
            os.ftruncate(store._index_fd, store._index_end)
    if not dry:
        os.lseek(store._index_fd, store._index_end, os.SEEK_SET)
    last = max(store._entries.values(), default=None, key=lambda e: (e.segment, e.offset))
    seg, end = (last.segment, last.offset + FRAME.size + last.length) if last else (0, HEADER.size)
    tmp = [p for p in sorted(store.path.iterdir()) if p.name.endswith(".tmp")]
    if not dry:
        for p in tmp:
            p.unlink()
    damaged = damaged_last_segment(store.segment_path, store._segment_fd, seg, end) if last is not None else None
    if damaged is not None:  # indexed bytes missing or damaged (possible only without
        # durable=True): never write over what the index still points at
        recovery["damaged_segment"] = damaged
        seg, end = seg + 1, HEADER.size
    existing = sorted(int(m.group(1)) for p in store.path.iterdir() if (m := _SEGMENT_RE.match(p.name)))
    survey = survey_tail(store.segment_path, [n for n in existing if n >= seg], (seg, end), _LAYOUT)
    if dry:
        note_unindexed(recovery, store._entries, [store.segment_path(n) for n in existing], survey)
    try:
        plan = plan_salvage(survey, store._entries.__contains__)
    except (UnindexedDamageError, DuplicateKeyError) as err:
        if not dry:
            raise
        recovery["refused"] = err
        store._entries, store._problems = show_tail(store._entries, store._problems, store._damaged, recovery, survey)
        return
    if plan.found or store._index_stale:
        reindex(store, plan.found, dry)
    for n, at in plan.truncate.items():
        recovery["segment_bytes_truncated"] = recovery.get("segment_bytes_truncated", 0) + (  # type: ignore[operator]
            survey.sizes[n] - at)
        if not dry:
            os.truncate(store.segment_path(n), at)
    if not dry:
        for n in plan.remove:
            if n in store._fds:
                os.close(store._fds.pop(n))
            store.segment_path(n).unlink()
    removed = [p.name for p in tmp] + [segment_name(n) for n in plan.remove]
    if removed:
        recovery["files_removed"] = removed
    if dry:
        return
    if plan.append_at is None:
        store._new_segment(plan.new_segment)
    else:
        store._seg, store._seg_size = plan.append_at
        os.lseek(store._segment_fd(store._seg), store._seg_size, os.SEEK_SET)
    if store.options.durable and recovery:
        _sync(store._index_fd)
        _sync(store._fds[store._seg])
        _sync_dir(store.path)
    if recovery:
        log.warning("store %s: recovered after an interrupted write: %s", store.path, recovery)


def note_unindexed(recovery: dict[str, object], entries: dict[str, Entry], segments: list[Path], survey: TailSurvey) -> None:
    """Survey reader: the bytes and the intact records no index entry names (holes and tail), of
    the store's `segments` files."""
    holes = set(recovery.get("records_recovered", []))  # type: ignore[arg-type]
    indexed = sum(FRAME.size + e.length for k, e in entries.items() if k not in holes)
    sizes = (segment_size(path) for path in segments)
    recovery["unindexed_bytes"] = max(0, sum(max(0, (s or 0) - HEADER.size) for s in sizes) - indexed)
    unindexed = [*holes, *(f.key for f in survey.found if f.key not in entries)]
    recovery["records_unindexed"] = [k for k in unindexed if not is_chunk_key(k)]
    chunks = [k for k in unindexed if is_chunk_key(k)]
    if chunks:
        recovery["chunks_unindexed"] = chunks


def show_tail(entries: dict[str, Entry], problems: list[tuple[int, TraceError]], damaged: dict[str, TraceError],
              recovery: dict[str, object], survey: TailSurvey) -> tuple[dict[str, Entry], list[tuple[int, TraceError]]]:
    """Survey reader of a store a writer would refuse: (entries, problems) with every intact tail
    record visible (the first frame of a key wins, as the index's entry does) and the damaged
    stretches as problems."""
    found, seen, duplicated = [], set(entries), []
    for f in survey.found:
        if f.key not in seen:
            seen.add(f.key)
            found.append(f)
        else:
            where = Where(file=str(survey.paths[f.segment]), record=f.key, field=f"frame at offset {f.offset}")
            duplicated.append(DuplicateKeyError(where, "an unindexed record with a new key", "a key an earlier record holds"))
    if duplicated:
        recovery["frames_duplicated"] = duplicated
    return insert_in_file_order(entries, problems, damaged, found, [((d.segment, d.start), d.error) for d in survey.damage])


def damaged_last_segment(segment_path: Callable[[int], Path], segment_fd: Callable[[int], int], seg: int, end: int) -> str | None:
    """Why the segment of the last indexed record cannot be appended to, or None."""
    size = segment_size(segment_path(seg))
    if size is None or size < end:
        return f"{segment_name(seg)} is shorter than its index says ({-1 if size is None else size} < {end} bytes)"
    try:
        segment_fd(seg)
    except TraceError as err:
        return str(err)
    return None


def reindex(store: RecoveringStore, found: list[Found], dry: bool = False) -> None:
    """Name the recovered records in the index (their segments synced first): append entries
    for tail records; rewrite the whole index when it has damaged entries or missed records
    in holes. `dry`: in memory only (a survey reader)."""
    entries = {f.key: Entry(f.segment, f.offset, f.length, f.crc) for f in found}
    store._entries.update(entries)
    if found:
        keys = store.recovery.setdefault("records_recovered", [])
        keys += list(entries)  # type: ignore[operator]
    if dry:
        if store._index_stale:
            store.recovery["index_rewritten"] = len(store._entries)
        return
    if store.options.durable:
        recovered = set(store.recovery.get("records_recovered", []))  # type: ignore[arg-type]
        for n in sorted({e.segment for k, e in store._entries.items() if k in recovered}):
            _sync(store._segment_fd(n))
    if store._index_stale:
        store._rewrite_index()
        store.recovery["index_rewritten"] = len(store._entries)
        return
    store._append_index(b"".join(pack_entry(key.encode("utf-8"), e) for key, e in entries.items()))
