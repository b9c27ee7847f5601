"""Directory store recovery: truncated indexes and torn segment tails, cut at every offset.

A crash between a record's segment sync and its index sync, or an index truncated or restored from
an older copy, leaves intact frames the index does not name: a writer indexes them again and cuts
only bytes that belong to no intact frame; damage before an intact record makes it refuse to open.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from moe_replay.errors import MissingKeyError, TruncatedRecordError
from moe_replay.store import DirectoryStore, UnindexedDamageError
from moe_replay.store import directory as dirmod

from .test_store import _four_records, flip, same, trace_for


def _cut(src: Path, dst: Path, index_at: int | None, segment_at: int | None) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    for name, at in ((dirmod.INDEX_NAME, index_at), (dirmod.segment_name(0), segment_at)):
        if at is not None:
            os.truncate(dst / name, at)
    return dst


def _visible_then_repaired(work: Path, n_visible: int, sizes: list[tuple[int, int]], n_intact: int | None = None) -> None:
    """Readers see the first n_visible records; a writer then indexes again the records whose
    frames are intact (the first n_intact), cuts the rest, and appends normally."""
    n_intact = n_visible if n_intact is None else n_intact
    with DirectoryStore(work, readonly=True) as r:
        assert same(list(r), [trace_for(i) for i in range(n_visible)])
        assert r.scan()[1] == []  # a torn tail is not damage: it is invisible
        with pytest.raises(MissingKeyError):
            r.get(f"r{n_visible:07d}")
    with DirectoryStore(work, durable=False) as w:  # the writer recovers intact frames, cuts torn bytes ...
        assert w.recovery.get("records_recovered", []) == [f"r{i:07d}" for i in range(n_visible, n_intact)]
        index_end, segment_end = sizes[n_intact - 1] if n_intact else (dirmod.HEADER.size,) * 2
        assert (work / dirmod.INDEX_NAME).stat().st_size == index_end
        assert (work / dirmod.segment_name(0)).stat().st_size == segment_end
        w.put(trace_for(n_intact))  # ... and appends normally, even the key that was torn
    with DirectoryStore(work, readonly=True) as r:
        assert same(list(r), [trace_for(i) for i in range(n_intact + 1)]) and r.scan()[1] == []


def test_truncated_index_is_recovered_from_intact_frames(tmp_path):
    """An index cut at any byte (its header excepted) loses entries, never records: the frames
    are intact, so the writer indexes them again, in order."""
    src, sizes = _four_records(tmp_path)
    for cut in range(dirmod.HEADER.size, sizes[3][0]):  # every byte of every entry
        n_visible = sum(index_end <= cut for index_end, _ in sizes)
        _visible_then_repaired(_cut(src, tmp_path / "work", cut, None), n_visible, sizes, n_intact=4)


def test_index_cut_inside_its_header_is_refused_and_nothing_is_deleted(tmp_path):
    src, sizes = _four_records(tmp_path)
    for cut in range(dirmod.HEADER.size):
        work = _cut(src, tmp_path / "work", cut, None)
        with pytest.raises(TruncatedRecordError) as e:
            DirectoryStore(work)
        assert e.value.where.file == str(work / dirmod.INDEX_NAME)
        assert (work / dirmod.segment_name(0)).stat().st_size == sizes[3][1]


def test_torn_segment_tail_is_invisible_then_truncated(tmp_path):
    src, sizes = _four_records(tmp_path)
    rng = np.random.default_rng(0)
    start, end = sizes[1][1], sizes[3][1]  # frames of r2 and r3, whose index entries are torn
    cuts = sorted(set(range(start, start + 40)) | set(range(start, end, 97)) | set(range(end - 20, end + 1)))
    for cut in cuts:
        index_cut = int(rng.integers(sizes[1][0], sizes[2][0]))  # crash-consistent: r2's entry torn too
        n_intact = sum(segment_end <= cut for _, segment_end in sizes)  # r2 (and r3) whole: recovered
        _visible_then_repaired(_cut(src, tmp_path / "work", index_cut, cut), 2, sizes, n_intact)
    _visible_then_repaired(_cut(src, tmp_path / "work", dirmod.HEADER.size + 3, dirmod.HEADER.size + 5), 0, sizes)


def test_damage_before_an_intact_unindexed_record_refuses_the_writer(tmp_path):
    """Not a crash: r2's frame is damaged and r3's, after it, intact, both unindexed. Cutting at r2
    would delete r3, so the writer refuses; readers still see r0, r1; no byte is removed."""
    src, sizes = _four_records(tmp_path)
    work = _cut(src, tmp_path / "work", sizes[1][0], None)
    flip(work / dirmod.segment_name(0), sizes[1][1] + 30)
    before = (work / dirmod.segment_name(0)).read_bytes()
    with pytest.raises(UnindexedDamageError, match=r"offset %d.*intact frame.*readonly=True" % sizes[1][1]) as e:
        DirectoryStore(work)
    assert e.value.where.file == str(work / dirmod.segment_name(0))
    assert (work / dirmod.segment_name(0)).read_bytes() == before
    assert (work / dirmod.INDEX_NAME).stat().st_size == sizes[1][0]
    with DirectoryStore(work, readonly=True) as r:
        assert same(list(r), [trace_for(0), trace_for(1)])


def test_unindexed_frames_in_later_segments_are_recovered(tmp_path):
    """The index lost every entry of a store that spans several segments: all records come back."""
    d = tmp_path / "s"
    with DirectoryStore(d, durable=False, segment_bytes=4096) as s:
        s.put_many([trace_for(i) for i in range(12)])
        n_segments = s._seg + 1
    assert n_segments >= 3
    os.truncate(d / dirmod.INDEX_NAME, dirmod.HEADER.size)
    with DirectoryStore(d, durable=False, segment_bytes=4096) as w:
        assert len(w.recovery["records_recovered"]) == 12 and "files_removed" not in w.recovery
        w.put(trace_for(12))
    with DirectoryStore(d, readonly=True) as r:
        assert same(list(r), [trace_for(i) for i in range(13)]) and r.scan()[1] == []


def test_indexed_record_with_missing_bytes_is_reported_not_overwritten(tmp_path):
    """Index intact but the segment cut inside r3 (only possible without durable=True and an OS crash)."""
    src, sizes = _four_records(tmp_path)
    work = _cut(src, tmp_path / "work", None, sizes[3][1] - 10)
    with DirectoryStore(work, readonly=True) as r:
        with pytest.raises(TruncatedRecordError) as e:
            r.get("r0000003")
        assert e.value.where.file == str(work / dirmod.segment_name(0)) and e.value.where.record == "r0000003"
        good, errors = r.scan()
        assert good == ["r0000000", "r0000001", "r0000002"] and [x.where.record for x in errors] == ["r0000003"]
    with DirectoryStore(work) as w:
        assert "damaged_segment" in w.recovery
        w.put(trace_for(4))
        assert w._entries["r0000004"].segment == 1  # appended past, not over, the damaged bytes
    with DirectoryStore(work, readonly=True) as r:
        assert same(r.get_many(["r0000000", "r0000002", "r0000004"]), [trace_for(0), trace_for(2), trace_for(4)])


