"""Directory store: append-only segment files plus a checksummed index; one writer, many readers.

Files of a store directory:
  index.bin        header, then one entry per record, in insertion order
  seg-000000.bin   header, then framed records (the bytes of codec.record.encode_trace), appended;
  seg-000001.bin   a new segment starts when the next frame would pass `segment_bytes`
  writer.lock      held with an exclusive flock by the one writer (it holds the writer's pid)

One writer, one process. Before its first write and before every commit a writer checks that it
runs in the process that opened it and that writer.lock is still the file it locked, holding its
pid (`_check_writer`); otherwise the write is refused, by name, before a byte is written
(WriterProcessError, WriterLockLostError). A child forked from the writer's process
(multiprocessing's fork start method, a DataLoader worker) inherits the lock and the file offsets,
so two processes would append at the same offsets and acknowledged records become unreadable; a
pickled writer arrives as a reader of the same directory that refuses writes the same way (reads
work in both). A lock file deleted (or replaced) under a live writer lets a second writer open: the
first one then refuses every write, the second one writes.

The byte format of headers, record frames and index entries is framing.py's.

Crash safety (architecture invariant 9). A commit writes its frames and syncs the segment, then
appends the index entries and syncs the index. A record is visible only once its entry is complete
with a matching CRC, and an entry only points at bytes made durable before it was written; so a
crash leaves every committed record readable and a torn one invisible. Readers stop before a torn
index tail; the next writer truncates it. Segment bytes past the last indexed record are scanned
(salvage.py): intact frames (a crash between the two syncs, an index that lost entries or its
header) are indexed again, and only bytes that are no part of an intact frame are cut; damaged
bytes followed by an intact frame make the writer refuse to open (UnindexedDamageError) rather than
delete it, and advise rescue.py's copy. A reader opened with survey=True runs the writer's recovery
in memory only: what `moe-replay inspect` reports; on a store without index.bin too (a writer
creates an empty one and indexes every intact frame again).

Damaged index entries and the holes they leave, and the recovery steps above: recovery.py. Record,
chunk and partial-layer reads, the chunk cache and `stats`: reading.py. The options: options.py.

Shared prefixes (format v2, chunks.py): a writer keeps the routes records share (a prompt's n
samples, an agentic rollout's turns) as route chunks, frames of their own indexed under keys that
start with chunks.CHUNK_KEY_PREFIX, each written once and always before, in the same commit or an
earlier one, the first record naming it: a crash never leaves a record whose chunk is missing.
Records and chunks are framed, indexed, recovered and salvaged alike; `keys()`, `len()` and
iteration are the records'. A record is read with the chunks it names (each checked against its
index entry and the record's geometry) and comes back as the trace that was written; a damaged
or absent chunk refuses exactly the records naming it, with the chunk's name, segment and offset
and theirs. A writer names a stored chunk only after checking its frame (`check_chunk`, once per
chunk per writer session), and never a damaged one: the record's rows go to a copy of the chunk
(chunks.ChunkKey.copy; `chunks_refused`), so every record put_many acknowledges reads back. Readers
keep recently read chunks decoded (`chunk_cache_bytes`), so the n samples of a prompt decode its
prefix once. `get(key, layers=...)` reads the routes of some MoE layers only (a pipeline
stage's): of each chunk only the bytes of those layers are read (`stats`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from ..codec.chunk import ChunkShape
from ..codec.record import decode_trace, encode_trace
from ..errors import (
    ChecksumError,
    DuplicateKeyError,
    LocatedError,
    MissingKeyError,
    MoeReplayError,
    TraceError,
    TraceFormatError,
    SchemaVersionError,
    TruncatedRecordError,
    Where,
)
from ..trace import RolloutTrace
from .base import STORES, TraceStore
from .chunks import CHUNK_KEY_PREFIX, DEFAULT_CHUNK_MIN_BYTES, ChunkMissingError, ChunkTable, encode_shared, is_chunk_key, label
from .memory import ErrorMode, OnError, check_error_mode, check_new_keys, handle_bad_record
from .fileio import _read_at, _sync, _sync_dir, _write_all  # names looked up here: tests patch them here
from .framing import (
    FORMAT_VERSION, FRAME, FRAME_MAGIC, HEADER, INDEX_MAGIC, INDEX_NAME, LOCK_NAME, MAX_KEY_BYTES, SEGMENT_MAGIC, _SEGMENT_RE,
    Entry, check_header, frame_crc, pack_entry, pack_header, parse_index, segment_name,
)
from .options import DEFAULT_SEGMENT_BYTES, MIN_SEGMENT_BYTES, DirectoryStoreOptions  # noqa: F401 (importable here)
from .inputs import check_key, check_keys, check_layers, check_trace
from .reading import (  # noqa: F401 (crc_of: importable here)
    DEFAULT_CHUNK_CACHE_BYTES, ChunkCache, ReadStats, check_chunk_frame, chunk_field, crc_of, naming_chunk, read_chunk, read_frame,
)
from .recovery import fill_holes, recover

log = logging.getLogger(__name__)

COMMIT_BYTES = 64 << 20
"""put_many commits (syncs segment, then index) at least every this many encoded bytes."""
MAX_OPEN_SEGMENTS = 64


class StoreNotFoundError(MoeReplayError, FileNotFoundError):
    """No store at the path given (missing, or a directory that is not a store) and none may be created."""


class StoreLockedError(MoeReplayError, BlockingIOError):
    """Another writer holds the store's lock (one writer per directory)."""


