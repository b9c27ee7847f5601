"""Typed errors. Each one says where (file, record, field), what was expected and what was found.

Callers can catch the family (`TraceError`) or one precise kind; every class is also a builtin
(`ValueError`, `KeyError`, ...) so generic handlers keep working.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Where:
    """Location of a problem: any of file, record key and field may be unknown."""

    file: str | None = None
    record: str | None = None
    field: str | None = None

    def __str__(self) -> str:
        parts = []
        if self.file is not None:
            parts.append(f"file {self.file!r}")
        if self.record is not None:
            parts.append(f"record {self.record!r}")
        if self.field is not None:
            parts.append(f"field {self.field!r}")
        return ", ".join(parts) if parts else "<unknown location>"

    def with_(self, **changes: Any) -> "Where":
        return Where(**{**self.__dict__, **{k: v for k, v in changes.items() if v is not None}})


class MoeReplayError(Exception):
    """Root of every error raised by moe_replay."""


class LocatedError(MoeReplayError):
    """Input that is not what its reader expects, said as: where, expected, found (and why)."""

    def __init__(self, where: Where, expected: Any, found: Any, detail: str = "") -> None:
        self.where, self.expected, self.found, self.detail = where, expected, found, detail
        msg = f"{where}: expected {expected}, found {found}"
        super().__init__(f"{msg} ({detail})" if detail else msg)

    def __reduce__(self):  # keep errors picklable across processes (Ray, vLLM workers)
        return (type(self), (self.where, self.expected, self.found, self.detail))


class TraceError(LocatedError):
    """A trace, record or store content is not what the reader expects."""


class TraceFormatError(TraceError, ValueError):
    """Malformed content: bad type, shape, dtype, or undecodable bytes."""


class TruncatedRecordError(TraceFormatError):
    """A record or frame ends before its declared length."""


class ChecksumError(TraceFormatError):
    """Stored checksum does not match the bytes read."""


class SchemaVersionError(TraceFormatError):
    """Record written with a schema version this reader cannot interpret."""


class GeometryMismatchError(TraceError, ValueError):
    """Model geometry of a trace differs from the one required."""


class WeightsVersionError(TraceError, ValueError):
    """A trace was sampled with other weights than the ones its consumer holds (the trainer's, a π_old
    scorer's), and the caller did not say the batch is off-policy on purpose (identity.py)."""


class ExpertIdOutOfRangeError(TraceError, ValueError):
    """An expert id is negative or >= num_experts."""


class PartialTraceError(TraceError, ValueError):
    """A trace read for some MoE layers only (`route_layer_ids`) reached a reader that needs them all."""


class TraceAlignmentError(TraceError, ValueError):
    """Traces that should line up with one token sequence do not (e.g. conversation turns to stitch)."""


class MultiSpanTraceError(TraceFormatError):
    """A reader that scores one contiguous generated span got a record with several (a stitched
    multi-turn conversation, `RolloutTrace.generated_spans`): refused rather than misaligned."""


class DuplicateKeyError(TraceError, KeyError):
    """A key is written twice to a store that refuses overwrites."""

    def __str__(self) -> str:  # KeyError would repr() the message otherwise
        return Exception.__str__(self)


class MissingKeyError(TraceError, KeyError):
    """A key is not in the store."""

    def __str__(self) -> str:
        return Exception.__str__(self)


class ConfigFileError(LocatedError, ValueError):
    """A configuration file (a preset YAML) cannot be read as one: not a file, not UTF-8 text, not YAML."""


class ConfigFileNotFoundError(ConfigFileError, FileNotFoundError):
    """A configuration file named by path does not exist."""


class RegistryError(MoeReplayError, KeyError):
    """Lookup of an unknown name in a registry, or a second registration under one name."""

    def __str__(self) -> str:
        return Exception.__str__(self)


class MissingExtraError(MoeReplayError, ImportError):
    """An optional dependency a feature needs is not installed: names the feature, the module, the project's
    extra that brings it and the command that installs it (`moe_replay.extras.require` raises it)."""

    def __init__(self, feature: str, module: str, extra: str, install: str) -> None:
        self.feature, self.module, self.extra, self.install = feature, module, extra, install
        super().__init__(f"{feature}: expected {module} installed, found no module named {module!r}; {install}",
                         name=module)

    def __reduce__(self):
        return (type(self), (self.feature, self.module, self.extra, self.install))

