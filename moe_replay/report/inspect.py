"""`moe-replay inspect`: what a trace store holds, what it costs on disk, what is damaged, and
what a writer opening it would recover, cut or refuse.

One pass over the store (each record read, checksummed and decoded once, as `scan()` does), with
bounded memory: support sizes go into a histogram, and only a strided sample of records is
re-encoded with every route codec to compare bytes per token-layer. A directory store opened with
`survey=True` (the CLI does) also yields the intact records no index entry names, so the figures
per token count every record the segments hold, and `writer` says what the next writer would do.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..codec import ROUTE_CODECS, bound_bits_per_token_layer
from ..errors import TraceError
from ..store import TraceStore
from ..store.chunks import label
from ..trace import RolloutTrace

DEFAULT_SAMPLE = 64
"""Records re-encoded with each route codec (evenly spaced over the store)."""


class _Stats:
    """Running totals over the records of a store."""

    def __init__(self, num_records: int, sample: int) -> None:
        self.records = 0
        self.tokens = self.generated = self.token_layers = 0
        self.geometries: Counter[str] = Counter()
        self.engines: Counter[tuple[str, str, str]] = Counter()
        self.parts = {"routes": 0, "support": 0, "logprobs": 0}
        self.support_hist = np.zeros(0, dtype=np.int64)
        self.stride = max(1, math.ceil(num_records / sample)) if sample > 0 else 0
        self.codec_bytes: Counter[str] = Counter()
        self.codec_token_layers = 0
        self.codec_records = 0
        self.bound_bits = 0.0
        self.route_dtypes: set[str] = set()

    def add(self, trace: RolloutTrace, index: int) -> None:
        g = trace.geometry
        self.records += 1
        self.tokens += trace.num_tokens
        self.generated += trace.num_generated
        self.geometries[json.dumps(g.to_dict(), sort_keys=True)] += 1
        self.engines[(trace.engine.name, trace.engine.version, trace.engine.dtype)] += 1
        if trace.routes_TLK is not None:
            self.parts["routes"] += 1
            t, l, _ = trace.routes_TLK.shape
            self.token_layers += t * l
            if self.stride and index % self.stride == 0 and t * l:
                self._encode_sample(trace)
        if trace.support is not None:
            self.parts["support"] += 1
            sizes = trace.support.kept_sizes_G(trace.geometry.vocab_size)  # rows kept whole count V
            if len(sizes):
                counts = np.bincount(sizes)
                if len(counts) > len(self.support_hist):
                    self.support_hist = np.pad(self.support_hist, (0, len(counts) - len(self.support_hist)))
                self.support_hist[: len(counts)] += counts
        if trace.logprobs_G is not None:
            self.parts["logprobs"] += 1

    def _encode_sample(self, trace: RolloutTrace) -> None:
        g = trace.geometry
        t, l, _ = trace.routes_TLK.shape
        for name in ROUTE_CODECS.names():
            data, _ = ROUTE_CODECS.get(name).encode(trace.routes_TLK, g.num_experts)
            self.codec_bytes[name] += len(data)
        self.codec_token_layers += t * l
        self.codec_records += 1
        self.bound_bits += bound_bits_per_token_layer(g.num_experts, g.top_k) * t * l
        self.route_dtypes.add(str(g.route_dtype))


def _hist_stats(hist: np.ndarray) -> dict[str, Any] | None:
    n = int(hist.sum())
    if n == 0:
        return None
    values = np.arange(len(hist))
    cum = np.cumsum(hist)

    def pct(q: float) -> int:
        return int(np.searchsorted(cum, q * n, side="left"))

    return {
        "rows": n,
        "mean": float((hist * values).sum() / n),
        "p50": pct(0.5),
        "p99": pct(0.99),
        "max": int(values[hist > 0].max()),
    }


def store_disk_bytes(store: TraceStore) -> dict[str, Any] | None:
    """Bytes of the store's files (index, segments, other) or None for a store with no directory."""
    path = getattr(store, "path", None)
    if path is None or not Path(path).is_dir():
        return None
    index = segments = other = 0
    num_segments = 0
    for p in Path(path).iterdir():
        if not p.is_file():
            continue
        size = p.stat().st_size
        if p.name == "index.bin":
            index += size
        elif p.name.startswith("seg-") and p.name.endswith(".bin"):
            segments += size
            num_segments += 1
        else:
            other += size
    return {"bytes": index + segments + other, "index_bytes": index, "segment_bytes": segments,
            "segments": num_segments, "other_bytes": other}


