"""Damage and what the store's writer, readers, `inspect` and `rescue` do about it: a
writer never names a chunk it has not checked in its session, and never a damaged one; inspect
scans every chunk frame and says what a writer would do, with or without index.bin; every chunk
error names the chunk, its segment and offset; keys and `layers` are typed where they enter; a
writer refuses writes from a forked child, a pickled copy or after losing its lock, by name; and the fault harness (tests/store_faults.py: SIGKILLed writers, eleven kinds of damage, forked and lock-less
writers, writes after each) finds no acknowledged record unreadable, no untyped error, no disagreement."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from moe_replay.cli import main
from moe_replay.errors import ChecksumError, MoeReplayError, TraceError, TruncatedRecordError, TraceFormatError
from moe_replay.report.inspect import summarize_store
from moe_replay.store import DirectoryStore, MemoryStore, WriterLockLostError, WriterProcessError, framing
from moe_replay.store.chunks import label, parse_key
from moe_replay.store.inputs import StoreArgumentError
from tests import store_faults
from tests.store_worker import SHARED_CHUNK_MIN_BYTES
from tests.trace_factory import shared_trace_for

SMALL = {"chunk_min_bytes": SHARED_CHUNK_MIN_BYTES}


def sample(n: int, group: int = 0):
    """Sample n of prompt `group` (any number of samples, one key each)."""
    return shared_trace_for(group * 1000 + n, group=1000)


def flip_in(d: Path, store: DirectoryStore, key: str, at: float = 0.5) -> None:
    """Flip one byte `at` (a fraction) of the way into the payload of the frame of `key`."""
    e = store._entries[key]
    path = d / framing.segment_name(e.segment)
    data = bytearray(path.read_bytes())
    data[e.offset + framing.FRAME.size + int(e.length * at)] ^= 0x10
    path.write_bytes(bytes(data))


def survey(d: Path) -> dict:
    with DirectoryStore(d, readonly=True, survey=True) as r:
        return summarize_store(r, sample=0)


# -- 1. a writer never names bytes it has not checked -----------------------------------------------
def test_a_new_sample_of_a_prompt_whose_chunk_is_damaged_reads_back(tmp_path):
    """The steps that found it: 4 samples of a prompt, one byte of its chunk flipped, a writer puts a
    fifth sample: it used to name the damaged chunk (ChecksumError on read); now the chunk is
    found damaged, the sample's routes are written as a copy, and it reads back bit-identical."""
    d = tmp_path / "s"
    with DirectoryStore(d, **SMALL) as w:
        w.put_many([sample(i) for i in range(4)])
        prompt = w.record_chunks(sample(0).key)[0]
        flip_in(d, w, prompt)
    assert survey(d)["writer"]["refuses_to_reuse_chunks"] == [label(prompt)]  # foretold
    with DirectoryStore(d, **SMALL) as w:
        w.put_many([sample(4)])
        assert list(w.chunks_refused) == [prompt] and isinstance(w.chunks_refused[prompt], ChecksumError)
        copy = w.record_chunks(sample(4).key)[0]
        assert parse_key(copy).copy == 1 and parse_key(copy)._replace(copy=0).key() == prompt
    with DirectoryStore(d, readonly=True) as r:
        assert r.get(sample(4).key).equals(sample(4))
        with pytest.raises(ChecksumError, match=rf"record '{sample(1).key}', field '{label(prompt)} at offset"):
            r.get(sample(1).key)  # the records naming the damaged chunk stay refused, by name
    with DirectoryStore(d, **SMALL) as w:  # a later session names the intact copy, writes none
        w.put_many([sample(5)])
        assert w.record_chunks(sample(5).key)[0] == copy and w.chunks_refused == {}
        flip_in(d, w, copy, 0.9)
    with DirectoryStore(d, **SMALL) as w:  # the copy damaged too: a second copy
        w.put_many([sample(6)])
        assert parse_key(w.record_chunks(sample(6).key)[0]).copy == 2 and sorted(w.chunks_refused) == sorted([prompt, copy])
    with DirectoryStore(d, readonly=True) as r:
        assert r.get(sample(6).key).equals(sample(6))
        with pytest.raises(ChecksumError, match=rf"record '{sample(5).key}', field '{label(copy)} at offset"):
            r.get(sample(5).key)


