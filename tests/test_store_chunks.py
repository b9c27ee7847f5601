"""Shared route chunks (store/chunks.py): the routes records share are stored once, every record
reads back bit-identical, routes that differ are never merged, a pipeline stage reads only its
layers, and chunks survive crashes and damage as records do (store format v2)."""

from __future__ import annotations

import shutil
from dataclasses import replace
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_replay.cli import main
from moe_replay.codec import decode_trace, encode_trace, record_chunks
from moe_replay.codec.chunk import read_meta
from moe_replay.errors import ChecksumError, PartialTraceError, TraceFormatError, Where
from moe_replay.geometry import ModelGeometry
from moe_replay.report.inspect import summarize_store
from moe_replay.store import ChunkMissingError, DirectoryStore, MemoryStore, compact_store, framing, rescue_store
from moe_replay.store.chunks import is_chunk_key, label
from moe_replay.trace import RolloutTrace, stitch
from tests.store_worker import SHARED_CHUNK_MIN_BYTES
from tests.trace_factory import random_routes, random_trace, shared_trace_for

REPO = Path(__file__).resolve().parents[1]
GOLDEN_STORE_V1 = REPO / "tests" / "golden" / "store_v1"
"""A store written by format v1 (frozen, at 5e94ee5): trace_for(0..3, seed=48), whole records."""
GOLDEN_STORE_V2 = REPO / "tests" / "golden" / "store_v2"
"""A store written by format v2 (frozen): group() put with SMALL, one prompt chunk and four completion chunks."""
SMALL = {"chunk_min_bytes": SHARED_CHUNK_MIN_BYTES}
"""Every run of a few rows becomes a chunk (the tiny geometry's routes are ~1 B a row)."""
WIDE = ModelGeometry(num_layers=18, moe_layer_ids=tuple(range(2, 18)), num_experts=64, top_k=4, vocab_size=70_000)
"""16 MoE layers after 2 dense ones (two pipeline stages of 8), ids in bytes, tokens in uint32."""


def make(kind: str, tmp_path: Path, **options):
    return MemoryStore(**options) if kind == "memory" else DirectoryStore(tmp_path / "s", **options)


def group(n: int = 4, prompt: int = 40) -> list[RolloutTrace]:
    return [shared_trace_for(i, prompt=prompt, group=n) for i in range(n)]


def turns(key: str, rng, geometry=WIDE, first: int = 60, tool: int = 20, gen: int = 24, count: int = 3) -> list[RolloutTrace]:
    """Per-turn records of one conversation: turn k's request re-sends the context (previous turns
    and a tool output) and samples `gen` tokens; its routes over the context are the earlier ones."""
    tokens = rng.integers(0, geometry.vocab_size, first)
    routes = random_routes(rng, first + count * (tool + gen), geometry)
    out = []
    for k in range(count):
        if k:
            tokens = np.concatenate([tokens, rng.integers(0, geometry.vocab_size, tool)])
        prompt = len(tokens)
        tokens = np.concatenate([tokens, rng.integers(0, geometry.vocab_size, gen)])
        out.append(RolloutTrace(f"{key}/turn{k + 1}", tokens, prompt, geometry, routes_TLK=routes[:len(tokens) - 1],
                                logprobs_G=-rng.random(gen).astype(np.float32)).validate())
    return out


def fragment(turn: RolloutTrace, previous: RolloutTrace) -> RolloutTrace:
    """`turn` as a multi-turn fragment: only the routes the previous turn did not have."""
    start = previous.num_tokens - 1
    return RolloutTrace(turn.key, turn.token_ids_S, turn.prompt_len, turn.geometry, routes_TLK=turn.routes_TLK[start:],
                        route_start=start, logprobs_G=turn.logprobs_G).validate()


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


# -- stored once, read back exactly -------------------------------------------------------------
@pytest.mark.parametrize("kind", ["memory", "directory"])
def test_n_samples_of_a_prompt_share_its_chunk_and_read_back_exactly(kind, tmp_path):
    traces = group()
    store = make(kind, tmp_path, **SMALL)
    store.put_many(traces)
    assert store.keys() == [t.key for t in traces] and len(store) == 4 and traces[0].key in store
    assert all(a.equals(b) for a, b in zip(store.get_many(store.keys()), traces))
    if kind == "directory":
        chunks = store.chunk_keys()
        refs = [store.record_chunks(t.key) for t in traces]
        assert len({r[0] for r in refs}) == 1 and refs[0][0].startswith("\x000:40:")  # one prompt chunk, rows 0..39
        assert len(chunks) == 1 + 4 and all(is_chunk_key(k) for k in chunks) and not any(k in store for k in chunks)
        store.close()
        with DirectoryStore(tmp_path / "s", readonly=True) as r:
            assert all(a.equals(b) for a, b in zip(r, traces)) and r.stats.chunk_cache_hits == 3  # prompt decoded once
    store.close()