def summarize_store(
    store: TraceStore, *, sample: int = DEFAULT_SAMPLE, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """A JSON-able summary of `store` (see `moe-replay inspect --help` for the fields)."""
    if sample < 0:
        raise ValueError(f"sample must be >= 0 records, got {sample}")
    total = len(store)
    bad: list[TraceError] = []
    stats = _Stats(total, sample)
    if hasattr(store, "iter"):
        traces = store.iter(errors="skip", on_error=bad.append)
    else:  # a store without skip-and-report iteration: scan() first for the errors, then read the good keys
        good, bad = store.scan()
        traces = (store.get(k) for k in good)
    for i, trace in enumerate(traces):
        stats.add(trace, i)
        if progress is not None:
            progress(i + 1 + len(bad), total)

    chunks = _chunk_summary(store)
    recovery = getattr(store, "recovery", {}) if getattr(getattr(store, "options", None), "survey", False) else None
    unindexed = list(recovery.get("records_unindexed", [])) if recovery is not None else []
    disk = store_disk_bytes(store)
    if disk is not None:
        disk["bytes_per_token"] = disk["bytes"] / stats.tokens if stats.tokens else None
        disk["bytes_per_token_layer"] = disk["bytes"] / stats.token_layers if stats.token_layers else None

    codecs = None
    if stats.codec_token_layers:
        tl = stats.codec_token_layers
        # largest first (int32 ... entropy coded), the bound last
        names = sorted(ROUTE_CODECS.names(), key=lambda n: -stats.codec_bytes[n])
        per = {name: stats.codec_bytes[name] / tl for name in names}
        per["bound"] = stats.bound_bits / tl / 8
        base = per.get("int32")
        codecs = {
            "sample_records": stats.codec_records,
            "sample_token_layers": tl,
            "narrow_dtype": ",".join(sorted(stats.route_dtypes)),
            "bytes_per_token_layer": per,
            "ratio_vs_int32": {k: (v / base if base else None) for k, v in per.items()},
        }

    return {
        "store": str(getattr(store, "path", getattr(store, "name", repr(store)))),
        "kind": type(store).__name__,
        "records": stats.records,
        "records_indexed": total - len(unindexed),
        "unindexed": None if recovery is None else {
            "bytes": recovery.get("unindexed_bytes", 0), "records": len(unindexed), "keys": unindexed[:MAX_KEYS_SHOWN],
        },
        "writer": None if recovery is None else _writer_summary(recovery, chunks),
        "tokens": {"total": stats.tokens, "prompt": stats.tokens - stats.generated, "generated": stats.generated},
        "token_layers": stats.token_layers,
        "geometries": [{"records": n, "geometry": json.loads(g)} for g, n in stats.geometries.most_common()],
        "engines": [
            {"records": n, "name": name, "version": version, "dtype": dtype}
            for (name, version, dtype), n in stats.engines.most_common()
        ],
        "parts": stats.parts,
        "support_size": _hist_stats(stats.support_hist),
        "disk": disk,
        "route_codecs": codecs,
        "chunks": chunks,
        "damaged": [
            {"record": err.where.record, "file": err.where.file, "field": err.where.field,
             "error": type(err).__name__, "message": str(err)}
            for err in bad
        ],
    }


MAX_KEYS_SHOWN = 20
"""Keys of unindexed records listed in the summary (the count is always whole)."""


def _chunk_summary(store: TraceStore) -> dict[str, Any] | None:
    """The shared route chunks of a directory store (store/chunks.py): how many, their bytes, how
    often records name them, every damaged chunk (each chunk's frame is checked, as a writer checks
    it before naming it: not only those some record read hit) with the records it refuses, and the
    chunks records name that the store does not hold."""
    if not getattr(store, "chunked", False):
        return None
    keys = store.chunk_keys()  # type: ignore[attr-defined]
    naming: dict[str, list[str]] = {}
    records = 0
    for key in store.keys():
        try:
            refs = store.record_chunks(key)  # type: ignore[attr-defined]
        except TraceError:  # the record's own frame is damaged: listed with the damaged records
            continue
        records += bool(refs)
        for ref in refs:
            naming.setdefault(ref, []).append(key)
    damaged = []
    for key in keys:
        err = store.check_chunk(key)  # type: ignore[attr-defined]
        if err is not None:
            segment, offset = store.locate(key)  # type: ignore[attr-defined]
            damaged.append({"chunk": label(key), "segment": segment, "offset": offset, "error": type(err).__name__,
                            "message": str(err), "records": sorted(naming.get(key, []))})
    stored = set(keys)
    missing = [{"chunk": label(k), "records": sorted(r)} for k, r in naming.items() if k not in stored]
    return {
        "chunks": len(keys), "bytes": store.chunk_bytes(),  # type: ignore[attr-defined]
        "records_naming_chunks": records, "references": sum(len(r) for r in naming.values()),
        "unreferenced": sum(1 for k in keys if k not in naming),
        "damaged": sorted(damaged, key=lambda d: d["chunk"]),
        "missing": sorted(missing, key=lambda d: d["chunk"]),
    }


def _writer_summary(recovery: dict[str, Any], chunks: dict[str, Any] | None) -> dict[str, Any]:
    """What a writer opening the store would do, from a survey reader's `recovery` and the chunk
    scan (a writer checks each stored chunk before a record names it and never names a damaged one)."""
    refused = recovery.get("refused")
    header = recovery.get("index_header_damaged")
    return {
        "refuses": None if refused is None else {
            "error": type(refused).__name__, "message": str(refused), "where": str(refused.where),
            "expected": str(refused.expected), "found": str(refused.found),
        },
        "recovers": len(recovery.get("records_recovered", [])),
        "creates_index": bool(recovery.get("index_missing")),
        "rebuilds_index_header": None if header is None else str(header),
        "rewrites_index": "index_rewritten" in recovery,
        "cuts_index_bytes": recovery.get("index_bytes_truncated", 0),
        "cuts_segment_bytes": recovery.get("segment_bytes_truncated", 0),
        "removes_files": list(recovery.get("files_removed", [])),
        "skips_damaged_segment": recovery.get("damaged_segment"),
        "refuses_to_reuse_chunks": [] if chunks is None else [d["chunk"] for d in chunks["damaged"]],
    }


def writer_would(w: dict[str, Any], store: str = "STORE") -> str:
    """One line: what the writer summary says a writer opening the store would do."""
    if w["refuses"] is not None:
        r = w["refuses"]
        return (f"refuse to open ({r['error']}): {r['where']}: expected {r['expected']}, found {r['found']}; "
                f"to keep every intact record, copy them to a new store: moe-replay rescue {store} NEW_STORE")
    acts = []
    if w["creates_index"]:
        acts.append("create index.bin (absent) and index the segments' intact records again")
    if w["rebuilds_index_header"]:
        acts.append("rebuild index.bin, whose header is damaged, from the segments")
    if w["recovers"]:
        acts.append(f"index {w['recovers']:,} intact record(s) again")
    if w["rewrites_index"] and not w["rebuilds_index_header"]:
        acts.append("rewrite the index")
    if w["cuts_index_bytes"]:
        acts.append(f"cut {w['cuts_index_bytes']:,} torn index byte(s)")
    if w["cuts_segment_bytes"]:
        acts.append(f"cut {w['cuts_segment_bytes']:,} torn segment byte(s) (no intact frame follows them)")
    if w["removes_files"]:
        acts.append(f"remove {', '.join(w['removes_files'])}")
    if w["skips_damaged_segment"]:
        acts.append(f"append to a new segment: {w['skips_damaged_segment']}")
    if w["refuses_to_reuse_chunks"]:
        names = w["refuses_to_reuse_chunks"]
        shown = ", ".join(names[:4]) + (f" (+{len(names) - 4})" if len(names) > 4 else "")
        acts.append(f"never name the {len(names)} damaged chunk(s) ({shown}): a new record holding their rows gets "
                    "a new copy of them")
    return "; ".join(acts) if acts else "open it as it is (nothing to recover)"


def _mib(n: int) -> str:
    return f"{n:,} B ({n / 2**20:.2f} MiB)"


def print_store_summary(summary: dict[str, Any], file=None) -> None:
    """The summary as rich tables (plain text without rich)."""
    from .tables import fmt, print_table

    s = summary
    tok = s["tokens"]
    rows: list[list[Any]] = [
        ["store", f"{s['store']} ({s['kind']})"],
        ["records", f"{s['records']:,} readable: {s['records_indexed']:,} indexed"
                    + (f", {s['unindexed']['records']:,} intact that no index entry names" if s["unindexed"] else "")
                    + (f"; {len(s['damaged'])} damaged" if s["damaged"] else "")],
        ["tokens", f"{tok['total']:,} ({tok['prompt']:,} prompt, {tok['generated']:,} generated)"],
        ["routed token-layers", f"{s['token_layers']:,}"],
        ["parts present", ", ".join(f"{k} {v:,}/{s['records']:,}" for k, v in s["parts"].items())],
    ]
    if s["unindexed"] is not None:
        rows.append(["segment bytes no index entry names", f"{s['unindexed']['bytes']:,} B"])
    if s["writer"] is not None:
        rows.append(["a writer opening it would", writer_would(s["writer"], s["store"])])
    if s["chunks"] is not None:
        c = s["chunks"]
        rows.append(["shared route chunks", f"{c['chunks']:,} ({c['bytes']:,} B), named {c['references']:,} times by "
                                            f"{c['records_naming_chunks']:,} records; {c['unreferenced']:,} unreferenced"
                                            + (f"; {len(c['damaged'])} damaged" if c["damaged"] else "")
                                            + (f"; {len(c['missing'])} named but missing" if c["missing"] else "")])
    if s["support_size"]:
        ss = s["support_size"]
        rows.append(["support size (tokens kept per row)",
                     f"mean {ss['mean']:.2f}, p50 {ss['p50']}, p99 {ss['p99']}, max {ss['max']} over {ss['rows']:,} rows"])
    if s["disk"]:
        d = s["disk"]
        rows.append(["on disk", f"{_mib(d['bytes'])}: index {d['index_bytes']:,} B, {d['segments']} segment(s) "
                                f"{d['segment_bytes']:,} B" + (f", other {d['other_bytes']:,} B" if d["other_bytes"] else "")])
        if d["bytes_per_token"] is not None:
            rows.append(["on disk per token", f"{d['bytes_per_token']:.2f} B (all parts, every readable record)"])
        if d["bytes_per_token_layer"] is not None:
            rows.append(["on disk per token-layer", f"{d['bytes_per_token_layer']:.3f} B (all parts)"])
    print_table("trace store", ["", "value"], rows, file=file, numeric=[False, False])

    if s["geometries"]:
        print_table(
            "geometries", ["records", "family", "layers", "MoE layers", "experts", "top-k", "vocab"],
            [[g["records"], g["geometry"]["family"] or "-", g["geometry"]["num_layers"], _layers(g["geometry"]["moe_layer_ids"]),
              g["geometry"]["num_experts"], g["geometry"]["top_k"], g["geometry"]["vocab_size"]] for g in s["geometries"]],
            file=file, numeric=[True, False, True, False, True, True, True],
        )
    if s["engines"]:
        print_table("engines", ["records", "engine", "version", "dtype"],
                    [[e["records"], e["name"], e["version"] or "-", e["dtype"]] for e in s["engines"]],
                    file=file, numeric=[True, False, False, False])
    if s["route_codecs"]:
        c = s["route_codecs"]
        labels = {"narrow": f"narrow ({c['narrow_dtype']} ids)", "bound": "bound log2(E!/(E-K)!)/8"}
        print_table(
            f"route bytes per token-layer (re-encoded sample: {c['sample_records']:,} records, "
            f"{c['sample_token_layers']:,} token-layers)",
            ["codec", "B / token-layer", "vs int32"],
            [[labels.get(k, k), fmt(v), f"{c['ratio_vs_int32'][k]:.3f}x"] for k, v in c["bytes_per_token_layer"].items()],
            file=file, numeric=[False, True, True],
        )
    if s["chunks"] is not None and (s["chunks"]["damaged"] or s["chunks"]["missing"]):
        c = s["chunks"]
        print_table("damaged chunks and missing chunks (each refuses the records naming it)", ["chunk", "where", "error", "records"],
                    [[d["chunk"], f"{d['segment']} at offset {d['offset']}", d["error"], _keys(d["records"])] for d in c["damaged"]]
                    + [[d["chunk"], "not in the store", "ChunkMissingError", _keys(d["records"])] for d in c["missing"]],
                    file=file, numeric=[False, False, False, False])
    if s["damaged"]:
        print_table("damaged records", ["record", "error", "message"],
                    [[d["record"] or _unkeyed(d["file"]), d["error"], d["message"]] for d in s["damaged"]],
                    file=file, numeric=[False, False, False])


def _keys(keys: list[str], shown: int = 8) -> str:
    return ", ".join(keys[:shown]) + (f" (+{len(keys) - shown})" if len(keys) > shown else "") if keys else "(none)"


def _unkeyed(file: str | None) -> str:
    """Label of damage no key names: an index entry, or segment bytes no entry names."""
    return "(index entry)" if file is not None and Path(file).name == "index.bin" else "(segment bytes no entry names)"


def _layers(ids: list[int]) -> str:
    if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]} ({len(ids)})"
    return ",".join(map(str, ids)) if len(ids) <= 8 else f"{ids[0]},{ids[1]},..,{ids[-1]} ({len(ids)})"
