"""Copy every intact record of a directory store into a new store: the way out of a refusal.

A writer refuses to open a store whose unindexed bytes hold damage before an intact record
(`UnindexedDamageError`), or an unindexed frame whose key the index already names
(`DuplicateKeyError`): opening would mean deleting a checksummed record. A plain reader cannot see
unindexed records at all. `rescue_store` reads the source as a survey reader (every indexed record,
every intact frame in holes and past the index, before and after damage) and writes each record
that reads back whole into a new store, in file order. The source is never written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MoeReplayError, TraceError
from .directory import DirectoryStore


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


def rescue_store(src: str | os.PathLike, dst: str | os.PathLike, *, durable: bool = True) -> RescueReport:
    """Copy every intact record of store `src` (indexed or not) into a new store at `dst` (absent
    or an empty directory). Returns what was copied, what was damaged and which duplicates were left."""
    dst_path = Path(dst)
    if dst_path.exists() and (not dst_path.is_dir() or any(dst_path.iterdir())):
        found = "a file" if not dst_path.is_dir() else f"a directory holding {sorted(p.name for p in dst_path.iterdir())[:3]}"
        raise RescueDestinationError(f"rescue destination {str(dst_path)!r}: expected a new or empty directory, found {found}")
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