class ReadOnlyStoreError(MoeReplayError, PermissionError):
    """A write was attempted through a store opened with readonly=True."""


class WriterLostError(LocatedError, PermissionError):
    """A writer handle that may no longer write: said as where, expected, found."""


class WriterProcessError(WriterLostError):
    """A write through a writer handle from another process than the one that opened it: a forked
    child that inherited it, or a pickled copy (which reads, as a reader does)."""


class WriterLockLostError(WriterLostError):
    """writer.lock is not the file this writer locked any more (deleted, replaced, rewritten): another
    writer may have opened the store, so this one refuses to write."""


@STORES.register("directory")
class DirectoryStore(TraceStore):
    """Traces in a directory of append-only segments, indexed by key (see the module doc).

    RAM holds only key -> Entry(segment, offset, length, crc); every read is a pread of one record.
    A reader sees the records committed when it opened, plus those it picks up with `refresh()`.
    """

    def __init__(
        self, path: str | os.PathLike, *, create: bool = True, readonly: bool = False,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES, durable: bool = True, survey: bool = False,
        share_prefixes: bool = True, chunk_min_bytes: int = DEFAULT_CHUNK_MIN_BYTES,
        chunk_cache_bytes: int = DEFAULT_CHUNK_CACHE_BYTES,
    ) -> None:
        self.options = DirectoryStoreOptions(create=create, readonly=readonly, segment_bytes=segment_bytes, durable=durable,
                                             survey=survey, share_prefixes=share_prefixes, chunk_min_bytes=chunk_min_bytes,
                                             chunk_cache_bytes=chunk_cache_bytes)
        self.path = Path(path)
        self.readonly = readonly
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._index_fd: int | None = None
        self._reset_view()
        self._lock_fd: int | None = None
        self._lock_id: tuple[int, int] | None = None
        """(st_dev, st_ino) of the writer.lock this writer locked."""
        self._pid = os.getpid()
        """The process that opened this handle: only it may write (`_check_writer`)."""
        self._copy_of: int | None = None
        """The pid of the writer this handle is a pickled copy of (None: not a copy)."""
        self._seg, self._seg_size = 0, HEADER.size
        self._failed: BaseException | None = None
        self._closed = False
        self._mutex = threading.RLock()
        self.format_version = FORMAT_VERSION
        """The layout version of this store (its index header's): 1 = whole records only."""
        self._table: ChunkTable | None = None
        """A writer's lookup of the chunks stored (None: records are written whole)."""
        self._chunk_checks: dict[str, TraceError | None] = {}
        """Writer: chunk key -> the error its frame failed with (None: intact), for each chunk this
        session checked before a record named it, or wrote (`_chunk_usable`)."""
        self.stats = ReadStats()
        self._cache = ChunkCache(self.options.chunk_cache_bytes)
        """(chunk key, first layer, stop layer) -> (tokens, routes) decoded, read-only (reading.py)."""
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # -- opening -----------------------------------------------------------------------------
    @property
    def index_path(self) -> Path:
        return self.path / INDEX_NAME

    def segment_path(self, n: int) -> Path:
        return self.path / segment_name(n)

    def _reset_view(self) -> None:
        """Forget what was read from the index (before reading one, whole)."""
        self.recovery: dict[str, object] = {}
        """What opening found and repaired: damaged index entries, records recovered from holes or
        the tail, a torn index tail, segment bytes cut, files removed (a reader repairs in memory only)."""
        self._entries: dict[str, Entry] = {}
        self._problems: list[tuple[int, TraceError]] = []
        """(number of records before it, error): damage reported at its place in the order."""
        self._damaged: dict[str, TraceError] = {}
        """key -> error of its damaged index entry, for keys no intact frame gave back."""
        self._index_damage: list[TraceError] = []
        """Damaged index entries still on disk (scan() reports them; a writer's rewrite clears them)."""
        self._index_stale = False
        """The index has damaged entries or misses records found in holes: a writer rewrites it."""
        self._covered = (0, HEADER.size)
        """(segment, offset) up to which the named frames were checked for holes."""
        self._index_end = HEADER.size
        self._nchunks = 0
        """Entries of `_entries` that are chunks (they share the index and recovery with records)."""

    def _open(self) -> None:
        if not self.path.is_dir():
            if self.path.exists():
                raise StoreNotFoundError(f"store path {str(self.path)!r} is not a directory; give a store directory")
            if self.readonly or not self.options.create:
                how = "open a writer (readonly=False, create=True) to create it"
                if not self.readonly:
                    how = "pass create=True to create a new store"
                raise StoreNotFoundError(f"store directory {str(self.path)!r} does not exist; {how}, or check the path")
            self.path.mkdir(parents=True, exist_ok=True)
        index_missing = not self.index_path.exists()
        if index_missing and (self.readonly or not self.options.create):
            self._refuse_missing_index()
        if not self.readonly:
            self._lock()
            if not self.index_path.exists():
                self._init_index()
        if index_missing and self.readonly:  # a survey: what a writer does, which creates an empty index
            self.format_version = self._segment_version(self._segment_names())
            self.recovery["index_missing"] = True
            size = HEADER.size
        else:
            self._index_fd = os.open(self.index_path, os.O_RDONLY if self.readonly else os.O_RDWR)
            size = self._load_index()
        if not self.readonly or self.options.survey:
            recover(self, size)
        self._recount()
        if not self.readonly and self.chunked and self.options.share_prefixes:
            self._table = self._chunk_table()

    def _refuse_missing_index(self) -> None:
        """A store directory without index.bin: a survey reader goes on as a writer would (it
        creates an empty index and indexes every intact frame of the segments again) when the
        directory holds segments and nothing a writer would refuse; anything else is refused."""
        segments = self._segment_names()
        foreign = self._foreign_files()
        if self.readonly and self.options.survey and segments and not foreign:
            return
        how = "open it once with readonly=False" if self.readonly else "pass create=True"
        if segments and not foreign:
            how = (f"it holds {len(segments)} segment file(s): a writer (readonly=False) indexes their records again when "
                   "it opens, and survey=True (moe-replay inspect) reads them now")
        raise StoreNotFoundError(
            f"{str(self.path)!r} is not a moe_replay store (no {INDEX_NAME}); {how}"
            + ("" if segments and not foreign else " to create one, or check the path")
        )

    def _segment_names(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir() if _SEGMENT_RE.match(p.name))

    def _foreign_files(self) -> list[str]:
        """Files of the directory that are no part of a store without an index (a writer refuses them)."""
        known = {LOCK_NAME} | {p.name for p in self.path.iterdir() if _SEGMENT_RE.match(p.name) or p.name.endswith(".tmp")}
        return sorted(p.name for p in self.path.iterdir() if p.name not in known)

    def _chunk_table(self) -> ChunkTable:
        """The writer's lookup of the stored chunks; a record names one only after `_chunk_usable`."""
        table = ChunkTable(usable=self._chunk_usable)
        for key in self._entries:
            table.add(key)
        return table

    def _chunk_usable(self, key: str) -> bool:
        """Writer: whether a record may name stored chunk `key`: its frame was checked intact in
        this session (once per chunk: `check_chunk`), or this session wrote it. A damaged chunk is
        never named: the record's own rows go to a new copy (chunks.ChunkKey.copy), and the chunk
        is listed in `chunks_refused`."""
        if key not in self._chunk_checks:
            if key not in self._entries:  # a chunk of the batch being written
                return True
            err = self._chunk_checks[key] = self.check_chunk(key)
            if err is not None:
                log.warning("store %s: %s is damaged; records naming its rows get a new copy: %s", self.path, label(key), err)
        return self._chunk_checks[key] is None

    @property
    def chunks_refused(self) -> dict[str, TraceError]:
        """Writer: the stored chunks this session found damaged and will not name (key -> error)."""
        return {k: err for k, err in self._chunk_checks.items() if err is not None}

    @property
    def chunked(self) -> bool:
        """Whether this store's layout keeps shared route chunks (format v2 and later)."""
        return self.format_version >= 2

    def _recount(self) -> None:
        self._nchunks = sum(1 for k in self._entries if k.startswith(CHUNK_KEY_PREFIX)) if self.chunked else 0

    def _load_index(self) -> int:
        """Read the whole index (and fill holes it leaves); return its size in bytes. A damaged or
        cut index header is rebuilt by a writer from the segments (the index holds nothing they do
        not: every frame carries its key, and index order is file order)."""
        size = os.fstat(self._index_fd).st_size
        data = _read_at(self._index_fd, size, 0)
        try:
            self.format_version = check_header(data, INDEX_MAGIC, Where(file=str(self.index_path)))
        except SchemaVersionError:
            raise
        except TraceError as err:
            segments = self._segment_names()
            self.format_version = self._segment_version(segments)
            if size >= HEADER.size and not segments:  # a foreign file named index.bin: not ours to rebuild
                raise
            if self.readonly and not self.options.survey:
                advice = (f"the records are in {len(segments)} segment file(s): a writer rebuilds the index from "
                          "them when it opens; survey=True (moe-replay inspect) reads them now")
                raise type(err)(err.where, err.expected, err.found, f"{err.detail}; {advice}" if err.detail else advice) from None
            self.recovery["index_header_damaged"] = err
            self._index_stale = True
            if not self.readonly:
                log.warning("store %s: %s; the index is rebuilt from the segments", self.path, err)
            return size
        self._absorb(data[HEADER.size :])
        return size

    def _segment_version(self, names: list[str]) -> int:
        """The layout version of the first segment file with an intact header (the store's when its
        index header is lost); FORMAT_VERSION when none has one."""
        for name in names:
            try:
                fd = os.open(self.path / name, os.O_RDONLY)
            except OSError:
                continue
            try:
                return check_header(_read_at(fd, HEADER.size, 0), SEGMENT_MAGIC, Where(file=str(self.path / name)))
            except TraceError:
                continue
            finally:
                os.close(fd)
        return FORMAT_VERSION

    def _lock(self) -> None:
        lock_path = self.path / LOCK_NAME
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_at(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StoreLockedError(
                f"store directory {str(self.path)!r} is locked by another writer (pid {holder}); "
                "only one writer per store: close it first, or open this one with readonly=True"
            ) from None
        self._lock_fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        st = os.fstat(fd)
        self._lock_id = (st.st_dev, st.st_ino)

    def _init_index(self) -> None:
        foreign = self._foreign_files()
        if foreign:
            raise StoreNotFoundError(
                f"{str(self.path)!r} is not a moe_replay store (no {INDEX_NAME}) and is not empty "
                f"(found {foreign[:3]}); give a new or empty directory"
            )
        tmp = self.path / (INDEX_NAME + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, pack_header(INDEX_MAGIC))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.index_path)  # all or nothing: the index never has a torn header
        _sync_dir(self.path)

    def _absorb(self, buf: bytes) -> int:
        """Add the entries parsed from index bytes starting at self._index_end, then the records
        of the holes they leave; return how many records were added."""
        parsed = parse_index(buf, self._index_end, Where(file=str(self.index_path)))
        for _, err in parsed.problems:
            self._index_damage.append(err)
            self._index_stale = True
            if isinstance(err, ChecksumError) and err.where.record is not None:
                self._damaged.setdefault(err.where.record, err)
        if parsed.problems:
            self.recovery["index_entries_damaged"] = list(self._index_damage)
            log.warning("store %s: %d damaged index entries, not trusted", self.path, len(parsed.problems))
        added: list[Entry] = []
        for key, entry in parsed.entries:
            if key in self._entries:  # only a buggy writer could do this: keep the first, report
                where = Where(file=str(self.index_path), record=key, field="index entry")
                err = DuplicateKeyError(where, "one entry per key", "a second entry")
                self._problems.append((len(self._entries), err))
                continue
            self._entries[key] = entry
            self._damaged.pop(key, None)
            added.append(entry)
            self._nchunks += self.chunked and key.startswith(CHUNK_KEY_PREFIX)
        self._index_end += parsed.end
        recovered = fill_holes(self, added)
        if recovered:
            self._recount()
        return len(added) + recovered

    # -- index file: entries appended, or the whole file replaced ---------------------------------------
    def _append_index(self, data: bytes) -> None:
        """Append entries at the index end (synced when durable)."""
        _write_all(self._index_fd, data)
        if self.options.durable:
            _sync(self._index_fd)
        self._index_end += len(data)

    def _rewrite_index(self) -> None:
        """Replace index.bin, all or nothing, by one entry per record in order: no damaged entry,
        none missing. A crash before the rename leaves the old index (and a .tmp the next writer removes)."""
        tmp = self.path / (INDEX_NAME + ".tmp")
        data = pack_header(INDEX_MAGIC, self.format_version) + b"".join(
            pack_entry(k.encode("utf-8"), e) for k, e in self._entries.items())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, data)
            if self.options.durable:
                _sync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.index_path)
        if self.options.durable:
            _sync_dir(self.path)
        os.close(self._index_fd)
        self._index_fd = os.open(self.index_path, os.O_RDWR)
        os.lseek(self._index_fd, len(data), os.SEEK_SET)
        self._index_end = len(data)
        self._index_damage.clear()
        self._index_stale = False

    def _new_segment(self, n: int) -> None:
        fd = os.open(self.segment_path(n), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._cache_fd(n, fd)
        _write_all(fd, pack_header(SEGMENT_MAGIC, self.format_version))
        if self.options.durable:
            _sync(fd)
            _sync_dir(self.path)
        self._seg, self._seg_size = n, HEADER.size

    def _cache_fd(self, n: int, fd: int) -> None:
        self._fds[n] = fd
        while len(self._fds) > MAX_OPEN_SEGMENTS:
            old = next(k for k in self._fds if k != self._seg and k != n)
            os.close(self._fds.pop(old))

    def _segment_fd(self, n: int, key: str | None = None) -> int:
        """Open (and check the header of) segment n, keeping a bounded number of descriptors."""
        fd = self._fds.get(n)
        if fd is not None:
            self._fds.move_to_end(n)
            return fd
        path = self.segment_path(n)
        try:
            fd = os.open(path, os.O_RDONLY if self.readonly else os.O_RDWR)
        except FileNotFoundError:
            where = Where(file=str(path), record=key, field="segment")
            raise TruncatedRecordError(where, "the segment file", "no such file") from None
        try:
            check_header(_read_at(fd, HEADER.size, 0), SEGMENT_MAGIC, Where(file=str(path), record=key))
        except BaseException:
            os.close(fd)
            raise
        self._cache_fd(n, fd)
        return fd

    # -- writing -----------------------------------------------------------------------------
    def put(self, trace: RolloutTrace) -> None:
        self.put_many([trace])

    def put_many(self, traces: Iterable[RolloutTrace]) -> None:
        """Append traces in order. A Sequence with a duplicate key is refused before anything is
        written; otherwise records commit in order (one sync pair per COMMIT_BYTES), so a failure
        part-way leaves a prefix of the batch stored and nothing torn."""
        self._writable()
        with self._mutex:
            name = str(self.path)
            if isinstance(traces, Sequence):
                check_new_keys((check_trace(t, name).key for t in traces), self.__contains__, name)
            batch: list[tuple[str, bytes, bytes]] = []
            pending: set[str] = set()
            batch_bytes = 0
            try:
                for trace in traces:
                    check_new_keys([check_trace(trace, name).key], lambda k: k in self._entries or k in pending, name)
                    key_b = trace.key.encode("utf-8")
                    if len(key_b) > MAX_KEY_BYTES:
                        where = Where(file=str(self.path), record=trace.key[:64] + "...", field="key")
                        raise TraceFormatError(where, f"<= {MAX_KEY_BYTES} UTF-8 bytes", len(key_b))
                    for key, key_b2, payload in self._frames(trace, key_b):
                        batch.append((key, key_b2, payload))
                        batch_bytes += len(payload)
                    pending.add(trace.key)
                    if batch_bytes >= COMMIT_BYTES:
                        self._commit(batch)
                        batch, pending, batch_bytes = [], set(), 0
                if batch:
                    self._commit(batch)
            except BaseException:
                if self._table is not None and batch:  # chunks of the batch never written: forget them
                    self._table = self._chunk_table()
                raise

    def _frames(self, trace: RolloutTrace, key_b: bytes) -> list[tuple[str, bytes, bytes]]:
        """The frames that store `trace`: its new chunks (chunks.py), then its record."""
        if self.chunked and trace.key.startswith(CHUNK_KEY_PREFIX):
            where = Where(file=str(self.path), record=repr(trace.key[:40]), field="key")
            raise TraceFormatError(where, f"a key not starting with {CHUNK_KEY_PREFIX!r}", "one that does",
                                   "keys starting so name the store's route chunks")
        if self._table is None:
            return [(trace.key, key_b, encode_trace(trace))]
        record, split = encode_shared(trace, self._table, self.options.chunk_min_bytes)  # validated before any chunk is made
        return [(key, key.encode("utf-8"), payload) for key, payload in split.new] + [(trace.key, key_b, record)]

    def _commit(self, batch: list[tuple[str, bytes, bytes]]) -> None:
        """Frames first (synced), then their index entries (synced): the order crash safety rests on."""
        self._check_writer()  # before any byte of the commit: this process, this lock
        durable = self.options.durable
        try:
            new: list[tuple[str, bytes, Entry]] = []
            buf = bytearray()
            for key, key_b, payload in batch:
                size = FRAME.size + len(payload)
                if self._seg_size + len(buf) + size > self.options.segment_bytes and self._seg_size + len(buf) > HEADER.size:
                    self._flush_segment(buf)
                    buf = bytearray()
                    self._new_segment(self._seg + 1)
                crc = frame_crc(payload)
                new.append((key, key_b, Entry(self._seg, self._seg_size + len(buf), len(payload), crc)))
                buf += FRAME.pack(FRAME_MAGIC, len(payload), crc)
                buf += payload
            self._flush_segment(buf)
            index_bytes = b"".join(pack_entry(key_b, e) for _, key_b, e in new)
            _write_all(self._index_fd, index_bytes)
            if durable:
                _sync(self._index_fd)
        except BaseException as exc:
            self._failed = exc  # state on disk is unknown until a reopen repairs it
            raise
        self._index_end += len(index_bytes)
        for key, _, entry in new:
            self._entries[key] = entry
            self._damaged.pop(key, None)
            if self.chunked and key.startswith(CHUNK_KEY_PREFIX):
                self._nchunks += 1
                self._chunk_checks[key] = None  # written (and synced) by this session

    def _flush_segment(self, buf: bytearray) -> None:
        if not buf:
            return
        fd = self._fds[self._seg]
        _write_all(fd, buf)
        self._seg_size += len(buf)
        if self.options.durable:
            _sync(fd)

    def _writable(self) -> None:
        self._check_open()
        if self._copy_of is not None:  # a writer's pickled copy: refused by name, not as any reader
            self._check_writer()
        if self.readonly:
            raise ReadOnlyStoreError(f"store {str(self.path)!r} was opened with readonly=True; open a writer to add records")
        if self._failed is not None:
            raise MoeReplayError(
                f"an earlier write to store {str(self.path)!r} failed ({type(self._failed).__name__}: {self._failed}); "
                "close and reopen the store: committed records are intact and the reopen removes the partial write"
            )
        self._check_writer()

    def _check_writer(self) -> None:
        """Refuse, by name, a write from a process other than the one that opened this writer (a
        forked child, a pickled copy) or by a writer whose writer.lock was deleted, replaced or
        rewritten (another writer may hold the store): before anything is written (module doc)."""
        lock_path = self.path / LOCK_NAME
        here = os.getpid()
        if self._copy_of is not None:
            raise WriterProcessError(
                Where(file=str(self.path), field="writer"), f"writes through the writer of pid {self._copy_of}, in its process",
                f"a pickled copy of it in pid {here}",
                "a copy reads like a reader; open a writer in this process (after the first one closes) to add records")
        if here != self._pid:
            raise WriterProcessError(
                Where(file=str(self.path), field="writer"), f"writes from pid {self._pid}, the process that opened the writer",
                f"a write from pid {here} (a forked child: multiprocessing fork, a DataLoader worker)",
                "a child shares the writer's lock and file offsets, so its records and the parent's would overwrite each "
                "other; write from the parent, or open the store readonly=True in the child to read")
        if self.readonly or self._lock_fd is None:
            return
        try:
            st = os.stat(lock_path)
        except FileNotFoundError:
            found = "no such file (deleted under this writer)"
        else:
            holder = _read_at(self._lock_fd, 64, 0).decode(errors="replace").strip()
            if (st.st_dev, st.st_ino) != self._lock_id:
                found = f"another file (inode {st.st_ino}, not {self._lock_id[1]}): deleted and created again"
            elif holder != str(self._pid):
                found = f"the lock file naming pid {holder or 'none'}"
            else:
                return
        raise WriterLockLostError(
            Where(file=str(lock_path), field="writer.lock"),
            f"the lock file this writer (pid {self._pid}) locked, inode {self._lock_id[1]}", found,
            "another writer may have opened the store since, and two writers append over each other; nothing was "
            "written: close this writer (its earlier records are committed) and reopen it once no other writer runs")

    def __reduce__(self):
        """A pickled store arrives as a reader of the same directory (a writer's copy refuses writes by
        name: WriterProcessError); descriptors, locks and caches are not copied."""
        opts = {k: v for k, v in vars(self.options).items() if k not in ("readonly", "create")}
        return (_unpickled, (str(self.path), opts, None if self.readonly else self._pid))

    # -- reading -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"store {str(self.path)!r} is closed")

    def refresh(self) -> int:
        """Reader: pick up records committed since open (or the last refresh); return how many.
        After a writer replaced a damaged index, the new one is read whole. A writer already sees
        everything it wrote (returns 0)."""
        self._check_open()
        if not self.readonly:
            return 0
        if self.options.survey:
            raise MoeReplayError(f"store {str(self.path)!r} was opened with survey=True, a snapshot of what a writer "
                                 "would find at open; open a new reader to see later records")
        with self._mutex:
            if self._index_replaced():
                return self._reopen_index()
            size = os.fstat(self._index_fd).st_size
            if size < self._index_end:
                raise TraceFormatError(
                    Where(file=str(self.index_path)), f">= {self._index_end} bytes", f"{size} bytes",
                    "the index shrank below records already read: the store was rewritten; reopen it",
                )
            if size == self._index_end:
                return 0
            return self._absorb(_read_at(self._index_fd, size - self._index_end, self._index_end))

    def _index_replaced(self) -> bool:
        try:
            now = os.stat(self.index_path)
        except FileNotFoundError:
            return False
        mine = os.fstat(self._index_fd)
        return (now.st_ino, now.st_dev) != (mine.st_ino, mine.st_dev)

    def _reopen_index(self) -> int:
        """Reader: a writer replaced index.bin (a repair). Read the new one whole; every record
        already seen must be there, at the same place. Return how many records are new."""
        before = self._entries
        os.close(self._index_fd)
        self._index_fd = os.open(self.index_path, os.O_RDONLY)
        self._reset_view()
        self._load_index()
        moved = [k for k, e in before.items() if self._entries.get(k) != e]
        if moved:
            raise TraceFormatError(
                Where(file=str(self.index_path), record=moved[0]), "every record read before, at the same place",
                f"{len(moved)} absent or moved", "the store was rewritten under this reader; reopen it",
            )
        return len(self._entries) - len(before)

    def _record_entry(self, key: str) -> Entry | None:
        if self.chunked and isinstance(key, str) and key.startswith(CHUNK_KEY_PREFIX):
            return None
        return self._entries.get(key)

    def get(self, key: str, layers: Sequence[int] | None = None) -> RolloutTrace:
        """The trace stored under `key`. `layers`: MoE layer ids to read the routes of (a pipeline
        stage's own); the trace holds only those (`route_layer_ids`), and of each shared chunk only
        their bytes are read."""
        self._check_open()
        entry = self._record_entry(check_key(key, str(self.path)))
        if entry is None:
            raise self._missing(key)
        return self._read(key, entry, check_layers(layers, str(self.path), key))

    def get_many(self, keys: Sequence[str], layers: Sequence[int] | None = None) -> list[RolloutTrace]:
        """Traces for `keys`, in that order; read in file order (segment, offset) to keep I/O sequential.
        `layers` as for get()."""
        self._check_open()
        keys = check_keys(keys, str(self.path))
        layers = check_layers(layers, str(self.path))
        entries = []
        for key in keys:
            entry = self._record_entry(key)
            if entry is None:
                raise self._missing(key)
            entries.append(entry)
        out: list[RolloutTrace | None] = [None] * len(keys)
        for i in sorted(range(len(keys)), key=lambda i: entries[i][:2]):
            out[i] = self._read(keys[i], entries[i], layers)
        return out  # type: ignore[return-value]

    def _missing(self, key: str) -> TraceError:
        if key in self._damaged:
            return self._damaged[key]
        hints = [f"{len(self)} records stored"]
        if self._index_damage:
            hints.append(f"{len(self._index_damage)} damaged index entries (see scan())")
        if self._problems:
            hints.append(f"{len(self._problems)} damaged stretches of records (see scan())")
        if self.readonly:
            hints.append("call refresh() to see records committed since this reader opened")
        return MissingKeyError(Where(file=str(self.path), record=key), "a stored key", "absent", "; ".join(hints))

    def _read(self, key: str, e: Entry, layers: Sequence[int] | None = None) -> RolloutTrace:
        """pread one record frame, check it against the index entry, decode it with the chunks it
        names (read through read_chunk)."""
        where = Where(file=str(self.segment_path(e.segment)), record=key)
        payload = self._read_frame(e, key, where)
        self.stats.by_kind["records"] += FRAME.size + e.length
        trace = decode_trace(payload, where, chunks=self, layers=layers)
        if trace.key != key:
            raise TraceFormatError(where.with_(field="key"), repr(key), repr(trace.key), "record is not this entry's")
        return trace

    def _pread(self, e: Entry, size: int, at: int, key: str | None) -> bytes:
        with self._mutex:  # descriptors may be evicted by another thread
            self._check_open()
            data = _read_at(self._segment_fd(e.segment, key), size, at)
        self.stats.bytes_read += len(data)
        return data

    def _read_frame(self, e: Entry, key: str | None, where: Where, field_prefix: str = "") -> memoryview:
        """The payload of the frame entry `e` names, checked against the entry (magic, length, CRC)."""
        return read_frame(self._pread, e, key, where, field_prefix)

    # -- chunks: the ChunkSource of the records this store decodes --------------------------------
    def read_chunk(self, key: str, want: ChunkShape, first: int, stop: int, record_where: Where):
        """(tokens, routes of layers [first, stop)) of chunk `key` for the record `record_where`
        names: the whole frame (CRC-checked) for every layer, else the chunk's head, meta, tokens
        and the bytes of those layers (each CRC-checked; reading.py). Errors name the chunk and the record."""
        cache_key = (key, first, stop)
        with self._mutex:
            hit = self._cache.get(cache_key)
            if hit is not None:
                self.stats.chunk_cache_hits += 1
                return hit
        name = label(key)
        e = self._entries.get(key) if self.chunked and is_chunk_key(key) else None
        if e is None:
            hint = f" (index damage: {len(self._index_damage)} entries, see scan())" if self._index_damage else ""
            raise ChunkMissingError(record_where.with_(file=str(self.path), field=name), "the route chunk the record names",
                                    "no such chunk in the store", f"the record's routes cannot be read whole{hint}")
        where = Where(file=str(self.segment_path(e.segment)), record=record_where.record, field=chunk_field(key, e))
        try:
            got = read_chunk(self._pread, self.stats, e, key, want, first, stop, where)
        except TraceError as err:
            raise naming_chunk(err, where) from None
        with self._mutex:
            self._cache.put(cache_key, got)
        return got

    def check_chunk(self, key: str) -> TraceError | None:
        """None if stored chunk `key`'s frame is intact (magic, length and CRC-32 of the whole
        frame against its index entry, the key its meta holds), else the typed error naming the
        chunk, its segment (the error's file) and the offset of its frame (reading.check_chunk_frame).
        A writer asks it once per chunk per session before a record names the chunk; inspect asks
        it of every chunk."""
        self._check_open()
        e = self._entries.get(key) if self.chunked and is_chunk_key(key) else None
        if e is None:
            return ChunkMissingError(Where(file=str(self.path), field=label(key)), "a stored route chunk", "no such chunk")
        try:
            check_chunk_frame(self._pread, e, key, Where(file=str(self.segment_path(e.segment)), field=chunk_field(key, e)))
        except TraceError as err:
            return err
        return None

    def locate(self, key: str) -> tuple[str, int]:
        """(segment file name, offset) of the frame of stored record or chunk `key`."""
        e = self._entries.get(key)
        if e is None:
            raise self._missing(key)
        return segment_name(e.segment), e.offset

    def chunk_keys(self) -> list[str]:
        """Keys of the route chunks the store holds, in file order."""
        self._check_open()
        return [k for k in self._entries if k.startswith(CHUNK_KEY_PREFIX)] if self.chunked else []

    def chunk_bytes(self) -> int:
        """Bytes of the chunks' frames in the segment files."""
        return sum(FRAME.size + e.length for k, e in self._entries.items() if k.startswith(CHUNK_KEY_PREFIX)) if self.chunked else 0

    def record_chunks(self, key: str) -> list[str]:
        """Keys of the chunks record `key` names (reads its frame, not its chunks)."""
        from ..codec.record import record_chunks

        entry = self._record_entry(check_key(key, str(self.path)))
        if entry is None:
            raise self._missing(key)
        where = Where(file=str(self.segment_path(entry.segment)), record=key)
        return [k for _, _, k in record_chunks(bytes(self._read_frame(entry, key, where)), where)]

    def keys(self) -> list[str]:
        self._check_open()
        if not self._nchunks:
            return list(self._entries)
        return [k for k in self._entries if not k.startswith(CHUNK_KEY_PREFIX)]

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):  # keys are str: anything else is not stored (and may not be hashable)
            return False
        return key in self._entries and not (self._nchunks and key.startswith(CHUNK_KEY_PREFIX))

    def __len__(self) -> int:
        return len(self._entries) - self._nchunks

    def __iter__(self) -> Iterator[RolloutTrace]:
        return self.iter()

    def iter(self, errors: ErrorMode = "raise", on_error: OnError | None = None) -> Iterator[RolloutTrace]:
        """Traces in insertion order, one pread and decode at a time. Bad records and damaged bytes
        no entry names raise at their place in the order (errors="raise") or are skipped and
        reported. Damaged index entries lose no record (their frames are read again), so they are
        not read errors: scan() and `recovery` report them."""
        check_error_mode(errors)
        self._check_open()
        snapshot, problems = list(self._entries.items()), list(self._problems)
        p = 0
        for i, (key, entry) in enumerate(snapshot):
            while p < len(problems) and problems[p][0] <= i:
                handle_bad_record(problems[p][1], errors, on_error)
                p += 1
            if self._nchunks and key.startswith(CHUNK_KEY_PREFIX):
                continue
            try:
                trace = self._read(key, entry)
            except TraceError as err:
                handle_bad_record(err, errors, on_error)
                continue
            yield trace
        for _, err in problems[p:]:
            handle_bad_record(err, errors, on_error)

    def scan(self) -> tuple[list[str], list[TraceError]]:
        """(keys that read, checksum and validate, every error found): reads the whole store.
        The errors start with the damaged index entries still on disk."""
        bad: list[TraceError] = list(self._index_damage)
        good = [t.key for t in self.iter(errors="skip", on_error=bad.append)]
        return good, bad

    # -- closing -----------------------------------------------------------------------------
    def close(self) -> None:
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._cache.clear()
            if self._index_fd is not None:
                os.close(self._index_fd)
                self._index_fd = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        mode = "readonly" if self.readonly else "writer"
        state = "closed" if self._closed else f"{len(self._entries)} records"
        return f"DirectoryStore({str(self.path)!r}, {mode}, {state})"


def _unpickled(path: str, options: dict, writer_pid: int | None) -> DirectoryStore:
    """A store unpickled: a reader of `path` (a writer's copy remembers whose copy it is)."""
    store = DirectoryStore(path, readonly=True, **options)
    store._copy_of = writer_pid
    return store