def test_a_writer_checks_each_chunk_it_names_once_per_session(tmp_path, monkeypatch):
    d = tmp_path / "s"
    with DirectoryStore(d, **SMALL) as w:
        w.put_many([sample(0, g) for g in range(3)])
    checked: list[str] = []
    real = DirectoryStore.check_chunk
    monkeypatch.setattr(DirectoryStore, "check_chunk", lambda self, key: checked.append(key) or real(self, key))
    for session in range(2):
        with DirectoryStore(d, **SMALL) as w:
            for n in range(1, 4):  # three put_many calls, each naming the prompt chunks of groups 0 and 1
                w.put_many([sample(session * 10 + n, 0), sample(session * 10 + n, 1)])
            prompts = {w.record_chunks(sample(0, g).key)[0] for g in (0, 1)}
        assert sorted(checked) == sorted(prompts), session  # not the chunks it wrote, nor group 2's
        checked.clear()


# -- 2. inspect, rescue and the writer tell one story ---------------------------------------------------
def test_inspect_lists_every_damaged_chunk_a_record_names(tmp_path):
    """An agentic rollout's turn 4 names the chunks of turns 1-3 and its own: damage to three of
    them used to show as one (inspect learnt damage from record reads, which stop at the first)."""
    d = tmp_path / "s"
    turns = [store_faults.conversation_turn(0, 0, k) for k in range(1, 5)]
    with DirectoryStore(d, **SMALL) as w:
        w.put_many(turns)
        named = w.record_chunks(turns[-1].key)
        assert len(named) >= 5
        for key in named[:3]:
            flip_in(d, w, key)
    summary = survey(d)
    damaged = {c["chunk"]: c for c in summary["chunks"]["damaged"]}
    assert set(damaged) == {label(k) for k in named[:3]}
    assert all(turns[-1].key in c["records"] for c in damaged.values())
    assert damaged[label(named[0])]["records"] == sorted(t.key for t in turns)  # turn 1's prompt chunk: every turn
    assert summary["writer"]["refuses_to_reuse_chunks"] == sorted(damaged)
    with DirectoryStore(d, **SMALL) as w:
        assert {label(k) for k in w.chunk_keys() if not w._chunk_usable(k)} == set(damaged)


@pytest.mark.parametrize("how", ["delete", "header"])
def test_a_chunk_error_names_the_chunk_its_segment_and_offset(tmp_path, how):
    """The prompt chunk in segment 0, records naming it in later segments: a lost segment or a
    damaged segment header used to be named by file only (and inspect listed no damaged chunk)."""
    d = tmp_path / "s"
    with DirectoryStore(d, segment_bytes=1024, **SMALL) as w:
        w.put_many([sample(i) for i in range(5)])
        prompt = w.record_chunks(sample(0).key)[0]
        seg, offset = w.locate(prompt)
        late = [k for k in w.keys() if w.locate(k)[0] != seg]
    assert seg == framing.segment_name(0) and late
    if how == "delete":
        (d / seg).unlink()
    else:
        with open(d / seg, "r+b") as f:
            f.write(b"X")
    kind = TruncatedRecordError if how == "delete" else TraceFormatError
    with DirectoryStore(d, readonly=True) as r:
        with pytest.raises(kind, match=rf"{seg}', record '{late[0]}', field '{label(prompt)} at offset {offset}: "):
            r.get(late[0])
    damaged = {c["chunk"]: c for c in survey(d)["chunks"]["damaged"]}  # every chunk of segment 0
    chunk = damaged[label(prompt)]
    assert (chunk["segment"], chunk["offset"]) == (seg, offset) and {c["segment"] for c in damaged.values()} == {seg}
    assert set(late) <= set(chunk["records"])


