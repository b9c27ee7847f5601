"""Copy records of a directory store into a new store: every intact one (`rescue_store`, the way
out of a refusal), or the ones to keep (`compact_store`, how records are deleted).

A writer refuses to open a store whose unindexed bytes hold damage before an intact record
(`UnindexedDamageError`), or an unindexed frame whose key the index already names
(`DuplicateKeyError`): opening would mean deleting a checksummed record. A plain reader cannot see
unindexed records at all. `rescue_store` reads the source as a survey reader (every indexed record,
every intact frame in holes and past the index, before and after damage) and writes each record
that reads back whole into a new store, in file order. The source is never written.

The store is append-only: nothing is deleted in place. `compact_store(src, dst, keys=...)` copies
the records to keep into a new store; the shared route chunks those records name come along, each
once, and a chunk no kept record names stays behind. A record whose chunk is damaged is not
copied (it is reported, by name, as rescue reports it): no copy ever holds a record it cannot read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..errors import MissingKeyError, MoeReplayError, TraceError, Where
from .directory import DirectoryStore
from .inputs import check_keys


class RescueDestinationError(MoeReplayError, FileExistsError):
    """The destination of a rescue is not a new or empty directory (nothing is written over)."""


@dataclass
class RescueReport:
    """What `rescue_store` copied and what it could not."""

    source: str
    destination: str
    copied: int = 0
    """Records written to the destination."""
    unindexed: int = 0
    """Of those, records no index entry of the source named (holes and tail)."""
    damaged: list[TraceError] = field(default_factory=list)
    """Damaged stretches and records of the source: their bytes hold no record that reads back."""
    conflicts: list[TraceError] = field(default_factory=list)
    """Intact unindexed frames whose key another record (the one indexed, or the first in the file)
    already holds: not copied, each named with its segment and offset for a copy by hand."""


def _check_destination(dst: str | os.PathLike) -> Path:
    dst_path = Path(dst)
    if dst_path.exists() and (not dst_path.is_dir() or any(dst_path.iterdir())):
        found = "a file" if not dst_path.is_dir() else f"a directory holding {sorted(p.name for p in dst_path.iterdir())[:3]}"
        raise RescueDestinationError(f"copy destination {str(dst_path)!r}: expected a new or empty directory, found {found}")
    return dst_path


def rescue_store(src: str | os.PathLike, dst: str | os.PathLike, *, durable: bool = True) -> RescueReport:
    """Copy every intact record of store `src` (indexed or not) into a new store at `dst` (absent
    or an empty directory). Returns what was copied, what was damaged and which duplicates were left."""
    dst_path = _check_destination(dst)
    report = RescueReport(str(src), str(dst_path))
    with DirectoryStore(src, readonly=True, survey=True) as source:
        unindexed = set(source.recovery.get("records_unindexed", []))  # type: ignore[arg-type]
        report.conflicts = list(source.recovery.get("frames_duplicated", []))  # type: ignore[call-overload]
        with DirectoryStore(dst_path, durable=durable) as out:
            for trace in source.iter(errors="skip", on_error=report.damaged.append):
                out.put(trace)
                report.copied += 1
                report.unindexed += trace.key in unindexed
    return report


@dataclass
class CompactReport:
    """What `compact_store` kept and left behind."""

    source: str
    destination: str
    copied: int = 0
    dropped: int = 0
    """Records of the source not asked for."""
    chunks_before: int = 0
    chunks_after: int = 0
    """Shared route chunks in the source and in the copy (those the copied records name)."""
    bytes_before: int = 0
    bytes_after: int = 0
    damaged: list[TraceError] = field(default_factory=list)
    """Records asked for that do not read back whole (a damaged record or chunk): not copied."""


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def compact_store(src: str | os.PathLike, dst: str | os.PathLike, *, keys: Sequence[str] | None = None,
                  durable: bool = True, **options) -> CompactReport:
    """Copy the records `keys` of store `src` (every record when None) into a new store at `dst`
    (absent or an empty directory), in the source's order; only the chunks they name come along.
    `options`: the new store's writer options (DirectoryStore: chunk_min_bytes, segment_bytes, ...)."""
    dst_path = _check_destination(dst)
    report = CompactReport(str(src), str(dst_path))
    with DirectoryStore(src, readonly=True) as source:
        wanted = source.keys() if keys is None else check_keys(keys, str(source.path))
        missing = [k for k in wanted if k not in source]
        if missing:
            raise MissingKeyError(Where(file=str(source.path), record=missing[0]), "records of the source store", "absent",
                                  f"{len(missing)} of the {len(wanted)} keys to keep")
        order = {k: i for i, k in enumerate(source.keys())}
        wanted = sorted(set(wanted), key=order.__getitem__)
        report.dropped = len(source) - len(wanted)
        report.chunks_before, report.bytes_before = len(source.chunk_keys()), _dir_bytes(source.path)
        with DirectoryStore(dst_path, durable=durable, **options) as out:
            for key in wanted:
                try:
                    trace = source.get(key)
                except TraceError as err:
                    report.damaged.append(err)
                    continue
                out.put(trace)
                report.copied += 1
            report.chunks_after = len(out.chunk_keys())
    report.bytes_after = _dir_bytes(dst_path)
    return report
