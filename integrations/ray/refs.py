"""Traces to Ray actors by reference: what records share crosses the wire once per actor.

A batch sent by value pickles every trace whole: the n samples of a prompt carry its routes n
times, and the estimator sends each rollout to be re-scored n times, so a 2,048-token prompt's
routes cross the wire n x n times. Here the pool side (`ChunkShipper`) stores each batch as the
stores do (store/chunks.py): records that name shared route chunks, and each chunk `ray.put`
once into the object store; a batch goes as its record bytes plus the object refs of the chunks
it names. The actor side (`ChunkCache`) fetches a chunk the first time a record names it
(`ray.get`) and keeps it for the next records, so each chunk's bytes reach an actor once while it
stays in the cache; records decode to exactly the traces sent (`RolloutTrace.equals`).

Both sides are bounded: the shipper holds the refs (so the object store keeps the payloads) of
its last `max_bytes` of chunks (an older one is put again if a later trace shares it), the cache
its last `max_bytes` of chunk payloads.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from moe_replay.codec.chunk import ChunkShape
from moe_replay.codec.record import decode_trace
from moe_replay.errors import Where
from moe_replay.store.chunks import DEFAULT_CHUNK_MIN_BYTES, ChunkTable, encode_shared, read_held
from moe_replay.trace import RolloutTrace

DEFAULT_SHIP_BYTES = 256 << 20
DEFAULT_CACHE_BYTES = 256 << 20


@dataclass
class Shipment:
    """One batch as it crosses the wire: record bytes and the refs of the chunks they name."""

    records: list[bytes]
    chunks: dict[str, Any]
    """chunk key -> ray ObjectRef of its payload (left unresolved: the actor fetches only the ones it lacks)."""


@dataclass
class ShipStats:
    record_bytes: int = 0
    chunk_bytes_put: int = 0
    """Chunk payloads put into the object store (each once while the shipper holds its ref)."""
    chunks_reused: int = 0


@dataclass
class ChunkShipper:
    """The pool side: traces -> Shipment, each chunk put once (see the module doc)."""

    put: Any
    """ray.put"""
    chunk_min_bytes: int = DEFAULT_CHUNK_MIN_BYTES
    max_bytes: int = DEFAULT_SHIP_BYTES
    stats: ShipStats = field(default_factory=ShipStats)

    def __post_init__(self) -> None:
        self._refs: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        """chunk key -> (ObjectRef, payload bytes), oldest first."""
        self._bytes = 0
        self._table = ChunkTable()

    def ship(self, traces: Sequence[RolloutTrace]) -> Shipment:
        records, needed = [], {}
        for trace in traces:
            record, split = encode_shared(trace, self._table, self.chunk_min_bytes)
            for key, payload in split.new:
                self._refs[key] = (self.put(payload), len(payload))
                self._bytes += len(payload)
                self.stats.chunk_bytes_put += len(payload)
            for piece in split.pieces:
                self._refs.move_to_end(piece.key)
                needed[piece.key] = self._refs[piece.key][0]
            self.stats.chunks_reused += len(split.pieces) - len(split.new)
            records.append(record)
            self.stats.record_bytes += len(records[-1])
        if self._bytes > self.max_bytes:  # forget the oldest: a later trace sharing one puts it again
            while self._bytes > self.max_bytes and len(self._refs) > len(needed):
                self._bytes -= self._refs.popitem(last=False)[1][1]
            self._table = ChunkTable()
            for key in self._refs:
                self._table.add(key)
        return Shipment(records, needed)


@dataclass
class ChunkCache:
    """The actor side: a Shipment -> its traces, fetching only the chunks it does not hold."""

    get: Any
    """ray.get"""
    max_bytes: int = DEFAULT_CACHE_BYTES
    fetched: int = 0
    """Chunk payloads fetched so far (a chunk named again while cached is not fetched again)."""

    def __post_init__(self) -> None:
        self._chunks: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0

    def traces(self, shipment: Shipment) -> list[RolloutTrace]:
        missing = [k for k in shipment.chunks if k not in self._chunks]
        for key, payload in zip(missing, self.get([shipment.chunks[k] for k in missing]) if missing else ()):
            self._chunks[key] = payload
            self._bytes += len(payload)
            self.fetched += 1
        for key in shipment.chunks:
            self._chunks.move_to_end(key)
        out = [decode_trace(record, Where(file="ray shipment"), chunks=self) for record in shipment.records]
        while self._bytes > self.max_bytes and len(self._chunks) > len(shipment.chunks):
            _, old = self._chunks.popitem(last=False)
            self._bytes -= len(old)
        return out

    def read_chunk(self, key: str, want: ChunkShape, first: int, stop: int, record_where: Where):
        """The ChunkSource of the shipment's records (codec.record)."""
        return read_held(self._chunks, key, want, first, stop, record_where, "not in the shipment")