def test_sharing_pays_where_routes_are_large_and_costs_nothing_where_they_are_not(tmp_path):
    rng = np.random.default_rng(3)
    convs = [t for i in range(2) for t in turns(f"c{i}", rng, first=300, tool=150, gen=150)]
    sizes = {}
    for name, opts in (("whole", {"share_prefixes": False}), ("shared", {"chunk_min_bytes": 1024})):
        with DirectoryStore(tmp_path / name, durable=False, **opts) as s:
            s.put_many(convs)
        sizes[name] = dir_bytes(tmp_path / name)
    assert sizes["shared"] < 0.6 * sizes["whole"]  # each turn re-sent the context: written once here
    with DirectoryStore(tmp_path / "default", durable=False) as s:  # default threshold: short tiny records stay whole
        s.put_many(group())
        assert s.chunk_keys() == []


def test_turns_fragments_and_the_stitched_conversation_share_chunks(tmp_path):
    rng = np.random.default_rng(4)
    t1, t2, t3 = turns("conv", rng)
    stitched = replace(stitch(stitch(t1, fragment(t2, t1)), fragment(t3, t2)), key="conv")
    with DirectoryStore(tmp_path / "s", **SMALL) as s:
        s.put_many([t1, t2, t3])
        before = set(s.chunk_keys())
        s.put(stitched)
        assert set(s.chunk_keys()) == before  # the stitched record names the turns' chunks only
        assert s.get(stitched.key).equals(stitched) and s.get(t3.key).equals(t3)
        frag = fragment(t3, t2)
        s.put(RolloutTrace("frag3", frag.token_ids_S, frag.prompt_len, frag.geometry, routes_TLK=frag.routes_TLK,
                           route_start=frag.route_start, logprobs_G=frag.logprobs_G))
        assert set(s.chunk_keys()) == before and s.get("frag3").route_start == t2.num_tokens - 1
        assert set(s.record_chunks("frag3")) <= before


def test_routes_that_differ_on_one_prefix_are_never_merged(tmp_path):
    a, b = group(2)
    b.routes_TLK[5, 0] = b.routes_TLK[5, 0][::-1]  # same tokens, another top-k order on one row (batch-variant numerics)
    c = shared_trace_for(2, group=4)  # same prompt routes, other weights: another computation
    c.weights_version = "step-2"
    d = shared_trace_for(3, group=4)
    with DirectoryStore(tmp_path / "s", **SMALL) as s:
        s.put_many([a, b, c, d])
        first = {k: s.record_chunks(k)[0] for k in s.keys()}
        assert len({first[a.key], first[b.key], first[c.key]}) == 3 and first[d.key] in (first[a.key], first[b.key])
        assert all(s.get(t.key).equals(t) for t in (a, b, c, d))


# -- per-rank reads ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["memory", "directory"])
def test_a_pipeline_stage_reads_only_its_layers(kind, tmp_path):
    rng = np.random.default_rng(5)
    convs = turns("c0", rng, first=300, tool=150, gen=150)
    store = make(kind, tmp_path, chunk_min_bytes=256)
    store.put_many(convs)
    stages = (WIDE.moe_layer_ids[:8], WIDE.moe_layer_ids[8:])
    for t in convs:
        for stage in stages:
            part = store.get(t.key, layers=stage)
            assert part.route_layer_ids == stage and part.route_layers == stage
            cols = [WIDE.moe_layer_ids.index(i) for i in stage]
            assert np.array_equal(part.routes_TLK, t.routes_TLK[:, cols]) and part.token_ids_S.tobytes() == t.token_ids_S.tobytes()
        odd = store.get(t.key, layers=[3, 8])  # not contiguous: the layers between are read, not returned
        assert np.array_equal(odd.routes_TLK, t.routes_TLK[:, [1, 6]]) and odd.route_layer_ids == (3, 8)
        assert store.get(t.key, layers=WIDE.moe_layer_ids).equals(t)  # every layer: the whole trace
    with pytest.raises(PartialTraceError, match="route_layer_ids"):
        encode_trace(part)
    with pytest.raises(PartialTraceError, match="stitch needs whole traces"):
        stitch(store.get(convs[0].key, layers=stages[0]), convs[1])
    with pytest.raises(TraceFormatError, match="field 'layers'.*MoE layer ids"):
        store.get(convs[0].key, layers=[1])  # a dense layer
    store.close()
    if kind == "directory":
        reads = []
        for stage in (None, *stages):
            with DirectoryStore(tmp_path / "s", readonly=True) as r:
                for t in convs:
                    r.get(t.key, layers=stage)
                reads.append(r.stats.by_kind["chunks"])
        # half the layers: half the route bytes, plus the chunks' heads and tokens every stage reads (~8% here:
        # 4-byte tokens against ~50 bytes of routes a row; ~1% at Qwen3-30B-A3B's 48 layers, benchmarks/store.py)
        assert all(0.45 < stage / reads[0] < 0.6 for stage in reads[1:]) and sum(reads[1:]) < 1.2 * reads[0], reads


