"""How a DirectoryStore is opened: its options, validated before any file is touched."""

from __future__ import annotations

from dataclasses import dataclass

from .chunks import DEFAULT_CHUNK_MIN_BYTES
from .reading import DEFAULT_CHUNK_CACHE_BYTES

DEFAULT_SEGMENT_BYTES = 256 << 20
MIN_SEGMENT_BYTES = 1 << 10


@dataclass(frozen=True)
class DirectoryStoreOptions:
    """How a DirectoryStore is opened (validated here so a bad value fails before any file is touched)."""

    create: bool = True
    """Create the directory and an empty store if absent (ignored when readonly)."""
    readonly: bool = False
    """Open as a reader: no lock taken, nothing written or repaired; any number may coexist."""
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    """Size at which the writer starts a new segment file (a larger record gets a segment alone)."""
    durable: bool = True
    """fsync segments before index entries and the index after them (survives power loss);
    False still survives a crash of the writing process, since the write order is the same."""
    survey: bool = False
    """Reader only: also read what the next writer would find at open (the segment bytes past the
    index, a damaged index header) and do what it would do, in memory only: its records are
    visible, `recovery` says what it would recover, cut and remove, and `recovery["refused"]` holds
    the error it would refuse to open with. Nothing is written. On a store with a live writer the
    tail is that writer's commit in flight."""
    share_prefixes: bool = True
    """Writer of a format-v2 store: keep the routes records share once, as chunks (chunks.py);
    False writes every record whole. A v1 store is always written whole."""
    chunk_min_bytes: int = DEFAULT_CHUNK_MIN_BYTES
    """A run of route rows becomes a chunk when its routes take at least this many bytes at the
    order-preserving bound (smaller runs stay in their record)."""
    chunk_cache_bytes: int = DEFAULT_CHUNK_CACHE_BYTES
    """Decoded chunk routes a reader keeps for the next record naming them (0: none)."""

    def __post_init__(self) -> None:
        for name in ("create", "readonly", "durable", "survey", "share_prefixes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DirectoryStoreOptions.{name} must be a bool, got {getattr(self, name)!r}")
        if self.survey and not self.readonly:
            raise ValueError("DirectoryStoreOptions.survey=True needs readonly=True: a survey changes nothing")
        size = self.segment_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < MIN_SEGMENT_BYTES:
            raise ValueError(f"DirectoryStoreOptions.segment_bytes must be an int >= {MIN_SEGMENT_BYTES}, got {size!r}")
        for name in ("chunk_min_bytes", "chunk_cache_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"DirectoryStoreOptions.{name} must be an int >= 0 bytes, got {value!r}")