def test_inspect_and_rescue_run_on_a_store_without_its_index(tmp_path, capsys):
    """A writer opens a store whose index.bin is gone and indexes every record again; inspect and
    rescue used to refuse it ("not a moe_replay store")."""
    d = tmp_path / "s"
    traces = [sample(i) for i in range(4)] + [store_faults.conversation_turn(0, 1, k) for k in (1, 2)]
    with DirectoryStore(d, **SMALL) as w:
        w.put_many(traces)
        stored = len(w.chunk_keys()) + len(w)
    (d / framing.INDEX_NAME).unlink()
    assert main(["inspect", "--json", str(d)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["writer"]["creates_index"] and summary["writer"]["recovers"] == stored and summary["records"] == 6
    assert main(["rescue", str(d), str(tmp_path / "copy")]) == 0
    with DirectoryStore(tmp_path / "copy", readonly=True) as r:
        assert all(a.equals(b) for a, b in zip(r, traces))
    with DirectoryStore(d, **SMALL) as w:  # what inspect foretold
        assert len(w.recovery["records_recovered"]) == stored and w.keys() == [t.key for t in traces]
    (d / framing.INDEX_NAME).unlink()
    with pytest.raises(MoeReplayError, match="no index.bin.*survey=True"):  # a plain reader says how to read it
        DirectoryStore(d, readonly=True)


# -- 3. inputs typed at the boundary ------------------------------------------------------------------------
BAD_LAYERS = [(["x"], "str 'x' at position 0"), ([None], "NoneType None"), (5, "int 5"), ([1.7], "float 1.7"),
              ("13", "str '13'"), ([True], "bool True"), ([np.float32(3)], "float32")]
BAD_KEYS = [(5, "int 5"), (None, "NoneType"), (b"k", "bytes b'k'"), ("\ud800", "surrogates not allowed at index 0")]


@pytest.mark.parametrize("kind", ["memory", "directory"])
def test_keys_and_layers_are_typed_where_they_enter(kind, tmp_path):
    store = MemoryStore(**SMALL) if kind == "memory" else DirectoryStore(tmp_path / "s", **SMALL)
    good = sample(0)
    with store:
        store.put(good)
        for layers, found in BAD_LAYERS:
            for call in (lambda: store.get(good.key, layers=layers), lambda: store.get_many([good.key], layers=layers)):
                with pytest.raises(StoreArgumentError, match=rf"field 'layers'.*found {found}"):
                    call()
        for key, found in BAD_KEYS:
            with pytest.raises(StoreArgumentError, match=rf"field 'key'.*found {found}"):
                store.get(key)
            with pytest.raises(StoreArgumentError, match=rf"field 'keys'.*found {found}"):
                store.get_many([key])
            bad = sample(1)
            bad.key = key
            with pytest.raises(StoreArgumentError, match=rf"field 'trace.key'.*found {found}"):
                store.put(bad)
        with pytest.raises(StoreArgumentError, match="field 'keys'.*found str"):
            store.get_many(good.key)  # one str, not a sequence of keys
        with pytest.raises(StoreArgumentError, match="field 'trace'.*a RolloutTrace.*found dict"):
            store.put_many([{"key": "x"}])
        assert isinstance(StoreArgumentError(None, "", ""), (TypeError, ValueError, TraceError))
        assert len(store) == 1  # nothing was written
        part = store.get(good.key, layers=np.array([3]))  # NumPy integers are ints
        assert part.route_layer_ids == (3,) and store.get_many([good.key], layers=(np.int64(1), 3))[0].equals(good)


# -- 4. one writer, one process ----------------------------------------------------------------------------
def _child_put(store: DirectoryStore, n: int) -> None:
    """A forked child's write through the writer it inherited: exit 3 when refused by name, 0 when it returned."""
    try:
        store.put_many([sample(n)])
    except WriterProcessError as err:
        os._exit(3 if f"found a write from pid {os.getpid()}" in str(err) else 4)
    os._exit(0)


def test_a_forked_child_or_a_pickled_copy_refuses_to_write(tmp_path):
    """The steps that found it: a writer in a process that forks (multiprocessing's fork start method, a
    DataLoader worker); the child puts through the writer it inherited, the parent goes on putting: both
    put_many returned, then acknowledged records read back as frames of the other process (8 of 8 trials).
    Now the child's write is refused by name (WriterProcessError) before a byte is written and every
    record the parent acknowledged reads back; the child can still read. A pickled writer arrives as a
    reader of the same directory that refuses writes the same way."""
    d = tmp_path / "s"
    with DirectoryStore(d, **SMALL) as w:
        w.put_many([sample(i) for i in range(3)])
        child = multiprocessing.get_context("fork").Process(target=_child_put, args=(w, 10))
        child.start()
        child.join(60)
        assert child.exitcode == 3, f"the child's write was not refused by name (exit {child.exitcode})"
        w.put_many([sample(i) for i in range(3, 6)])
        copy = pickle.loads(pickle.dumps(w))
        assert copy.readonly and copy.get(sample(4).key).equals(sample(4))
        with pytest.raises(WriterProcessError, match=rf"field 'writer'.*writer of pid {os.getpid()}.*a pickled copy"):
            copy.put(sample(11))
        copy.close()
        w.put_many([sample(6)])
    with DirectoryStore(d, readonly=True) as r:
        assert r.keys() == [sample(i).key for i in range(7)]
        assert all(r.get(sample(i).key).equals(sample(i)) for i in range(7))
        assert pickle.loads(pickle.dumps(r)).get(sample(0).key).equals(sample(0))  # a reader's copy reads too


def test_a_writer_whose_lock_was_deleted_refuses_to_write(tmp_path):
    """The steps that found it: writer.lock deleted under a live writer, a second writer opens and puts,
    then the first one puts: both returned and the second one's acknowledged records were overwritten.
    Now the first writer finds its lock gone (or replaced by another file) before any write and refuses by
    name (WriterLockLostError); the second writer's records read back."""
    d = tmp_path / "s"
    first = DirectoryStore(d, **SMALL)
    first.put_many([sample(i) for i in range(2)])
    (d / framing.LOCK_NAME).unlink()
    with pytest.raises(WriterLockLostError, match=r"field 'writer.lock'.*found no such file \(deleted"):
        first.put(sample(9))  # deleted: refused at once, before a second writer comes
    with DirectoryStore(d, **SMALL) as second:
        second.put_many([sample(i) for i in range(2, 5)])
        with pytest.raises(WriterLockLostError, match=r"locked, inode [0-9]+, found another file"):
            first.put_many([sample(9), sample(10)])
        second.put_many([sample(5)])
    first.close()
    with DirectoryStore(d, readonly=True) as r:
        assert r.keys() == [sample(i).key for i in range(6)]
        assert all(r.get(sample(i).key).equals(sample(i)) for i in range(6))


# -- 5. the fault harness ----------------------------------------------------------------------------------
def test_the_fault_harness_finds_nothing_wrong(tmp_path):
    """4 seeded episodes of 13 steps, each fault kind 3 or 4 times (SIGKILLed writers, forked and
    lock-less writers included), then the edge inputs: ~30 s on a 2-core CPU. benchmarks/store.py
    --faults runs more."""
    result = store_faults.run(tmp_path, episodes=4, steps=13, seed=1)
    assert result["failures"] == [], "\n".join(result["failures"])
    counts = ("acknowledged_unreadable", "untyped_errors", "inspect_disagreements", "silent_coercions", "unnamed_refusals",
              "wrong_reads", "oracle_mismatches")
    assert {k: result[k] for k in counts} == dict.fromkeys(counts, 0)
    assert set(result["kinds"]) == set(store_faults.KINDS) and result["edge_inputs"]["calls"] > 80
    assert result["trials"] == 52 and result["kills_without_death"] < 4
    assert result["records_refused_by_name"] > 0 and result["chunk_copies"] > 0  # damage was done, and written past
    assert result["foreign_writes_refused"] == result["kinds"]["fork"]["trials"] + result["kinds"]["lock_theft"]["trials"]