def test_a_stage_plan_holds_its_layers_and_refuses_the_others(tmp_path):
    from moe_replay.replay import build_plan

    traces = group()
    with DirectoryStore(tmp_path / "s", **SMALL) as s:
        s.put_many(traces)
        stage = s.get_many(s.keys(), layers=[3])
    full, part = build_plan(traces, traces[0].geometry), build_plan(stage, traces[0].geometry, layers=[3])
    assert tuple(part.layer_index) == (3,) and torch.equal(part.layer_ids(3), full.layer_ids(3))
    assert torch.equal(part.input_ids_BS, full.input_ids_BS) and torch.equal(part.target_G, full.target_G)
    with pytest.raises(PartialTraceError, match="layer_ids.*plan's layers \\[3\\].*found 1"):
        part.layer_ids(1)
    with pytest.raises(PartialTraceError, match="build_plan without layers="):
        build_plan(stage, traces[0].geometry)
    with pytest.raises(PartialTraceError, match="none for \\[1\\]"):
        build_plan(stage, traces[0].geometry, layers=[1, 3])


# -- crashes and damage -------------------------------------------------------------------------------
def test_writer_killed_mid_commit_leaves_readable_records_and_reusable_chunks(tmp_path):
    """A SIGKILL half-way through a commit's frames (chunks and records in one write) or its index
    entries: every record that reads is whole; the next writer recovers or cuts, then stores the
    rest of the stream, sharing what survived."""
    d = tmp_path / "s"
    repaired = []
    for kill in ("frames:2", "index:2", "frames:3"):
        with DirectoryStore(d, **SMALL) as w:
            start = len(w)
            repaired.append(w.recovery)
        cmd = [sys.executable, "-m", "tests.store_worker", "append-shared", str(d), str(start), "-1", "6", "1", "4096", kill]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        with DirectoryStore(d, readonly=True) as r:
            keys = r.keys()
            assert keys == [shared_trace_for(i).key for i in range(len(keys))]
            assert all(t.equals(shared_trace_for(i)) for i, t in enumerate(r))
    with DirectoryStore(d, **SMALL) as w:
        repaired.append(w.recovery)
        n = len(w)
        w.put_many([shared_trace_for(i) for i in range(n, n + 8)])
    assert any("segment_bytes_truncated" in r for r in repaired) and any("index_bytes_truncated" in r for r in repaired)
    assert any(is_chunk_key(k) for r in repaired for k in r.get("records_recovered", []))  # a chunk outlived its record
    with DirectoryStore(d, readonly=True) as r:
        assert [t.key for t in r] == [shared_trace_for(i).key for i in range(n + 8)] and r.scan()[1] == []
        assert all(t.equals(shared_trace_for(i)) for i, t in enumerate(r))


