"""Directory store recovery: truncated indexes and torn segment tails, cut at every offset.

A crash between a record's segment sync and its index sync, or an index truncated or restored from
an older copy, leaves intact frames the index does not name: a writer indexes them again and cuts
only bytes that belong to no intact frame; damage before an intact record makes it refuse to open.
Damaged index entries anywhere lose no record: readers and writers read the frames the index no
longer names, and a writer replaces the index by one that names them all.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_replay.errors import (
    ChecksumError, DuplicateKeyError, MissingKeyError, MoeReplayError, SchemaVersionError, TraceError, TraceFormatError, TruncatedRecordError,
    Where,
)
from moe_replay.store import DirectoryStore, RescueDestinationError, UnindexedDamageError, rescue_store
from moe_replay.store import directory as dirmod
from moe_replay.store import framing

from .test_store import _four_records, _spawn_writer, flip, same, trace_for


def _cut(src: Path, dst: Path, index_at: int | None, segment_at: int | None) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    for name, at in ((framing.INDEX_NAME, index_at), (framing.segment_name(0), segment_at)):
        if at is not None:
            os.truncate(dst / name, at)
    return dst


SURVEY_ONLY = ("unindexed_bytes", "records_unindexed", "refused", "frames_duplicated")


def _as_writer_reports(recovery: dict) -> dict:
    """A `recovery` dict as a writer reports it (a survey reader adds what it alone can say)."""
    def plain(v):
        return str(v) if isinstance(v, Exception) else [plain(x) for x in v] if isinstance(v, list) else v

    return {k: plain(v) for k, v in recovery.items() if k not in SURVEY_ONLY}


def _visible_then_repaired(work: Path, n_visible: int, sizes: list[tuple[int, int]], n_intact: int | None = None) -> None:
    """Readers see the first n_visible records; a writer then indexes again the records whose
    frames are intact (the first n_intact), cuts the rest, and appends normally."""
    n_intact = n_visible if n_intact is None else n_intact
    with DirectoryStore(work, readonly=True) as r:
        assert same(list(r), [trace_for(i) for i in range(n_visible)])
        assert r.scan()[1] == []  # a torn tail is not damage: it is invisible
        with pytest.raises(MissingKeyError):
            r.get(f"r{n_visible:07d}")
    with DirectoryStore(work, readonly=True, survey=True) as r:  # what the writer will do, foretold
        foretold, survey_keys = _as_writer_reports(r.recovery), r.keys()
    with DirectoryStore(work, durable=False) as w:  # the writer recovers intact frames, cuts torn bytes ...
        assert _as_writer_reports(w.recovery) == foretold and w.keys() == survey_keys
        assert w.recovery.get("records_recovered", []) == [f"r{i:07d}" for i in range(n_visible, n_intact)]
        index_end, segment_end = sizes[n_intact - 1] if n_intact else (framing.HEADER.size,) * 2
        assert (work / framing.INDEX_NAME).stat().st_size == index_end
        assert (work / framing.segment_name(0)).stat().st_size == segment_end
        w.put(trace_for(n_intact))  # ... and appends normally, even the key that was torn
    with DirectoryStore(work, readonly=True) as r:
        assert same(list(r), [trace_for(i) for i in range(n_intact + 1)]) and r.scan()[1] == []


def test_truncated_index_is_recovered_from_intact_frames(tmp_path):
    """An index cut at any byte (its header excepted) loses entries, never records: the frames
    are intact, so the writer indexes them again, in order."""
    src, sizes = _four_records(tmp_path)
    for cut in range(framing.HEADER.size, sizes[3][0]):  # every byte of every entry
        n_visible = sum(index_end <= cut for index_end, _ in sizes)
        _visible_then_repaired(_cut(src, tmp_path / "work", cut, None), n_visible, sizes, n_intact=4)


def _header_damaged(src: Path, work: Path, how: str) -> Path:
    """A copy of src whose index.bin header is cut ("cut:N": to N bytes) or damaged ("flip:N")."""
    kind, at = how.split(":")
    if kind == "cut":
        return _cut(src, work, int(at), None)
    work = _cut(src, work, None, None)
    flip(work / framing.INDEX_NAME, int(at))
    return work


@pytest.mark.parametrize("how", [f"cut:{n}" for n in range(framing.HEADER.size)] + ["flip:0", "flip:13"])
def test_index_with_a_cut_or_damaged_header_is_rebuilt_by_a_writer(tmp_path, how):
    """A zero-byte, cut or damaged index header beside intact segments: plain readers refuse,
    naming the file and the way out; a survey reader sees every record; a writer rebuilds the
    index from the frames (they hold every key, in order) and appends."""
    src, sizes = _four_records(tmp_path)
    work = _header_damaged(src, tmp_path / "work", how)
    segment = (work / framing.segment_name(0)).read_bytes()
    with pytest.raises(TraceError, match="rebuilds the index") as e:
        DirectoryStore(work, readonly=True)
    assert e.value.where.file == str(work / framing.INDEX_NAME)
    with DirectoryStore(work, readonly=True, survey=True) as r:
        assert same(list(r), [trace_for(i) for i in range(4)])
        assert r.recovery["records_recovered"] == [f"r{i:07d}" for i in range(4)] and "refused" not in r.recovery
        assert r.recovery["index_rewritten"] == 4 and r.recovery["unindexed_bytes"] == sizes[3][1] - framing.HEADER.size
    assert (work / framing.segment_name(0)).read_bytes() == segment  # the survey wrote nothing
    with DirectoryStore(work, durable=False) as w:
        assert isinstance(w.recovery["index_header_damaged"], TraceError) and w.recovery["index_rewritten"] == 4
        w.put(trace_for(4))
    with DirectoryStore(work, readonly=True) as r:
        assert r.recovery == {} and same(list(r), [trace_for(i) for i in range(5)]) and r.scan()[1] == []


def test_foreign_or_newer_index_is_refused_and_nothing_is_written(tmp_path):
    """Not damage: an index.bin of another format version, or a foreign index.bin with no segment
    beside it, is refused by every opener; no byte changes."""
    src, _ = _four_records(tmp_path)
    work = _cut(src, tmp_path / "work", None, None)
    data = bytearray((work / framing.INDEX_NAME).read_bytes())
    data[: framing.HEADER.size] = framing.pack_header(framing.INDEX_MAGIC, framing.FORMAT_VERSION + 1)
    (work / framing.INDEX_NAME).write_bytes(bytes(data))
    for options in ({}, {"readonly": True}, {"readonly": True, "survey": True}):
        with pytest.raises(SchemaVersionError):
            DirectoryStore(work, **options)
    assert (work / framing.INDEX_NAME).read_bytes() == bytes(data)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / framing.INDEX_NAME).write_bytes(b"some other program's index file")
    with pytest.raises(TraceFormatError, match="header.magic"):
        DirectoryStore(foreign)
    assert (foreign / framing.INDEX_NAME).read_bytes() == b"some other program's index file"


def test_torn_segment_tail_is_invisible_then_truncated(tmp_path):
    src, sizes = _four_records(tmp_path)
    rng = np.random.default_rng(0)
    start, end = sizes[1][1], sizes[3][1]  # frames of r2 and r3, whose index entries are torn
    cuts = sorted(set(range(start, start + 40)) | set(range(start, end, 97)) | set(range(end - 20, end + 1)))
    for cut in cuts:
        index_cut = int(rng.integers(sizes[1][0], sizes[2][0]))  # crash-consistent: r2's entry torn too
        n_intact = sum(segment_end <= cut for _, segment_end in sizes)  # r2 (and r3) whole: recovered
        _visible_then_repaired(_cut(src, tmp_path / "work", index_cut, cut), 2, sizes, n_intact)
    _visible_then_repaired(_cut(src, tmp_path / "work", framing.HEADER.size + 3, framing.HEADER.size + 5), 0, sizes)


def test_damage_before_an_intact_unindexed_record_refuses_the_writer(tmp_path):
    """Not a crash: r2's frame is damaged and r3's, after it, intact, both unindexed. Cutting at r2
    would delete r3, so the writer refuses; readers still see r0, r1; no byte is removed. A survey
    reader shows what the writer saw (r3 too, r2's damage at its place), and the refusal's advice,
    rescue_store, copies r0, r1 and r3 into a new store a writer opens."""
    src, sizes = _four_records(tmp_path)
    work = _cut(src, tmp_path / "work", sizes[1][0], None)
    flip(work / framing.segment_name(0), sizes[1][1] + 30)
    before = (work / framing.segment_name(0)).read_bytes()
    with pytest.raises(UnindexedDamageError, match=r"offset %d.*intact frame.*rescue_store" % sizes[1][1]) as e:
        DirectoryStore(work)
    assert e.value.where.file == str(work / framing.segment_name(0))
    assert (work / framing.segment_name(0)).read_bytes() == before
    assert (work / framing.INDEX_NAME).stat().st_size == sizes[1][0]
    with DirectoryStore(work, readonly=True) as r:
        assert same(list(r), [trace_for(0), trace_for(1)])
    with DirectoryStore(work, readonly=True, survey=True) as r:
        assert str(r.recovery["refused"]) == str(e.value) and "records_recovered" not in r.recovery
        assert r.recovery["records_unindexed"] == ["r0000003"]
        assert r.recovery["unindexed_bytes"] == sizes[3][1] - sizes[1][1]
        good, errors = r.scan()
        assert good == ["r0000000", "r0000001", "r0000003"] and len(errors) == 1
        assert errors[0].where.file == str(work / framing.segment_name(0)) and f"offset {sizes[1][1]}" in errors[0].where.field
        with pytest.raises(MoeReplayError, match="survey=True"):
            r.refresh()
    assert (work / framing.segment_name(0)).read_bytes() == before
    report = rescue_store(work, tmp_path / "rescued", durable=False)
    assert (report.copied, report.unindexed, len(report.damaged), report.conflicts) == (3, 1, 1, [])
    with DirectoryStore(tmp_path / "rescued", durable=False) as w:
        assert w.recovery == {} and same(list(w), [trace_for(i) for i in (0, 1, 3)])
        w.put(trace_for(2))
    with pytest.raises(RescueDestinationError, match="new or empty directory"):
        rescue_store(work, tmp_path / "rescued")


def test_unindexed_copy_of_an_indexed_key_refuses_the_writer_and_rescue_names_it(tmp_path):
    """An index restored from an older copy that misses r1's entry, while r1 was written again
    later (r0 r1 r2 r1'): the writer cannot choose between two intact records of one key, so it
    refuses; rescue copies r0, r1 (the first), r2 and names the second r1 by segment and offset."""
    d = tmp_path / "s"
    with DirectoryStore(d, durable=False) as s:
        s.put_many([trace_for(0), trace_for(1)])
        after_r1 = (d / framing.INDEX_NAME).stat().st_size
        s.put(trace_for(2))
    other = tmp_path / "other"
    with DirectoryStore(other, durable=False) as s:
        s.put(trace_for(1))
    frame = (other / framing.segment_name(0)).read_bytes()[framing.HEADER.size :]
    with open(d / framing.segment_name(0), "ab") as f:
        offset = f.tell()
        f.write(frame)
    os.truncate(d / framing.INDEX_NAME, after_r1)  # r2's entry lost: r2 and r1' are the tail
    with pytest.raises(DuplicateKeyError, match="rescue_store") as e:
        DirectoryStore(d)
    assert e.value.where.record == "r0000001" and e.value.where.field == f"frame at offset {offset}"
    with DirectoryStore(d, readonly=True, survey=True) as r:
        assert isinstance(r.recovery["refused"], DuplicateKeyError) and r.keys() == ["r0000000", "r0000001", "r0000002"]
    report = rescue_store(d, tmp_path / "rescued", durable=False)
    assert report.copied == 3 and [c.where.field for c in report.conflicts] == [f"frame at offset {offset}"]


def test_unindexed_frames_in_later_segments_are_recovered(tmp_path):
    """The index lost every entry of a store that spans several segments: all records come back."""
    d = tmp_path / "s"
    with DirectoryStore(d, durable=False, segment_bytes=4096) as s:
        s.put_many([trace_for(i) for i in range(12)])
        n_segments = s._seg + 1
    assert n_segments >= 3
    os.truncate(d / framing.INDEX_NAME, framing.HEADER.size)
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
        assert e.value.where.file == str(work / framing.segment_name(0)) and e.value.where.record == "r0000003"
        good, errors = r.scan()
        assert good == ["r0000000", "r0000001", "r0000002"] and [x.where.record for x in errors] == ["r0000003"]
    with DirectoryStore(work) as w:
        assert "damaged_segment" in w.recovery
        w.put(trace_for(4))
        assert w._entries["r0000004"].segment == 1  # appended past, not over, the damaged bytes
    with DirectoryStore(work, readonly=True) as r:
        assert same(r.get_many(["r0000000", "r0000002", "r0000004"]), [trace_for(0), trace_for(2), trace_for(4)])


# -- damaged index entries: records the index does not name, between named ones -------------------
def _five_records(d: Path, segment_bytes: int = dirmod.DEFAULT_SEGMENT_BYTES) -> list[tuple[int, int]]:
    """r0..r4 in d; each record's index entry as (start, end) byte offsets in index.bin."""
    with DirectoryStore(d, durable=False, segment_bytes=segment_bytes) as s:
        s.put_many([trace_for(i) for i in range(5)])
        n_segments = s._seg + 1
    data, spans, pos = (d / framing.INDEX_NAME).read_bytes(), [], framing.HEADER.size
    while pos < len(data):
        key_len = framing.ENTRY.unpack_from(data, pos)[1]
        spans.append((pos, pos + framing.ENTRY.size + key_len + framing.CRC.size))
        pos = spans[-1][1]
    assert len(spans) == 5 and n_segments == (1 if segment_bytes == dirmod.DEFAULT_SEGMENT_BYTES else 3)
    return spans


def _damage(path: Path, start: int, end: int, mask: int = 0xFF) -> None:
    data = bytearray(path.read_bytes())
    data[start:end] = bytes(b ^ mask for b in data[start:end])
    path.write_bytes(bytes(data))


def _writer_keeps_all_and_appends(d: Path, n: int = 5, **options) -> None:
    """A survey reader sees all n records and foretells the writer's recovery; the writer sees all
    n, appends one more; a fresh reader sees n + 1, finds no damage and nothing left to recover
    (the index names every record)."""
    with DirectoryStore(d, readonly=True, survey=True) as r:
        assert same(list(r), [trace_for(i) for i in range(n)]) and "refused" not in r.recovery
        foretold = _as_writer_reports(r.recovery)
    with DirectoryStore(d, durable=False, **options) as w:
        assert _as_writer_reports(w.recovery) == foretold
        assert same(list(w), [trace_for(i) for i in range(n)])
        w.put(trace_for(n))
    with DirectoryStore(d, readonly=True) as r:
        assert r.recovery == {} and r.scan() == ([f"r{i:07d}" for i in range(n + 1)], [])
        assert same(list(r), [trace_for(i) for i in range(n + 1)])


def test_one_damaged_index_entry_in_the_middle_loses_no_record(tmp_path):
    d = tmp_path / "s"
    spans = _five_records(d)
    _damage(d / framing.INDEX_NAME, spans[2][0] + 10, spans[2][0] + 14)  # r2's segment field
    with DirectoryStore(d, readonly=True) as r:
        assert same(list(r), [trace_for(i) for i in range(5)]) and r.keys() == [f"r{i:07d}" for i in range(5)]
        assert r.get("r0000002").equals(trace_for(2)) and r.recovery["records_recovered"] == ["r0000002"]
    with DirectoryStore(d, durable=False) as w:
        assert w.recovery["records_recovered"] == ["r0000002"] and w.recovery["index_rewritten"] == 5
    _writer_keeps_all_and_appends(d)


def test_reader_open_across_a_writer_repair_switches_to_the_new_index(tmp_path):
    d = tmp_path / "s"
    spans = _five_records(d)
    _damage(d / framing.INDEX_NAME, *spans[1])
    with DirectoryStore(d, readonly=True) as r:
        assert len(r) == 5
        with DirectoryStore(d, durable=False) as w:  # replaces index.bin, then appends to the new one
            w.put(trace_for(5))
        assert r.refresh() == 1 and r.recovery == {}
        assert same(list(r), [trace_for(i) for i in range(6)]) and r.scan()[1] == []


def test_writer_killed_while_replacing_the_index_leaves_the_old_one(tmp_path):
    """The writer dies half-way through writing the new index: index.bin is untouched (the new
    one was going to a temporary file), readers still see all 5, the next writer finishes."""
    d = tmp_path / "s"
    spans = _five_records(d)
    _damage(d / framing.INDEX_NAME, *spans[3])
    damaged = (d / framing.INDEX_NAME).read_bytes()
    proc = _spawn_writer(d, 5, 1, 1, True, dirmod.DEFAULT_SEGMENT_BYTES, die_at="rewrite:1")
    assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stderr.read()
    assert (d / framing.INDEX_NAME).read_bytes() == damaged and (d / (framing.INDEX_NAME + ".tmp")).exists()
    with DirectoryStore(d, readonly=True) as r:
        assert same(list(r), [trace_for(i) for i in range(5)])
    with DirectoryStore(d, durable=False) as w:
        assert w.recovery["files_removed"] == [framing.INDEX_NAME + ".tmp"] and w.recovery["index_rewritten"] == 5
    _writer_keeps_all_and_appends(d)


def test_damaged_frame_under_a_damaged_entry_is_reported_never_returned(tmp_path):
    """r2's entry and its frame are both damaged: r2 is lost, and said so at its place, every
    time the store opens; the writer keeps every other byte and appends past them."""
    d = tmp_path / "s"
    spans = _five_records(d)
    seg = d / framing.segment_name(0)
    with DirectoryStore(d, readonly=True) as r:
        e = r._entries["r0000002"]
    _damage(seg, e.offset + framing.FRAME.size + e.length // 2, e.offset + framing.FRAME.size + e.length // 2 + 3)
    _damage(d / framing.INDEX_NAME, spans[2][1] - 2, spans[2][1])  # the entry's own crc32: the key survives
    rest = [trace_for(i) for i in (0, 1, 3, 4)]

    def check(r: DirectoryStore, index_damaged: bool) -> None:
        assert same(list(r.iter(errors="skip", on_error=lambda err: None)), rest)
        good, errors = r.scan()
        assert good == [t.key for t in rest] and len(errors) == 1 + index_damaged
        frame_err = errors[-1]
        assert isinstance(frame_err, ChecksumError) and frame_err.where.file == str(seg)
        assert f"offset {e.offset}" in frame_err.where.field and "lost" in str(frame_err)
        seen = []
        with pytest.raises(ChecksumError):  # errors="raise" stops at r2's place
            for t in r:
                seen.append(t.key)
        assert seen == ["r0000000", "r0000001"]
        with pytest.raises((ChecksumError, MissingKeyError)) as got:
            r.get("r0000002")
        if index_damaged:  # the damaged entry still names its key
            assert isinstance(got.value, ChecksumError) and got.value.where == Where(
                str(d / framing.INDEX_NAME), "r0000002", "index entry crc32")

    with DirectoryStore(d, readonly=True) as r:
        check(r, index_damaged=True)
    with DirectoryStore(d, durable=False) as w:
        assert "records_recovered" not in w.recovery and w.recovery["index_rewritten"] == 4
        check(w, index_damaged=False)
        w.put(trace_for(5))
    with DirectoryStore(d, readonly=True) as r:
        rest.append(trace_for(5))
        check(r, index_damaged=False)


def test_missing_segment_under_damaged_entries_is_named(tmp_path):
    d = tmp_path / "s"
    spans = _five_records(d, segment_bytes=3000)  # segments: r0 r1 | r2 r3 | r4
    _damage(d / framing.INDEX_NAME, spans[2][0], spans[3][1])
    (d / framing.segment_name(1)).unlink()
    with DirectoryStore(d, readonly=True) as r:
        assert same(list(r.iter(errors="skip", on_error=lambda err: None)), [trace_for(i) for i in (0, 1, 4)])
        errors = r.scan()[1]
        assert isinstance(errors[-1], TruncatedRecordError) and errors[-1].where.file == str(d / framing.segment_name(1))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_damaged_byte_range_of_the_index_keeps_every_record_reachable(data):
    """Property: damage one byte range anywhere past the index header (one or several entries,
    whole or in part, of a store spanning 3 segments). Readers see every record up to the last
    entry left whole (later ones are a torn tail to them); a writer sees all, and after it the
    index names every record again."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "s"
        spans = _five_records(d, segment_bytes=3000)
        start = data.draw(st.integers(framing.HEADER.size, spans[-1][1] - 1), label="start")
        end = data.draw(st.integers(start + 1, min(spans[-1][1], start + 100)), label="end")
        _damage(d / framing.INDEX_NAME, start, end, data.draw(st.integers(1, 255), label="xor mask"))
        whole = [i for i, (a, b) in enumerate(spans) if b <= start or a >= end]
        visible = max(whole, default=-1) + 1
        with DirectoryStore(d, readonly=True) as r:
            assert r.keys() == [f"r{i:07d}" for i in range(visible)]
            assert same(list(r), [trace_for(i) for i in range(visible)])
        _writer_keeps_all_and_appends(d, segment_bytes=3000)
