"""Trace stores: one interface (`TraceStore`), registered by name in `STORES`, opened by `open_store`.

  "memory"     MemoryStore     encoded records in a dict (tests, one process)
  "directory"  DirectoryStore  append-only segments + checksummed index, one writer, many readers

`rescue_store(src, dst)` copies every intact record of a directory store (indexed or not) into a
new one: what a writer's refusal to open a damaged store advises. `compact_store(src, dst, keys=)`
copies the records to keep (the store is append-only): only the route chunks they name come along.

Both stores keep the routes records share (a prompt's n samples, an agentic rollout's turns) once,
as route chunks (chunks.py); a record reads back as the trace that was put, and
`get(key, layers=...)` reads some MoE layers' routes only (a pipeline stage's).
"""

from __future__ import annotations

import os

from .base import STORES, TraceStore
from .directory import (DirectoryStore, ReadOnlyStoreError, StoreLockedError, StoreNotFoundError, WriterLockLostError,
                        WriterLostError, WriterProcessError)
from .memory import MemoryStore
from .chunks import ChunkMissingError
from .directory import ReadStats
from .rescue import CompactReport, RescueDestinationError, RescueReport, compact_store, rescue_store
from .salvage import UnindexedDamageError

MEMORY_SCHEME = "memory://"
DIRECTORY_SCHEMES = ("directory://", "file://")


def open_store(uri_or_path: str | os.PathLike, **options) -> TraceStore:
    """Open a store by URI: "memory://[name]" gives a new MemoryStore; "directory://PATH",
    "file://PATH" or a plain path gives DirectoryStore(PATH, **options) (create, readonly,
    segment_bytes, durable, survey, share_prefixes, chunk_min_bytes, chunk_cache_bytes)."""
    target = os.fspath(uri_or_path)
    if target.startswith(MEMORY_SCHEME):
        if options:
            raise ValueError(f"a memory store takes no options, got {sorted(options)} for {target!r}")
        return MemoryStore(target)
    for scheme in DIRECTORY_SCHEMES:
        if target.startswith(scheme):
            target = target[len(scheme) :]
            break
    else:
        if "://" in target:
            raise ValueError(
                f"unknown store scheme in {target!r}; supported: {MEMORY_SCHEME}, "
                f"{', '.join(s + 'PATH' for s in DIRECTORY_SCHEMES)}, or a plain directory path"
            )
    if not target:
        raise ValueError(f"store URI {os.fspath(uri_or_path)!r} names no directory")
    return DirectoryStore(target, **options)


__all__ = [
    "STORES",
    "ChunkMissingError",
    "CompactReport",
    "DirectoryStore",
    "MemoryStore",
    "ReadOnlyStoreError",
    "ReadStats",
    "RescueDestinationError",
    "RescueReport",
    "StoreLockedError",
    "StoreNotFoundError",
    "TraceStore",
    "UnindexedDamageError",
    "WriterLockLostError",
    "WriterLostError",
    "WriterProcessError",
    "compact_store",
    "open_store",
    "rescue_store",
]