def test_a_damaged_chunk_refuses_exactly_the_records_naming_it(tmp_path, capsys):
    traces = group(4) + [shared_trace_for(i) for i in range(4, 6)]  # two prompt groups
    d = tmp_path / "s"
    with DirectoryStore(d, **SMALL) as s:
        s.put_many(traces)
        prompt = s.record_chunks(traces[0].key)[0]
        entry = s._entries[prompt]
    seg = d / framing.segment_name(entry.segment)
    data = bytearray(seg.read_bytes())
    at = entry.offset + framing.FRAME.size
    meta = read_meta(bytes(data[at:at + entry.length]), Where())
    last = meta.layer_range(1, 2)  # the bytes of the second MoE layer (id 3) of the prompt's chunk
    data[at + (last[0] + last[1]) // 2] ^= 0x40
    seg.write_bytes(bytes(data))
    with DirectoryStore(d, readonly=True) as r:
        good, bad = r.scan()
        assert good == [t.key for t in traces[4:]]
        assert sorted(e.where.record for e in bad) == sorted(t.key for t in traces[:4])
        assert all(isinstance(e, ChecksumError) and e.where.field.startswith(label(prompt)) for e in bad)
        named = rf"{seg.name}', record '{traces[1].key}', field '{label(prompt)} at offset {entry.offset}"  # chunk, segment, offset
        with pytest.raises(ChecksumError, match=rf"{named}: frame.crc32'"):
            r.get(traces[1].key)
        part = r.get(traces[1].key, layers=[1])  # a stage of layer 1 reads and checks its own bytes only
        assert np.array_equal(part.routes_TLK[:, 0], traces[1].routes_TLK[:, 0])
        with pytest.raises(ChecksumError, match=rf"{named}: chunk layer 1 crc32'"):
            r.get(traces[1].key, layers=[3])
    with DirectoryStore(d, readonly=True, survey=True) as r:
        summary = summarize_store(r, sample=0)
        (damaged,) = summary["chunks"]["damaged"]
        assert (damaged["chunk"], damaged["segment"], damaged["offset"]) == (label(prompt), seg.name, entry.offset)
        assert damaged["records"] == sorted(t.key for t in traces[:4]) and damaged["error"] == "ChecksumError"
        assert summary["writer"]["refuses_to_reuse_chunks"] == [label(prompt)]
        assert summary["chunks"]["chunks"] == 1 + 6 + 1
    assert main(["inspect", str(d)]) == 1  # the tables name the chunk and the records it refuses
    out = capsys.readouterr().out
    assert "damaged chunks" in out and label(prompt) in out and traces[3].key in out
    report = rescue_store(d, tmp_path / "rescued")
    assert report.copied == 2 and len(report.damaged) == 4
    with DirectoryStore(tmp_path / "rescued", readonly=True) as r:
        assert all(a.equals(b) for a, b in zip(r, traces[4:]))


def test_a_lost_chunk_is_named_by_the_records_that_need_it(tmp_path):
    traces = group(2)
    with DirectoryStore(tmp_path / "s", **SMALL) as s:
        s.put_many(traces)
        prompt = s.record_chunks(traces[0].key)[0]
        del s._entries[prompt]  # as if its entry and frame were gone
        with pytest.raises(ChunkMissingError, match=rf"record '{traces[0].key}', field '{label(prompt)}'.*no such chunk"):
            s.get(traces[0].key)
    with pytest.raises(TraceFormatError, match="field 'route_chunks'.*chunk source"):
        decode_trace(encode_trace(traces[0], chunks=[(0, 40, prompt)]))


def test_compaction_keeps_only_the_chunks_the_kept_records_name(tmp_path):
    traces = [shared_trace_for(i) for i in range(8)]  # two prompt groups of four
    with DirectoryStore(tmp_path / "s", **SMALL) as s:
        s.put_many(traces)
        assert len(s.chunk_keys()) == 2 + 8
    report = compact_store(tmp_path / "s", tmp_path / "c", keys=[t.key for t in traces[4:6]], **SMALL)
    assert (report.copied, report.dropped, report.chunks_before, report.chunks_after) == (2, 6, 10, 3)
    assert report.bytes_after < report.bytes_before / 2
    with DirectoryStore(tmp_path / "c", readonly=True) as c:
        assert c.keys() == [traces[4].key, traces[5].key] and all(a.equals(b) for a, b in zip(c, traces[4:6]))


# -- formats ---------------------------------------------------------------------------------------
def test_a_format_v1_store_still_reads_and_stays_v1(tmp_path):
    from tests.trace_factory import trace_for

    want = [trace_for(i, seed=48) for i in range(4)]
    with DirectoryStore(GOLDEN_STORE_V1, readonly=True) as r:
        assert r.format_version == 1 and not r.chunked
        assert all(a.equals(b) for a, b in zip(r, want)) and r.get(want[1].key, layers=[3]).route_layer_ids == (3,)
    d = tmp_path / "v1"
    shutil.copytree(GOLDEN_STORE_V1, d)
    with DirectoryStore(d, **SMALL) as w:  # a writer keeps the layout the store says it has
        w.put_many(group(2))
        assert w.format_version == 1 and w.chunk_keys() == []
    with DirectoryStore(d, readonly=True) as r:
        assert len(r) == 6 and all(t.equals(g) for t, g in zip(list(r)[4:], group(2)))
        assert all(not record_chunks(bytes(r._read_frame(e, k, Where()))) for k, e in r._entries.items())
    report = rescue_store(d, tmp_path / "v2")  # the way to the new layout
    with DirectoryStore(tmp_path / "v2", readonly=True) as r:
        assert report.copied == 6 and r.format_version == framing.FORMAT_VERSION


def test_a_format_v2_store_with_shared_chunks_still_reads():
    with DirectoryStore(GOLDEN_STORE_V2, readonly=True) as r:
        assert r.format_version == 2 and len(r.chunk_keys()) == 5
        assert all(a.equals(b) for a, b in zip(r, group())) and r.stats.chunk_cache_hits == 3


def test_a_record_key_may_not_look_like_a_chunk_key(tmp_path):
    t = random_trace("\x00sneaky", np.random.default_rng(0))
    for store in (MemoryStore(), DirectoryStore(tmp_path / "s")):
        with pytest.raises(TraceFormatError, match="key.*route chunks"):
            store.put(t)
        store.close()
