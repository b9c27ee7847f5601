"""`moe-replay audit MODEL ROUTES`: the audit from the command line (moe_replay/cli.py registers it).

ROUTES is one of:
  * a trace store directory (the project's own capture; `--limit` records, in key order);
  * a JSON Lines file, one request per line, as the engine returned it: `{"token_ids": [...],
    "routed_experts": ...}` with vLLM's nested [S - 1 - start, layers, K] list and
    `"routed_experts_prompt_start"`, or SGLang's base64 string and `"routed_experts_start_len"` (the
    format is told by the payload's type unless `--format` says it);
  * an .npz file of verl's batch fields: `routed_experts` [B, S, L, K], `input_ids` [B, S], `attention_mask`.

MODEL is a Hugging Face checkpoint directory, loaded in `--dtype` (the trainer's precision). Prints the
verdict (`--json`: the whole report as JSON); exit status 0 when the routes line up, 1 when they do not,
2 when the input cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="Hugging Face checkpoint directory (the trainer's model)")
    p.add_argument("routes", metavar="ROUTES", help="trace store directory, JSON Lines of engine outputs, or verl .npz")
    p.add_argument("--format", choices=("trace", "vllm", "sglang", "verl"), default=None,
                   help="how ROUTES holds the routes (default: told by the file)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="precision of the audit's forward (default float32)")
    p.add_argument("--limit", type=int, default=64, metavar="N", help="records read from a store (default 64)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def read(path: Path, fmt: str | None, limit: int) -> tuple[Any, Any, str, dict]:
    """(routes, token ids, format, keyword arguments) for `moe_replay.audit` from the file or store at `path`;
    TraceFormatError naming the path where it is none of the three."""
    import numpy as np

    from ..errors import TraceFormatError, Where

    where = Where(file=str(path))
    want = "a trace store directory, JSON Lines of engine outputs or a verl .npz"
    if not path.exists():
        raise TraceFormatError(where, want, "nothing at that path")
    if path.is_dir():
        if not (path / "index.bin").exists() and not any(path.glob("seg-*.bin")):
            found = sorted(p.name for p in path.iterdir())[:3]
            raise TraceFormatError(where, "a trace store directory (index.bin and seg-*.bin)",
                                   f"a directory holding {found}" if found else "an empty directory")
        from ..store import DirectoryStore

        with DirectoryStore(path, readonly=True) as store:
            keys = sorted(store.keys())[:limit]
            if not keys:
                raise TraceFormatError(where, "a trace store holding records", "no records")
            return [store.get(k) for k in keys], None, fmt or "trace", {}
    if path.suffix == ".npz":
        try:
            data = dict(np.load(path))
        except (OSError, ValueError) as e:
            raise TraceFormatError(where, "an .npz of routed_experts, input_ids, attention_mask", f"unreadable ({e})") from None
        missing = [k for k in ("routed_experts", "input_ids") if k not in data]
        if missing:
            raise TraceFormatError(where, "arrays routed_experts, input_ids (and attention_mask)", f"no {missing}")
        return data["routed_experts"], data["input_ids"], fmt or "verl", {"attention_mask": data.get("attention_mask")}
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceFormatError(where, "UTF-8 JSON Lines", f"byte {raw[e.start]:#04x} at offset {e.start}, not UTF-8") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise TraceFormatError(where.with_(field=f"line {n}"), "one JSON object per line", e.msg) from None
    if not rows or any(not isinstance(r, dict) or "routed_experts" not in r or "token_ids" not in r for r in rows):
        raise TraceFormatError(where, 'JSON Lines of {"token_ids": [...], "routed_experts": ...}',
                               f"{len(rows)} rows, some without those keys" if rows else "no rows")
    fmt = fmt or ("sglang" if isinstance(rows[0]["routed_experts"], str) else "vllm")
    keys = [str(r.get("key", f"line-{n}")) for n, r in enumerate(rows, 1)]
    tokens = [np.asarray(r["token_ids"], dtype=np.int64) for r in rows]
    if fmt == "sglang":
        return ([r["routed_experts"] for r in rows], tokens, fmt,
                {"start_len": [int(r.get("routed_experts_start_len", 0)) for r in rows], "keys": keys})
    return ([np.asarray(r["routed_experts"], dtype=np.int64) for r in rows], tokens, fmt,
            {"prompt_start": [int(r.get("routed_experts_prompt_start", 0)) for r in rows], "keys": keys})


def run(args: argparse.Namespace) -> int:
    import torch

    from ..errors import TraceFormatError, Where
    from .api import audit

    model_dir = Path(args.model)
    routes, tokens, fmt, kwargs = read(Path(args.routes), args.format, args.limit)
    if not (model_dir / "config.json").is_file():
        found = "nothing at that path" if not model_dir.exists() else (
            "a file" if not model_dir.is_dir() else "a directory without config.json")
        raise TraceFormatError(Where(file=str(model_dir)), "a Hugging Face checkpoint directory (config.json)", found)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    report = audit(model, routes, tokens, format=fmt, **kwargs)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.summary())
    return 0 if report.ok else 1
