"""In-memory store: encoded records in a dict, so it is compact and behaves like the directory store.

Keeping bytes rather than trace objects means a `get` returns a fresh decode (never an alias of what
was put, so a caller mutating it cannot change the store) and every record goes through the same
encode/validate/checksum path as on disk: a test passing on "memory" means the same on "directory".

It keeps the routes records share once too (store/chunks.py), as the directory store does.

Also home of the error mode shared by both stores' `iter` and `scan`.
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterable, Iterator, Literal, Sequence

from ..codec.chunk import ChunkShape
from ..codec.record import decode_trace, encode_trace
from ..errors import DuplicateKeyError, MissingKeyError, TraceError, TraceFormatError, Where
from ..trace import RolloutTrace
from .base import STORES, TraceStore
from .chunks import CHUNK_KEY_PREFIX, DEFAULT_CHUNK_MIN_BYTES, ChunkTable, encode_shared, read_held
from .inputs import check_key, check_keys, check_layers, check_trace

ErrorMode = Literal["raise", "skip"]
"""What `iter` does with a record that fails its checks: raise the typed error, or skip it and
report it (to `on_error`, or as a RuntimeWarning when no callback is given: never silently)."""
ERROR_MODES = ("raise", "skip")
OnError = Callable[[TraceError], None]
"""Receives each record skipped under errors="skip"."""


def check_error_mode(errors: str) -> None:
    if errors not in ERROR_MODES:
        raise ValueError(f"errors must be one of {ERROR_MODES}, got {errors!r}")


def handle_bad_record(err: TraceError, errors: str, on_error: OnError | None) -> None:
    """Raise `err` (errors="raise") or report it and return so iteration goes on (errors="skip")."""
    if errors == "raise":
        raise err
    if on_error is not None:
        on_error(err)
    else:
        warnings.warn(f"skipped unreadable record: {err}", RuntimeWarning, stacklevel=3)


def check_new_keys(keys: Iterable[str], present: Callable[[str], bool], store: str) -> None:
    """Refuse a batch that repeats a key or names a stored one, before anything is written."""
    seen: set[str] = set()
    for key in keys:
        if present(key) or key in seen:
            where = "already stored" if present(key) else "twice in one put_many batch"
            detail = "stores never overwrite a record"
            raise DuplicateKeyError(Where(file=store, record=key), "a key not yet stored", where, detail)
        seen.add(key)


@STORES.register("memory")
class MemoryStore(TraceStore):
    """A TraceStore held in RAM (tests, small jobs, a single process); `close` drops the records."""

    def __init__(self, name: str = "memory://", *, share_prefixes: bool = True,
                 chunk_min_bytes: int = DEFAULT_CHUNK_MIN_BYTES) -> None:
        self.name = name
        """Shown as the 'file' of every error (memory stores have no path)."""
        self._records: dict[str, bytes] | None = {}
        self._chunks: dict[str, bytes] = {}
        """Encoded route chunks records share, by key (store/chunks.py)."""
        self._table = ChunkTable() if share_prefixes else None
        self.chunk_min_bytes = chunk_min_bytes

    def _live(self) -> dict[str, bytes]:
        if self._records is None:
            raise ValueError(f"store {self.name!r} is closed")
        return self._records

    def put(self, trace: RolloutTrace) -> None:
        self.put_many([trace])

    def put_many(self, traces: Iterable[RolloutTrace]) -> None:
        """Add traces in order; a Sequence with a duplicate key is refused before any is added."""
        records = self._live()
        if isinstance(traces, Sequence):
            check_new_keys((check_trace(t, self.name).key for t in traces), records.__contains__, self.name)
        for trace in traces:
            check_new_keys([check_trace(trace, self.name).key], records.__contains__, self.name)
            if self._table is None:
                records[trace.key] = encode_trace(trace)
                continue
            if trace.key.startswith(CHUNK_KEY_PREFIX):
                raise TraceFormatError(Where(file=self.name, record=repr(trace.key[:40]), field="key"),
                                       f"a key not starting with {CHUNK_KEY_PREFIX!r}", "one that does",
                                       "keys starting so name the store's route chunks")
            records[trace.key], split = encode_shared(trace, self._table, self.chunk_min_bytes)
            self._chunks.update(split.new)

    def get(self, key: str, layers: Sequence[int] | None = None) -> RolloutTrace:
        data = self._live().get(check_key(key, self.name))
        if data is None:
            raise MissingKeyError(Where(file=self.name, record=key), "a stored key", "absent", f"{len(self)} records stored")
        return decode_trace(data, Where(file=self.name, record=key), chunks=self, layers=check_layers(layers, self.name, key))

    def read_chunk(self, key: str, want: ChunkShape, first: int, stop: int, record_where: Where):
        """The ChunkSource of this store's records (codec.record)."""
        return read_held(self._chunks, key, want, first, stop, record_where, "no such chunk in the store")

    def get_many(self, keys: Sequence[str], layers: Sequence[int] | None = None) -> list[RolloutTrace]:
        records = self._live()
        keys = check_keys(keys, self.name)
        layers = check_layers(layers, self.name)
        for key in keys:  # all-or-nothing: name a missing key before decoding anything
            if key not in records:
                self.get(key)
        return [self.get(k, layers) for k in keys]

    def keys(self) -> list[str]:
        return list(self._live())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._live()

    def __len__(self) -> int:
        return len(self._live())

    def __iter__(self) -> Iterator[RolloutTrace]:
        return self.iter()

    def iter(self, errors: ErrorMode = "raise", on_error: OnError | None = None) -> Iterator[RolloutTrace]:
        """Traces in insertion order, decoded one at a time; bad records raise or are skipped."""
        check_error_mode(errors)
        for key in self.keys():
            try:
                trace = self.get(key)
            except TraceError as err:
                handle_bad_record(err, errors, on_error)
                continue
            yield trace

    def scan(self) -> tuple[list[str], list[TraceError]]:
        """(keys that decode and validate, errors of those that do not), reading every record."""
        bad: list[TraceError] = []
        good = [t.key for t in self.iter(errors="skip", on_error=bad.append)]
        return good, bad

    def refresh(self) -> int:
        """Nothing to do: a memory store has one view. Returns the number of new records (0)."""
        self._live()
        return 0

    def close(self) -> None:
        self._records = None
        self._chunks = {}

    def __repr__(self) -> str:
        state = "closed" if self._records is None else f"{len(self._records)} records"
        return f"MemoryStore({self.name!r}, {state})"
