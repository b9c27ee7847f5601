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

The index itself is written through DirectoryStore (_append_index, _rewrite_index): directory.py
holds the file I/O names tests patch.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import DuplicateKeyError, TraceError, TruncatedRecordError, Where
from .chunks import is_chunk_key
from .fileio import _sync, _sync_dir
from .framing import FRAME, FRAME_MAGIC, HEADER, SEGMENT_MAGIC, _SEGMENT_RE, Entry, check_header, frame_crc, pack_entry, segment_name
from .salvage import Found, TailSurvey, UnindexedDamageError, _Layout, find_holes, plan_salvage, scan_hole, survey_tail

if TYPE_CHECKING:
    from .directory import DirectoryStoreOptions

log = logging.getLogger("moe_replay.store.directory")
"""The store's logger: recovery warnings read as the store's own."""

_LAYOUT = _Layout(HEADER.size, lambda data, where: check_header(data, SEGMENT_MAGIC, where), FRAME, FRAME_MAGIC,
                  lambda payload: frame_crc(payload))


class RecoveryMixin:
    """DirectoryStore's recovery steps: holes the index entries leave (every open and refresh) and
    the tail past the index (a writer's open, or a survey reader's). They read and update the
    store's view (`_entries`, `_problems`, `_damaged`, `_index_*`, `recovery`) and call its file
    methods (`segment_path`, `_segment_fd`, `_new_segment`, `_append_index`, `_rewrite_index`)."""

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

    # -- holes: intact frames no index entry names ----------------------------------------------------
    def _fill_holes(self, new: list[Entry]) -> int:
        """Check that the frames of `new` entries (and those before) tile their segments; read the
        bytes they leave uncovered and add each intact frame there as a record. Return how many.

        The check reads no segment bytes: a sort and a walk over the entries (0.5 s per million
        entries on a 2-core CPU, a quarter of the 2 s that parsing those entries takes) plus one
        stat per segment file passed. Scanning every frame instead would read and CRC the whole
        store on every open (zlib.crc32 alone: 0.25 s per GiB at ~4 GB/s, before the disk reads
        and one decode per record to learn its key); so only uncovered bytes are read."""
        named = sorted((e.segment, e.offset, e.offset + FRAME.size + e.length) for e in new)
        coverage = find_holes(named, self._covered, self._segment_size, HEADER.size)
        self._covered = coverage.end
        if not coverage.holes and not coverage.missing:
            return 0
        found: list[Found] = []
        damage: list[tuple[tuple[int, int], TraceError]] = []
        for n in coverage.missing:
            where = Where(file=str(self.segment_path(n)), field="segment")
            damage.append(((n, 0), TruncatedRecordError(where, "the segment file (later segments hold records)", "no such file")))
        for hole in coverage.holes:
            try:
                fd = self._segment_fd(hole.segment)
            except TraceError as err:  # a damaged segment header: its records cannot be read
                damage.append(((hole.segment, 0), err))
                continue
            got, bad = scan_hole(fd, self.segment_path(hole.segment), hole, _LAYOUT)
            found += got
            damage += [((hole.segment, off), err) for off, err in bad]
        recovered = self._keep_new_keys(found)
        self._insert_in_file_order(recovered, damage)
        if recovered:
            self._index_stale = True
            keys = self.recovery.setdefault("records_recovered", [])
            keys += [f.key for f in recovered]  # type: ignore[operator]
            log.warning("store %s: %d records no index entry named were recovered from their frames", self.path, len(recovered))
        return len(recovered)

    def _keep_new_keys(self, found: list[Found]) -> list[Found]:
        """Frames whose key an index entry names are earlier copies the writer wrote again after
        losing their entry (the entry wins); of two unnamed frames with one key the later wins."""
        latest = {f.key: f for f in found if f.key not in self._entries}
        superseded = [f.key for f in found if latest.get(f.key) is not f]
        if superseded:
            self.recovery["frames_superseded"] = superseded
        return [f for f in found if latest.get(f.key) is f]

    def _insert_in_file_order(self, found: list[Found], damage: list[tuple[tuple[int, int], TraceError]]) -> None:
        """Place recovered records and damaged stretches before the first indexed record that
        follows them in the files (index order is file order: appends only)."""
        events = sorted([((f.segment, f.offset), 0, f) for f in found] + [(pos, 1, err) for pos, err in damage],
                        key=lambda ev: (ev[0], ev[1]))
        problems = sorted(self._problems, key=lambda p: p[0])
        entries: dict[str, Entry] = {}
        new_problems: list[tuple[int, TraceError]] = []
        e = p = 0
        for i, (key, entry) in enumerate([*self._entries.items(), (None, None)]):
            while p < len(problems) and problems[p][0] <= i:
                new_problems.append((len(entries), problems[p][1]))
                p += 1
            while e < len(events) and (entry is None or events[e][0] < (entry.segment, entry.offset)):
                _, kind, item = events[e]
                if kind == 0:
                    entries[item.key] = Entry(item.segment, item.offset, item.length, item.crc)
                    self._damaged.pop(item.key, None)
                else:
                    new_problems.append((len(entries), item))
                e += 1
            if key is not None:
                entries[key] = entry
        self._entries, self._problems = entries, new_problems

    def _segment_size(self, n: int) -> int | None:
        try:
            return self.segment_path(n).stat().st_size
        except FileNotFoundError:
            return None

    # -- the tail: what a writer finds past the index at open --------------------------------------
    def _recover(self, index_size: int) -> None:
        """Writer: cut the torn index tail, index again the intact frames of the tail
        (salvage.py), rewrite the index if it has damaged entries or missed records in holes
        (_fill_holes found them already), cut bytes that are no part of an intact frame, then pick
        the segment to append to. Bytes that pass their checksum are never removed.
        A survey reader (readonly, survey=True) runs the same steps and writes nothing."""
        dry = self.readonly
        if index_size > self._index_end and "index_header_damaged" not in self.recovery:
            self.recovery["index_bytes_truncated"] = index_size - self._index_end
            if not dry:
                os.ftruncate(self._index_fd, self._index_end)
        if not dry:
            os.lseek(self._index_fd, self._index_end, os.SEEK_SET)
        last = max(self._entries.values(), default=None, key=lambda e: (e.segment, e.offset))
        seg, end = (last.segment, last.offset + FRAME.size + last.length) if last else (0, HEADER.size)
        tmp = [p for p in sorted(self.path.iterdir()) if p.name.endswith(".tmp")]
        if not dry:
            for p in tmp:
                p.unlink()
        damaged = self._damaged_last_segment(seg, end) if last is not None else None
        if damaged is not None:  # indexed bytes missing or damaged (possible only without
            # durable=True): never write over what the index still points at
            self.recovery["damaged_segment"] = damaged
            seg, end = seg + 1, HEADER.size
        existing = sorted(int(m.group(1)) for p in self.path.iterdir() if (m := _SEGMENT_RE.match(p.name)))
        survey = survey_tail(self.segment_path, [n for n in existing if n >= seg], (seg, end), _LAYOUT)
        if dry:
            self._note_unindexed(existing, survey)
        try:
            plan = plan_salvage(survey, self._entries.__contains__)
        except (UnindexedDamageError, DuplicateKeyError) as err:
            if not dry:
                raise
            self.recovery["refused"] = err
            self._show_tail(survey)
            return
        if plan.found or self._index_stale:
            self._reindex(plan.found, dry)
        for n, at in plan.truncate.items():
            self.recovery["segment_bytes_truncated"] = self.recovery.get("segment_bytes_truncated", 0) + (
                survey.sizes[n] - at)
            if not dry:
                os.truncate(self.segment_path(n), at)
        if not dry:
            for n in plan.remove:
                if n in self._fds:
                    os.close(self._fds.pop(n))
                self.segment_path(n).unlink()
        removed = [p.name for p in tmp] + [segment_name(n) for n in plan.remove]
        if removed:
            self.recovery["files_removed"] = removed
        if dry:
            return
        if plan.append_at is None:
            self._new_segment(plan.new_segment)
        else:
            self._seg, self._seg_size = plan.append_at
            os.lseek(self._segment_fd(self._seg), self._seg_size, os.SEEK_SET)
        if self.options.durable and self.recovery:
            _sync(self._index_fd)
            _sync(self._fds[self._seg])
            _sync_dir(self.path)
        if self.recovery:
            log.warning("store %s: recovered after an interrupted write: %s", self.path, self.recovery)

    def _note_unindexed(self, existing: list[int], survey: TailSurvey) -> None:
        """Survey reader: the bytes and the intact records no index entry names (holes and tail)."""
        holes = set(self.recovery.get("records_recovered", []))  # type: ignore[arg-type]
        indexed = sum(FRAME.size + e.length for k, e in self._entries.items() if k not in holes)
        sizes = (self._segment_size(n) for n in existing)
        self.recovery["unindexed_bytes"] = max(0, sum(max(0, (s or 0) - HEADER.size) for s in sizes) - indexed)
        unindexed = [*holes, *(f.key for f in survey.found if f.key not in self._entries)]
        self.recovery["records_unindexed"] = [k for k in unindexed if not is_chunk_key(k)]
        chunks = [k for k in unindexed if is_chunk_key(k)]
        if chunks:
            self.recovery["chunks_unindexed"] = chunks

    def _show_tail(self, survey: TailSurvey) -> None:
        """Survey reader of a store a writer would refuse: every intact tail record is visible (the
        first frame of a key wins, as the index's entry does), damaged stretches are problems."""
        found, seen, duplicated = [], set(self._entries), []
        for f in survey.found:
            if f.key not in seen:
                seen.add(f.key)
                found.append(f)
            else:
                where = Where(file=str(survey.paths[f.segment]), record=f.key, field=f"frame at offset {f.offset}")
                duplicated.append(DuplicateKeyError(where, "an unindexed record with a new key", "a key an earlier record holds"))
        if duplicated:
            self.recovery["frames_duplicated"] = duplicated
        self._insert_in_file_order(found, [((d.segment, d.start), d.error) for d in survey.damage])

    def _damaged_last_segment(self, seg: int, end: int) -> str | None:
        """Why the segment of the last indexed record cannot be appended to, or None."""
        size = self._segment_size(seg)
        if size is None or size < end:
            return f"{segment_name(seg)} is shorter than its index says ({-1 if size is None else size} < {end} bytes)"
        try:
            self._segment_fd(seg)
        except TraceError as err:
            return str(err)
        return None

    def _reindex(self, found: list[Found], dry: bool = False) -> None:
        """Name the recovered records in the index (their segments synced first): append entries
        for tail records; rewrite the whole index when it has damaged entries or missed records
        in holes. `dry`: in memory only (a survey reader)."""
        entries = {f.key: Entry(f.segment, f.offset, f.length, f.crc) for f in found}
        self._entries.update(entries)
        if found:
            keys = self.recovery.setdefault("records_recovered", [])
            keys += list(entries)  # type: ignore[operator]
        if dry:
            if self._index_stale:
                self.recovery["index_rewritten"] = len(self._entries)
            return
        if self.options.durable:
            recovered = set(self.recovery.get("records_recovered", []))  # type: ignore[arg-type]
            for n in sorted({e.segment for k, e in self._entries.items() if k in recovered}):
                _sync(self._segment_fd(n))
        if self._index_stale:
            self._rewrite_index()
            self.recovery["index_rewritten"] = len(self._entries)
            return
        self._append_index(b"".join(pack_entry(key.encode("utf-8"), e) for key, e in entries.items()))
