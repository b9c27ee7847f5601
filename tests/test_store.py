"""Trace stores: the shared contract on both stores (table-driven), then the directory store's
files, locking, concurrent readers, crash survival, damage reporting and bounded-memory scale
(recovery of what an index lost: test_store_recovery.py)."""

from __future__ import annotations

import errno
import functools
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from moe_replay.errors import (
    ChecksumError,
    DuplicateKeyError,
    MissingKeyError,
    MoeReplayError,
    SchemaVersionError,
    TraceFormatError,
)
from moe_replay.geometry import ModelGeometry
from moe_replay.store import (
    STORES,
    DirectoryStore,
    MemoryStore,
    ReadOnlyStoreError,
    StoreLockedError,
    StoreNotFoundError,
    TraceStore,
    open_store,
)
from moe_replay.store import directory as dirmod
from moe_replay.store import framing
from tests.trace_factory import random_trace
from tests.trace_factory import trace_for as _trace_for

trace_for = functools.lru_cache(maxsize=None)(_trace_for)  # deterministic; tests never mutate them

REPO = Path(__file__).resolve().parents[1]
KINDS = ["memory", "directory"]


def make_store(kind: str, tmp_path: Path, **options) -> TraceStore:
    return MemoryStore() if kind == "memory" else DirectoryStore(tmp_path / "store", **options)


def store_name(store: TraceStore) -> str:
    return store.name if isinstance(store, MemoryStore) else str(store.path)


@pytest.fixture(params=KINDS)
def store(request, tmp_path):
    s = make_store(request.param, tmp_path)
    yield s
    s.close()


def variety() -> list:
    """Traces covering every optional part, multi-turn fragments, wide ids and odd keys."""
    rng = np.random.default_rng(7)
    wide = ModelGeometry(num_layers=6, moe_layer_ids=(0, 2, 5), num_experts=300, top_k=8, vocab_size=70_000)
    return [
        random_trace("full", rng),
        random_trace("no-support", rng, with_support=False),
        random_trace("no-routes", rng, with_routes=False, with_logprobs=False),
        random_trace("fragment", rng, num_tokens=40, prompt_len=30, route_start=29),
        random_trace("one-token", rng, num_tokens=1, prompt_len=1),
        random_trace("wide", rng, geometry=wide, num_tokens=33),
        random_trace("clé/ünïcode 🔑", rng),
    ]


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.equals(y) for x, y in zip(a, b))


def flip(path: Path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))


