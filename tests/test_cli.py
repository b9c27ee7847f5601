"""CLI subcommands: `inspect` on a real DirectoryStore (with a damaged record), missing paths,
and `bench` over an injected folder of fake benchmark scripts (collected JSON, failures recorded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from moe_replay.cli import main
from moe_replay.codec import bound_bits_per_token_layer
from moe_replay.geometry import ModelGeometry
from moe_replay.report.bench import KNOWN_ORDER, default_benchmarks_dir
from moe_replay.codec.record import encode_trace
from moe_replay.store import DirectoryStore, UnindexedDamageError
from moe_replay.store import framing
from tests.test_store import flip
from tests.trace_factory import TINY_GEOMETRY, random_trace

REPO = Path(__file__).resolve().parents[1]
WIDE = ModelGeometry(num_layers=6, moe_layer_ids=(2, 3, 4, 5), num_experts=64, top_k=4, vocab_size=1000, family="wide")


def _traces(n: int = 30, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        random_trace(f"r{i:03d}", rng, geometry=WIDE if i % 3 == 0 else TINY_GEOMETRY,
                     num_tokens=int(rng.integers(8, 120)), with_support=i % 5 != 4, with_logprobs=i % 7 != 6)
        for i in range(n)
    ]


@pytest.fixture
def store_dir(tmp_path):
    path = tmp_path / "store"
    traces = _traces()
    with DirectoryStore(path, durable=False, segment_bytes=16 << 10) as store:
        store.put_many(traces)
    return path, traces


def _inspect_json(capsys, *args) -> tuple[int, dict, str]:
    code = main(["inspect", *map(str, args), "--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out), out.err


def test_inspect_summary_matches_the_traces(store_dir, capsys):
    path, traces = store_dir
    code, s, _ = _inspect_json(capsys, path)
    assert code == 0 and s["damaged"] == []
    assert s["records"] == s["records_indexed"] == len(traces)
    assert s["tokens"]["total"] == sum(t.num_tokens for t in traces)
    assert s["tokens"]["generated"] == sum(t.num_generated for t in traces)
    assert s["token_layers"] == sum(t.routes_TLK.shape[0] * t.routes_TLK.shape[1] for t in traces)
    assert s["parts"] == {"routes": len(traces), "support": sum(t.support is not None for t in traces),
                          "logprobs": sum(t.logprobs_G is not None for t in traces)}
    assert {g["geometry"]["family"]: g["records"] for g in s["geometries"]} == {"wide": 10, "tiny": 20}
    assert s["engines"] == [{"records": 30, "name": "test", "version": "0", "dtype": "bfloat16"}]

    sizes = np.concatenate([t.support.sizes_G() for t in traces if t.support is not None])
    ss = s["support_size"]
    assert ss["rows"] == len(sizes) and ss["max"] == sizes.max() and ss["mean"] == pytest.approx(sizes.mean())
    assert ss["p50"] == int(np.percentile(sizes, 50, method="inverted_cdf"))
    assert ss["p99"] == int(np.percentile(sizes, 99, method="inverted_cdf"))

    disk = s["disk"]
    files = [p for p in path.iterdir() if p.name == "index.bin" or p.name.startswith("seg-")]
    assert disk["index_bytes"] + disk["segment_bytes"] == sum(p.stat().st_size for p in files)
    assert disk["segments"] > 1  # small segment_bytes: several files
    codecs = s["route_codecs"]
    assert codecs["sample_records"] == len(traces)  # default sample (64) covers them all
    per = codecs["bytes_per_token_layer"]
    tl = {g: sum(t.routes_TLK.shape[0] * t.routes_TLK.shape[1] for t in traces if t.geometry == g) for g in (WIDE, TINY_GEOMETRY)}
    assert per["int32"] == pytest.approx(4 * (4 * tl[WIDE] + 2 * tl[TINY_GEOMETRY]) / sum(tl.values()))
    assert codecs["ratio_vs_int32"]["narrow"] == pytest.approx(0.25)
    bound = sum(bound_bits_per_token_layer(g.num_experts, g.top_k) * n for g, n in tl.items()) / sum(tl.values()) / 8
    assert per["bound"] == pytest.approx(bound)
    assert per["moe_replay"] < per["narrow"]


def test_inspect_sample_is_strided(store_dir, capsys):
    path, _ = store_dir
    _, s, _ = _inspect_json(capsys, path, "--sample", "4")
    assert s["route_codecs"]["sample_records"] == 4  # every 8th of 30 records
    _, s, _ = _inspect_json(capsys, path, "--sample", "0")
    assert s["route_codecs"] is None


def test_inspect_names_a_damaged_record(store_dir, capsys):
    path, traces = store_dir
    with DirectoryStore(path, readonly=True) as store:
        victim = traces[7].key
        entry = store._entries[victim]
    seg = path / f"seg-{entry.segment:06d}.bin"
    data = bytearray(seg.read_bytes())
    mid = entry.offset + 16 + entry.length // 2  # inside the record's payload
    data[mid : mid + 4] = bytes(b ^ 0xFF for b in data[mid : mid + 4])
    seg.write_bytes(bytes(data))

    code, s, err = _inspect_json(capsys, path)
    assert code == 1 and "1 damaged record" in err
    assert s["records"] == len(traces) - 1 and s["records_indexed"] == len(traces)
    assert [d["record"] for d in s["damaged"]] == [victim]
    assert s["damaged"][0]["error"] == "ChecksumError" and victim in s["damaged"][0]["message"]

    assert main(["inspect", str(path)]) == 1  # human tables name it too
    out = capsys.readouterr().out
    assert "damaged records" in out and victim in out and "ChecksumError" in out
    assert "moe_replay" in out and "bound" in out and "wide" in out


def test_inspect_missing_path_exits_2_naming_it(tmp_path):
    missing = tmp_path / "no" / "such-store"
    proc = subprocess.run([sys.executable, "-m", "moe_replay.cli", "inspect", str(missing)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert str(missing) in proc.stderr and "found nothing at that path" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


# -- inspect shows what a writer would recover and refuse ------------------------------------------
def _cut_index(path: Path, keep: int) -> None:
    """Cut index.bin after its first `keep` entries (as an index restored from an older copy)."""
    data, pos = (path / framing.INDEX_NAME).read_bytes(), framing.HEADER.size
    for _ in range(keep):
        pos += framing.ENTRY.size + framing.ENTRY.unpack_from(data, pos)[1] + framing.CRC.size
    os.truncate(path / framing.INDEX_NAME, pos)


def test_inspect_counts_records_past_a_cut_index(store_dir, capsys):
    """Index cut after 3 of 30 entries: the 27 intact records past it are read, counted in the
    figures per token, and a writer would index them again (exit 0: nothing is damaged)."""
    path, traces = store_dir
    _, whole, _ = _inspect_json(capsys, path)
    _cut_index(path, 3)
    code, s, _ = _inspect_json(capsys, path)
    assert code == 0 and s["damaged"] == [] and s["records"] == 30 and s["records_indexed"] == 3
    assert s["unindexed"]["records"] == 27 and s["unindexed"]["keys"] == [t.key for t in traces[3:23]]
    indexed_frames = sum(framing.FRAME.size + len(encode_trace(t)) for t in traces[:3])
    assert s["unindexed"]["bytes"] == s["disk"]["segment_bytes"] - s["disk"]["segments"] * framing.HEADER.size - indexed_frames
    assert s["writer"]["refuses"] is None and s["writer"]["recovers"] == 27
    tokens = sum(t.num_tokens for t in traces)
    assert s["tokens"]["total"] == tokens and s["disk"]["bytes_per_token"] == pytest.approx(s["disk"]["bytes"] / tokens)
    assert s["disk"]["bytes_per_token"] < whole["disk"]["bytes_per_token"]  # a shorter index, every record counted
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "27 intact that no index entry names" in out and "index 27 intact record(s) again" in out
    with DirectoryStore(path, durable=False) as w:  # what inspect said, a writer does
        assert w.recovery["records_recovered"] == [t.key for t in traces[3:]]


def test_inspect_names_damage_past_a_cut_index_and_the_writers_refusal(store_dir, capsys):
    """The index cut after 3 entries and the 4th record corrupt, intact records after it: inspect
    lists the damage and the writer's refusal (exit 1), and the command it names, `rescue`, copies
    the 29 intact records into a store that opens cleanly."""
    path, traces = store_dir
    with DirectoryStore(path, readonly=True) as r:
        e = r._entries[traces[3].key]
    _cut_index(path, 3)
    flip(path / framing.segment_name(e.segment), e.offset + framing.FRAME.size + e.length // 2)
    code, s, err = _inspect_json(capsys, path)
    assert code == 1 and "a writer would refuse to open (UnindexedDamageError)" in err
    assert s["records"] == 29 and s["records_indexed"] == 3 and s["unindexed"]["records"] == 26
    assert len(s["damaged"]) == 1 and s["damaged"][0]["file"] == str(path / framing.segment_name(e.segment))
    refused = s["writer"]["refuses"]
    assert refused["error"] == "UnindexedDamageError" and f"offset {e.offset}" in refused["where"]
    with pytest.raises(UnindexedDamageError):
        DirectoryStore(path)
    assert main(["inspect", str(path)]) == 1
    printed = capsys.readouterr()
    err, out = printed.err, " ".join(printed.out.replace("│", " ").split())
    assert f"moe-replay rescue {path} NEW_STORE" in err and "readonly=" not in err + out
    assert "refuse to open (UnindexedDamageError)" in out and "26 intact that no index entry names; 1 damaged" in out
    copy = path.parent / "copy"
    assert main(["rescue", str(path), str(copy)]) == 0
    assert json.loads(capsys.readouterr().out) == {"copied": 29, "unindexed": 26, "damaged": 1, "conflicts": []}
    code, s, _ = _inspect_json(capsys, copy)
    assert code == 0 and s["records"] == s["records_indexed"] == 29 and s["writer"]["refuses"] is None
    with DirectoryStore(copy, readonly=True) as r:
        assert [t.key for t in r] == [t.key for t in traces if t.key != traces[3].key]


def test_inspect_a_zero_byte_index_beside_intact_segments(store_dir, capsys):
    path, traces = store_dir
    os.truncate(path / framing.INDEX_NAME, 0)
    code, s, _ = _inspect_json(capsys, path)
    assert code == 0 and s["records"] == 30 and s["records_indexed"] == 0
    assert "16-byte header" in s["writer"]["rebuilds_index_header"] and s["writer"]["recovers"] == 30
    with DirectoryStore(path, durable=False) as w:
        assert len(w) == 30
    code, s, _ = _inspect_json(capsys, path)
    assert code == 0 and s["records_indexed"] == 30 and s["writer"]["recovers"] == 0


@pytest.mark.parametrize("make", ["empty_dir", "file", "memory"])
def test_inspect_not_a_store_exits_2(tmp_path, capsys, make):
    target = tmp_path / "x"
    if make == "empty_dir":
        target.mkdir()
    elif make == "file":
        target.write_text("hello")
    else:
        target = "memory://"
    assert main(["inspect", str(target)]) == 2
    err = capsys.readouterr().err
    assert str(target) in err and "Traceback" not in err


# -- bench -----------------------------------------------------------------------------------------
FAKE_BENCHMARKS = {
    "store": """
        import json, sys
        assert sys.argv[1:] == ["--json"], sys.argv
        print(json.dumps({"bytes_per_token_layer": {"int32": 32.0, "moe_replay": 3.1}}))
    """,
    "capture": """
        import json, sys
        print("warming up", flush=True)
        print("loading model ...", file=sys.stderr)
        print(json.dumps({"overhead": 0.02}))
    """,
    "replay": """
        import sys
        print("step 1 ok", file=sys.stderr)
        print("RuntimeError: replay exploded at layer 3", file=sys.stderr)
        sys.exit(3)
    """,
    "zz_nojson": """
        print("I forgot --json")
    """,
    "_helper": """
        raise SystemExit("a helper module, never run as a benchmark")
    """,
}


@pytest.fixture
def bench_dir(tmp_path):
    d = tmp_path / "benchmarks"
    d.mkdir()
    for name, body in FAKE_BENCHMARKS.items():
        (d / f"{name}.py").write_text(textwrap.dedent(body))
    return d


def test_bench_only_collects_json_and_records_failures(bench_dir, tmp_path, capsys):
    out = tmp_path / "results" / "bench.json"
    code = main(["bench", "--benchmarks-dir", str(bench_dir), "--only", "store,replay,capture", "--out", str(out)])
    assert code == 1  # one benchmark failed: recorded, not fatal
    results = json.loads(out.read_text())
    assert list(results) == ["store", "replay", "capture"]  # the order asked for
    assert results["store"] == {"bytes_per_token_layer": {"int32": 32.0, "moe_replay": 3.1}}
    assert results["capture"] == {"overhead": 0.02}  # the last JSON line of a chatty stdout
    failed = results["replay"]
    assert failed["failed"] is True and failed["returncode"] == 3
    assert "replay exploded at layer 3" in failed["stderr_tail"]
    err = capsys.readouterr().err
    assert "replay" in err and "FAILED" in err


def test_bench_default_runs_every_script_known_order_first(bench_dir, capsys):
    assert main(["bench", "--benchmarks-dir", str(bench_dir)]) == 1
    results = json.loads(capsys.readouterr().out)
    assert list(results) == ["store", "capture", "replay", "zz_nojson"]  # _helper skipped
    assert "printed no JSON" in results["zz_nojson"]["error"]


def test_bench_timeout_is_a_recorded_failure(tmp_path, capsys):
    d = tmp_path / "benchmarks"
    d.mkdir()
    (d / "slow.py").write_text("import time, sys\nprint('started', file=sys.stderr, flush=True)\ntime.sleep(30)\n")
    assert main(["bench", "--benchmarks-dir", str(d), "--timeout", "1"]) == 1
    result = json.loads(capsys.readouterr().out)["slow"]
    assert result["failed"] and "timed out" in result["error"]


def test_bench_children_start_a_world_of_their_own(tmp_path, monkeypatch, capsys):
    """A parent that ran a trainer in-process keeps its group listening at MASTER_PORT (TRL sets it):
    a benchmark that inherited it failed to bind its own group (EADDRINUSE)."""
    d = tmp_path / "benchmarks"
    d.mkdir()
    (d / "world.py").write_text("import json, os\nprint(json.dumps({k: os.environ.get(k) for k in "
                                "('MASTER_ADDR', 'MASTER_PORT', 'RANK', 'WORLD_SIZE', 'OTHER')}))\n")
    for var, val in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29781", "RANK": "0", "WORLD_SIZE": "1",
                     "OTHER": "kept"}.items():
        monkeypatch.setenv(var, val)
    assert main(["bench", "--benchmarks-dir", str(d)]) == 0
    seen = json.loads(capsys.readouterr().out)["world"]
    assert seen == {"MASTER_ADDR": None, "MASTER_PORT": None, "RANK": None, "WORLD_SIZE": None, "OTHER": "kept"}


def test_bench_bad_arguments_exit_2(bench_dir, tmp_path, capsys):
    assert main(["bench", "--benchmarks-dir", str(bench_dir), "--only", "store,estimator"]) == 2
    err = capsys.readouterr().err
    assert "'estimator'" in err and "available: store, capture, replay, zz_nojson" in err
    missing = tmp_path / "wheel-install" / "benchmarks"
    assert main(["bench", "--benchmarks-dir", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "source checkout" in err and "Traceback" not in err


def test_default_benchmarks_dir_is_the_checkouts():
    d = default_benchmarks_dir()
    assert d == REPO / "benchmarks" and (d / "store.py").exists()
    assert KNOWN_ORDER[0] == "store"
