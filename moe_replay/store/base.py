"""The one interface every trace store implements, and the registry that opens them by name."""

from __future__ import annotations

import abc
from typing import Iterable, Iterator, Sequence

from ..registry import Registry
from ..trace import RolloutTrace


class TraceStore(abc.ABC):
    """Keyed collection of RolloutTrace records (key = rollout / request id).

    Contract:
      * `put` refuses a key that is already present (DuplicateKeyError), so nothing is overwritten;
      * `get` of an absent key raises MissingKeyError naming the key and the store;
      * `get_many` returns traces in the order of the keys asked for;
      * iteration yields traces in insertion order, decoding one at a time (bounded memory);
      * a record is visible to readers only once it is complete;
      * a trace reads back exactly as it was put (`RolloutTrace.equals`), whether or not the store
        keeps the routes it shares with other records once (shared route chunks, store/chunks.py);
      * `get(key, layers=...)` reads the routes of those MoE layers only (`route_layer_ids`).
    """

    @abc.abstractmethod
    def put(self, trace: RolloutTrace) -> None: ...

    def put_many(self, traces: Iterable[RolloutTrace]) -> None:
        for trace in traces:
            self.put(trace)

    @abc.abstractmethod
    def get(self, key: str, layers: Sequence[int] | None = None) -> RolloutTrace: ...

    def get_many(self, keys: Sequence[str], layers: Sequence[int] | None = None) -> list[RolloutTrace]:
        return [self.get(k, layers) for k in keys]

    @abc.abstractmethod
    def keys(self) -> list[str]:
        """Keys in insertion order."""

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int:
        return len(self.keys())

    def __iter__(self) -> Iterator[RolloutTrace]:
        for key in self.keys():
            yield self.get(key)

    def close(self) -> None:
        """Release files and locks; the store is unusable afterwards."""

    def __enter__(self) -> "TraceStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


STORES: Registry[type[TraceStore]] = Registry("trace store")