def corrupt_record(store: TraceStore, key: str) -> str:
    """Flip one byte in the middle of a stored record; return the name errors must carry as file."""
    if isinstance(store, MemoryStore):
        data = bytearray(store._records[key])
        data[len(data) // 2] ^= 0xFF
        store._records[key] = bytes(data)
        return store.name
    e = store._entries[key]
    path = store.segment_path(e.segment)
    flip(path, e.offset + framing.FRAME.size + e.length // 2)
    return str(path)


# -- the shared contract, on both stores ---------------------------------------------------------
def test_registry_names_both_stores():
    assert STORES.get("memory") is MemoryStore and STORES.get("directory") is DirectoryStore


def test_round_trip(store):
    traces = variety()
    store.put_many(traces[:3])
    for t in traces[3:]:
        store.put(t)
    for t in traces:
        assert store.get(t.key).equals(t)
    assert len(store) == len(traces) and all(t.key in store for t in traces) and "nope" not in store


def test_get_returns_a_fresh_copy(store):
    t = trace_for(0)
    store.put(t)
    got = store.get(t.key)
    got.extra["mutated"] = True
    assert store.get(t.key).equals(t)


def test_get_many_returns_requested_order(store):
    traces = [trace_for(i) for i in range(12)]
    store.put_many(traces)
    order = [7, 0, 11, 3, 3, 5, 1]
    assert same(store.get_many([traces[i].key for i in order]), [traces[i] for i in order])
    assert store.get_many([]) == []


def test_get_many_reads_in_file_order(tmp_path):
    store = DirectoryStore(tmp_path / "s", segment_bytes=4096)
    traces = [trace_for(i) for i in range(30)]
    store.put_many(traces)
    seen = []
    real = store._read
    store._read = lambda key, entry, *rest: (seen.append(entry[:2]), real(key, entry, *rest))[1]
    keys = [t.key for t in reversed(traces)]
    assert same(store.get_many(keys), traces[::-1])
    assert seen == sorted(seen) and len({s for s, _ in seen}) > 1  # spans segments, read ascending
    store.close()


def test_iteration_and_keys_in_insertion_order(store):
    rng = np.random.default_rng(1)
    traces = [trace_for(i) for i in rng.permutation(25)]
    store.put_many(traces[:10])
    for t in traces[10:]:
        store.put(t)
    assert store.keys() == [t.key for t in traces]
    assert same(list(store), traces)
    assert same(list(store.iter(errors="skip")), traces)


def test_duplicate_key_refused(store):
    store.put(trace_for(0))
    with pytest.raises(DuplicateKeyError) as e:
        store.put(trace_for(0))
    assert e.value.where.record == "r0000000" and e.value.where.file == store_name(store)
    assert "r0000000" in str(e.value) and store_name(store) in str(e.value)
    with pytest.raises(DuplicateKeyError, match="twice in one put_many batch"):
        store.put_many([trace_for(1), trace_for(2), trace_for(1)])
    assert store.keys() == ["r0000000"]  # a refused sequence writes nothing
    store.put_many([trace_for(1)])
    assert store.keys() == ["r0000000", "r0000001"]


def test_missing_key(store):
    store.put(trace_for(0))
    with pytest.raises(MissingKeyError) as e:
        store.get("ghost")
    assert e.value.where.record == "ghost" and store_name(store) in str(e.value) and "ghost" in str(e.value)
    assert isinstance(e.value, KeyError)
    with pytest.raises(MissingKeyError, match="ghost"):
        store.get_many(["r0000000", "ghost"])


def test_corrupt_record_is_named_and_others_stay_readable(store):
    traces = [trace_for(i) for i in range(3)]
    store.put_many(traces)
    bad = traces[1].key
    file = corrupt_record(store, bad)
    with pytest.raises(TraceFormatError) as e:
        store.get(bad)
    assert e.value.where.file == file and e.value.where.record == bad and e.value.where.field
    assert "expected" in str(e.value) and "found" in str(e.value)
    assert store.get(traces[0].key).equals(traces[0]) and store.get(traces[2].key).equals(traces[2])
    got = []
    with pytest.raises(TraceFormatError):
        for t in store.iter(errors="raise"):
            got.append(t.key)
    assert got == [traces[0].key]
    skipped = []
    assert same(list(store.iter(errors="skip", on_error=skipped.append)), [traces[0], traces[2]])
    assert [err.where.record for err in skipped] == [bad]
    with pytest.warns(RuntimeWarning, match=bad):
        assert len(list(store.iter(errors="skip"))) == 2
    good, errors = store.scan()
    assert good == [traces[0].key, traces[2].key] and len(errors) == 1 and errors[0].where.record == bad


def test_iter_error_mode_is_validated(store):
    with pytest.raises(ValueError, match="'ignore'"):
        list(store.iter(errors="ignore"))


def test_closed_store_refuses_use(store):
    store.put(trace_for(0))
    store.close()
    store.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        store.get("r0000000")
    with pytest.raises(ValueError, match="closed"):
        store.put(trace_for(1))


def test_open_store(tmp_path):
    assert isinstance(open_store("memory://"), MemoryStore)
    for uri in (tmp_path / "a", str(tmp_path / "b"), f"directory://{tmp_path / 'c'}"):
        with open_store(uri) as s:
            assert isinstance(s, DirectoryStore)
            s.put(trace_for(0))
    with open_store(tmp_path / "a", readonly=True) as s:
        assert s.get("r0000000").equals(trace_for(0))
    with pytest.raises(StoreNotFoundError) as e:
        open_store(tmp_path / "missing", create=False)
    assert str(tmp_path / "missing") in str(e.value) and "create=True" in str(e.value)
    assert isinstance(e.value, FileNotFoundError) and not (tmp_path / "missing").exists()
    with pytest.raises(StoreNotFoundError, match="does not exist"):
        open_store(tmp_path / "missing", readonly=True)
    with pytest.raises(ValueError, match="unknown store scheme"):
        open_store("s3://bucket/x")


def test_options_are_validated(tmp_path):
    with pytest.raises(ValueError, match="segment_bytes.*100"):
        DirectoryStore(tmp_path / "s", segment_bytes=100)
    with pytest.raises(ValueError, match="durable.*'yes'"):
        DirectoryStore(tmp_path / "s", durable="yes")
    assert not (tmp_path / "s").exists()


# -- directory store: files, reopen, rollover, refresh, locking ----------------------------------
def test_reopen_after_close_and_append(tmp_path):
    d = tmp_path / "s"
    traces = variety()
    with DirectoryStore(d) as s:
        s.put_many(traces[:4])
    with DirectoryStore(d) as s:
        assert s.recovery == {} and same(list(s), traces[:4])
        s.put_many(traces[4:])
    with DirectoryStore(d, readonly=True) as s:
        assert s.keys() == [t.key for t in traces] and same(list(s), traces)
        assert s.scan() == ([t.key for t in traces], [])


def test_segment_rollover(tmp_path):
    d = tmp_path / "s"
    traces = [trace_for(i) for i in range(60)]
    with DirectoryStore(d, segment_bytes=4096) as s:
        s.put_many(traces[:30])
        for t in traces[30:45]:
            s.put(t)
    segments = sorted(p for p in d.iterdir() if p.name.startswith("seg-"))
    assert len(segments) > 3
    assert all(p.stat().st_size <= 4096 for p in segments)  # every record here is < segment_bytes
    with DirectoryStore(d, segment_bytes=8192) as s:  # the size is a writer setting, not a format one
        s.put_many(traces[45:])
    with DirectoryStore(d, readonly=True) as s:
        assert same(list(s), traces) and same(s.get_many([t.key for t in traces[::-1]]), traces[::-1])


def test_record_larger_than_a_segment_gets_its_own(tmp_path):
    big = random_trace("big", np.random.default_rng(0), num_tokens=2000)
    with DirectoryStore(tmp_path / "s", segment_bytes=1024) as s:
        s.put_many([trace_for(0), big, trace_for(1)])
        assert same(list(s), [trace_for(0), big, trace_for(1)])
        assert [s._entries[k].segment for k in s.keys()] == [0, 1, 2]


def test_reader_sees_appended_records_after_refresh(tmp_path):
    d = tmp_path / "s"
    traces = [trace_for(i) for i in range(40)]
    with DirectoryStore(d, segment_bytes=4096) as w, DirectoryStore(d, readonly=True) as r:
        assert len(r) == 0 and r.refresh() == 0
        w.put_many(traces[:5])
        assert len(r) == 0 and "r0000000" not in r
        with pytest.raises(MissingKeyError, match="refresh"):
            r.get("r0000000")
        assert r.refresh() == 5 and same(list(r), traces[:5])
        for t in traces[5:]:  # crosses several segment rollovers
            w.put(t)
        assert r.refresh() == 35 and same(list(r), traces) and r.refresh() == 0
        assert w.refresh() == 0


def _try_writer(d: Path) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "tests.store_worker", "try-writer", str(d)]
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_second_writer_is_refused(tmp_path):
    d = tmp_path / "s"
    w = DirectoryStore(d)
    w.put(trace_for(0))
    with pytest.raises(StoreLockedError) as e:
        DirectoryStore(d)
    msg = str(e.value)
    assert str(d) in msg and "another writer" in msg and str(os.getpid()) in msg
    out = _try_writer(d)
    assert out.returncode == 3 and str(d) in out.stdout and "another writer" in out.stdout, out.stderr
    with DirectoryStore(d, readonly=True) as r1, DirectoryStore(d, readonly=True) as r2:  # readers take no lock
        assert r1.get("r0000000").equals(r2.get("r0000000"))
    w.close()
    with DirectoryStore(d) as w2:  # the lock goes with the writer
        w2.put(trace_for(1))
    out = _try_writer(d)
    assert out.returncode == 0, out.stdout + out.stderr


def test_readonly_refuses_writes_and_never_creates(tmp_path):
    d = tmp_path / "s"
    with DirectoryStore(d) as w:
        w.put(trace_for(0))
    with DirectoryStore(d, readonly=True) as r:
        with pytest.raises(ReadOnlyStoreError, match="readonly=True"):
            r.put(trace_for(1))
    (tmp_path / "empty").mkdir()
    for options in ({"readonly": True}, {"create": False}):
        with pytest.raises(StoreNotFoundError, match="not a moe_replay store.*to create one"):
            DirectoryStore(tmp_path / "empty", **options)
    assert list((tmp_path / "empty").iterdir()) == []


def test_refuses_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(StoreNotFoundError, match="notes.txt"):
        DirectoryStore(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreNotFoundError, match="not a directory"):
        DirectoryStore(tmp_path / "file")


def test_unknown_format_versions_are_refused(tmp_path):
    d = tmp_path / "s"
    with DirectoryStore(d) as w:
        w.put(trace_for(0))
    seg = d / framing.segment_name(0)
    original = seg.read_bytes()
    seg.write_bytes(framing.pack_header(framing.SEGMENT_MAGIC, 99) + original[framing.HEADER.size :])
    with DirectoryStore(d, readonly=True) as r:
        with pytest.raises(SchemaVersionError) as e:
            r.get("r0000000")
        assert e.value.where.file == str(seg) and e.value.where.record == "r0000000" and "99" in str(e.value)
    seg.write_bytes(original)
    index = d / framing.INDEX_NAME
    data = index.read_bytes()
    index.write_bytes(framing.pack_header(framing.INDEX_MAGIC, framing.FORMAT_VERSION + 1) + data[framing.HEADER.size :])
    for readonly in (True, False):
        with pytest.raises(SchemaVersionError) as e:
            DirectoryStore(d, readonly=readonly)
        assert e.value.where.file == str(index) and "upgrade" in str(e.value)
    index.write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(TraceFormatError, match="header.magic"):
        DirectoryStore(d, readonly=True)


# -- concurrency across processes ----------------------------------------------------------------
def _spawn_writer(d: Path, start: int, count: int, batch: int, durable: bool, segment_bytes: int, die_at: str = ""):
    """tests/store_worker.py appending trace_for(start ...) to d in put_many batches (see there)."""
    args = [str(x) for x in (d, start, count, batch, int(durable), segment_bytes)] + ([die_at] if die_at else [])
    cmd = [sys.executable, "-m", "tests.store_worker", "append", *args]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _check_prefix(store: DirectoryStore, start: int = 0) -> int:
    """Every visible key is the next of the writer's stream and decodes to exactly what it wrote."""
    keys = store.keys()
    assert keys == [f"r{i:07d}" for i in range(len(keys))]
    for i, got in zip(range(start, len(keys)), store.get_many(keys[start:])):
        assert got.equals(trace_for(i)), f"record {i} differs"
    return len(keys)


def test_reader_in_another_process_never_sees_a_torn_record(tmp_path):
    d, total = tmp_path / "s", 400
    proc = _spawn_writer(d, 0, total, 7, True, 8192)
    try:
        assert proc.stdout.readline().strip() == "0", proc.stderr.read()  # the writer has created the store
        seen_sizes = []
        with DirectoryStore(d, readonly=True) as r:
            n, deadline = 0, time.monotonic() + 60
            while n < total and time.monotonic() < deadline:
                r.refresh()
                n = _check_prefix(r, n)
                seen_sizes.append(n)
            assert n == total
            assert same(list(r), [trace_for(i) for i in range(total)])
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
        assert len(set(seen_sizes)) > 2  # the reader really did read while the writer appended
    finally:
        proc.kill()
        proc.wait()


KILLS = ["frames:1", "index:1", "header:1", "frames:3", "index:2", 0.1]
"""Where the writer process SIGKILLs itself: half-way through its N-th write of frames, index
entries or a new segment's header (a batch of 25 records crosses a 16 KiB segment rollover or two);
or, for a number, that many seconds after its first put_many returned."""


@pytest.mark.parametrize("durable", [True, False])
def test_writer_killed_mid_put_many_leaves_a_readable_prefix(tmp_path, durable):
    d = tmp_path / "s"
    proc = _spawn_writer(d, 0, -1, 25, durable, 16384, die_at="header:1")  # dies creating the store
    assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stderr.read()
    repaired = []
    for kill in KILLS:
        with DirectoryStore(d) as w:  # a fresh writer repairs what the killed one left
            repaired.append(w.recovery)
            start = len(w)
        proc = _spawn_writer(d, start, -1, 25, durable, 16384, die_at=kill if isinstance(kill, str) else "")
        if not isinstance(kill, str):
            proc.stdout.readline(), proc.stdout.readline()  # opened, then one put_many returned
            time.sleep(kill)
            proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stderr.read()
        reported = max([start] + [int(x) for x in proc.stdout.read().split()])
        with DirectoryStore(d, readonly=True) as r:
            n = _check_prefix(r)  # complete records only, a prefix of the stream
            assert n >= reported  # every put_many that returned is there
            assert r.scan() == (r.keys(), [])
    for kind in ("segment_bytes_truncated", "index_bytes_truncated", "files_removed"):
        assert any(kind in r for r in repaired), kind  # torn bytes of each kind really were left
    with DirectoryStore(d) as w:
        start = len(w)
        w.put_many([trace_for(i) for i in range(start, start + 5)])
    with DirectoryStore(d, readonly=True) as r:
        assert _check_prefix(r) == start + 5


def _four_records(tmp_path: Path) -> tuple[Path, list[tuple[int, int]]]:
    """A store of r0..r3, and (index size, segment size) after each put: entry/frame boundaries."""
    d = tmp_path / "orig"
    sizes = []
    with DirectoryStore(d, durable=False) as s:
        for i in range(4):
            s.put(trace_for(i))
            sizes.append(((d / framing.INDEX_NAME).stat().st_size, (d / framing.segment_name(0)).stat().st_size))
    return d, sizes


# -- damage inside the files ----------------------------------------------------------------------
def test_any_flipped_byte_in_a_record_is_named_and_isolated(tmp_path):
    src, sizes = _four_records(tmp_path)
    seg = src / framing.segment_name(0)
    original = seg.read_bytes()
    start, end = sizes[0][1], sizes[1][1]  # r1's frame
    for pos in sorted(set(range(start, start + framing.FRAME.size + 8)) | set(range(start, end, 5)) | {end - 1}):
        flip(seg, pos)
        with DirectoryStore(src, readonly=True) as r:
            with pytest.raises(TraceFormatError) as e:
                r.get("r0000001")
            assert e.value.where.file == str(seg) and e.value.where.record == "r0000001" and e.value.where.field, pos
            if pos >= start + framing.FRAME.size:
                assert isinstance(e.value, ChecksumError)
            assert same(r.get_many(["r0000000", "r0000002", "r0000003"]), [trace_for(0), trace_for(2), trace_for(3)])
            good, errors = r.scan()
            assert good == ["r0000000", "r0000002", "r0000003"] and len(errors) == 1
        seg.write_bytes(original)


def test_damaged_index_entry_in_the_middle_is_named_and_loses_no_record(tmp_path):
    """Every byte of r1's entry, flipped: the entry is reported (scan, recovery), r1 is read
    again from its intact frame, in its place; a writer rewrites the index as it was."""
    src, sizes = _four_records(tmp_path)
    index = src / framing.INDEX_NAME
    original = index.read_bytes()
    start, end = sizes[0][0], sizes[1][0]  # r1's entry
    keys = [f"r{i:07d}" for i in range(4)]
    for pos in range(start, end):
        flip(index, pos)
        with DirectoryStore(src, readonly=True) as r:
            assert r.keys() == keys and r.recovery["records_recovered"] == ["r0000001"]
            assert same(list(r), [trace_for(i) for i in range(4)])  # errors="raise": nothing lost, nothing raised
            good, errors = r.scan()
            assert good == keys and len(errors) == 1 and errors == r.recovery["index_entries_damaged"]
            err = errors[0]
            assert isinstance(err, TraceFormatError) and err.where.file == str(index)
            assert f"byte {start}" in str(err) and "expected" in str(err)
        index.write_bytes(original)
    flip(index, start + 20)
    with DirectoryStore(src) as w:
        assert w.recovery["records_recovered"] == ["r0000001"] and w.recovery["index_rewritten"] == 4
        assert index.read_bytes() == original  # one entry per record, in file order
        with pytest.raises(DuplicateKeyError):
            w.put(trace_for(1))
        w.put(trace_for(4))
    with DirectoryStore(src, readonly=True) as r:
        assert r.recovery == {} and r.scan() == (keys + ["r0000004"], [])
        assert same(list(r), [trace_for(i) for i in range(5)])


def test_failed_write_leaves_committed_records_and_stops_the_writer(tmp_path, monkeypatch):
    d = tmp_path / "s"
    w = DirectoryStore(d)
    w.put_many([trace_for(0), trace_for(1)])
    real = dirmod._write_all

    def disk_full_on_index(fd, data):
        if fd == w._index_fd:
            real(fd, bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(dirmod, "_write_all", disk_full_on_index)
    with pytest.raises(OSError, match="No space"):
        w.put_many([trace_for(2), trace_for(3), trace_for(4)])  # entries land: r2 whole, r3 torn
    monkeypatch.setattr(dirmod, "_write_all", real)
    with pytest.raises(MoeReplayError, match="reopen"):
        w.put(trace_for(5))
    with DirectoryStore(d, readonly=True) as r:  # a prefix of the failed batch, nothing torn
        assert same(list(r), [trace_for(i) for i in range(3)]) and r.scan()[1] == []
    w.close()
    with DirectoryStore(d) as w:
        assert w.recovery["index_bytes_truncated"] > 0  # r3's torn entry; its frame and r4's are intact:
        assert w.recovery["records_recovered"] == ["r0000003", "r0000004"]  # indexed again, not deleted
        w.put_many([trace_for(5)])
    with DirectoryStore(d, readonly=True) as r:
        assert same(list(r), [trace_for(i) for i in range(6)]) and r.scan()[1] == []


# -- scale ---------------------------------------------------------------------------------------
def _decoded_bytes(t) -> int:
    arrays = [t.token_ids_S, t.routes_TLK, t.logprobs_G, t.support.offsets_G1, t.support.ids_N]
    return sum(a.nbytes for a in arrays)


def _rss_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def test_a_million_tokens_stream_through_bounded_memory(tmp_path):
    """1000 traces x 1000 tokens (routes over 2 MoE layers, support, logprobs) written in ten
    put_many calls and read back one at a time: the reader never holds more than a few records."""
    d, batches, per_batch, tokens = tmp_path / "s", 10, 100, 1000

    def batch(b: int) -> list:
        rng = np.random.default_rng(b)
        return [random_trace(f"s{b * per_batch + i:05d}", rng, num_tokens=tokens, prompt_len=200) for i in range(per_batch)]

    with DirectoryStore(d) as w:
        for b in range(batches):
            w.put_many(batch(b))
    on_disk = sum(p.stat().st_size for p in d.iterdir())
    with DirectoryStore(d, readonly=True) as r:
        assert same(r.get_many([f"s{300 + i:05d}" for i in range(per_batch)]), batch(3))
        try:  # reset the peak RSS (VmHWM) so it measures the iteration alone, where Linux allows
            Path("/proc/self/clear_refs").write_text("5")
            rss_before = _rss_kib("VmRSS")
        except OSError:
            rss_before = None
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        count = total_tokens = decoded = 0
        for t in r:
            count += 1
            total_tokens += t.num_tokens
            decoded += _decoded_bytes(t)
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        hwm = _rss_kib("VmHWM")
    assert count == batches * per_batch and total_tokens == 1_000_000
    assert peak < decoded / 20 and peak < on_disk / 5, (peak, decoded, on_disk)  # measured ~1/85, ~1/25
    if rss_before is not None and hwm is not None:
        assert (hwm - rss_before) * 1024 < decoded / 4, (hwm, rss_before, decoded)
