"""The other process of the store tests (run as `python -m tests.store_worker MODE ...` from the repo root).

  append DIR START COUNT BATCH DURABLE SEGMENT_BYTES [DIE_AT]
  append-shared ... (the same arguments)
      put_many the deterministic traces trace_for(START ...) (append-shared: shared_trace_for,
      prompt groups whose prefixes the store keeps as shared chunks) in batches; after each put_many
      returns, print the number of records committed so far. COUNT < 0 appends until killed.
      DIE_AT = KIND:N[:F] (KIND one of frames, index, header, rewrite): the N-th write of that kind
      by the store writes a fraction F (default half) of its bytes (plus one), then the process
      SIGKILLs itself: a crash at
      a chosen point of a put_many (frames, index entries, a new segment's header), of creating
      the store (the first header written is the index's) or of replacing a damaged index
      (rewrite: a whole new index.bin, written to its temporary file on open).
  put-items DIR SEED CHUNK_MIN_BYTES SEGMENT_BYTES SPECS [DIE_AT]
      the fault harness's writer (tests/store_faults.py): SPECS = batches separated by ";", each
      a ","-separated list of item specs (store_faults.item); put_many each batch (durable=False)
      and print the number of batches acknowledged so far; DIE_AT as above.
  try-writer DIR
      open DIR as a writer; exit 3 printing the error if another writer holds it, 0 otherwise.
"""

from __future__ import annotations

import os
import signal
import sys

from moe_replay.store import DirectoryStore, StoreLockedError
from moe_replay.store import directory as dirmod
from moe_replay.store import framing
from tests.trace_factory import shared_trace_for, trace_for

SHARED_CHUNK_MIN_BYTES = 16
"""append-shared's chunk_min_bytes: every prompt of shared_trace_for (40 rows of the tiny geometry) is a chunk."""


def write_kind(data: bytes) -> str:
    head = bytes(data[:8])
    if len(data) == framing.HEADER.size and head in (framing.INDEX_MAGIC, framing.SEGMENT_MAGIC):
        return "header"
    if head == framing.INDEX_MAGIC:
        return "rewrite"
    return {framing.FRAME_MAGIC: "frames", framing.ENTRY_MAGIC: "index"}.get(head[:4], "other")


def die_at(kind: str, n: int, fraction: float = 0.5) -> None:
    real, calls = dirmod._write_all, {}

    def write(fd: int, data) -> None:
        k = write_kind(data)
        calls[k] = calls.get(k, 0) + 1
        if k == kind and calls[k] == n:
            real(fd, bytes(data)[: int(len(data) * fraction) + 1])
            os.kill(os.getpid(), signal.SIGKILL)
        real(fd, data)

    dirmod._write_all = write


def append(path: str, start: int, count: int, batch: int, durable: bool, segment_bytes: int, shared: bool = False) -> None:
    make = shared_trace_for if shared else trace_for
    opts = {"chunk_min_bytes": SHARED_CHUNK_MIN_BYTES} if shared else {}
    with DirectoryStore(path, durable=durable, segment_bytes=segment_bytes, **opts) as store:
        print(len(store), flush=True)
        i = start
        while count < 0 or i < start + count:
            n = batch if count < 0 else min(batch, start + count - i)
            store.put_many([make(j) for j in range(i, i + n)])
            i += n
            print(i, flush=True)


def put_items(path: str, seed: int, chunk_min_bytes: int, segment_bytes: int, specs: str) -> None:
    from tests.store_faults import item

    with DirectoryStore(path, durable=False, segment_bytes=segment_bytes, chunk_min_bytes=chunk_min_bytes) as store:
        for done, batch in enumerate(specs.split(";"), 1):
            store.put_many([item(s, seed) for s in batch.split(",")])
            print(done, flush=True)


def try_writer(path: str) -> int:
    try:
        DirectoryStore(path).close()
    except StoreLockedError as e:
        print(e, flush=True)
        return 3
    return 0


def main(argv: list[str]) -> int:
    mode, path, *rest = argv
    if mode in ("append", "append-shared"):
        if len(rest) > 5:
            kind, n = rest.pop().split(":")
            die_at(kind, int(n))
        start, count, batch, durable, segment_bytes = (int(x) for x in rest)
        append(path, start, count, batch, bool(durable), segment_bytes, shared=mode == "append-shared")
        return 0
    if mode == "put-items":
        if len(rest) > 4:
            kind, n, *fraction = rest.pop().split(":")
            die_at(kind, int(n), *(float(f) for f in fraction))
        seed, chunk_min_bytes, segment_bytes = (int(x) for x in rest[:3])
        put_items(path, seed, chunk_min_bytes, segment_bytes, rest[3])
        return 0
    if mode == "try-writer":
        return try_writer(path)
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
