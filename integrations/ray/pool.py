"""A pool of Ray actors that score rollouts: the estimator sidecar across processes and machines.

Each actor owns one scorer built by a picklable factory (e.g. `functools.partial(HFScorer, cfg)`
or a vLLM scorer). The pool is a ScoringBackend for `moe_replay.estimator.service`: a batch goes
to an idle actor; if the actor dies mid-batch, the pool replaces it with a fresh one and raises
WorkerDied, and the service retries the batch's replicas, so no rollout is lost or scored twice
into one estimate. With `store_uri`, only keys cross the wire and actors read traces from the
shared directory store (one copy of a 1M-token step on disk instead of one per message; each
actor's store reader decodes a shared prefix's chunks once). Without it, batches go by reference
(refs.py): records plus object refs of the route chunks they share, each chunk put once and
fetched once per actor, so the n samples of a prompt, and the n re-scorings the estimator asks of
each rollout, carry its prefix's routes across the wire once per actor.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from moe_replay.errors import MoeReplayError
from moe_replay.store.chunks import WIRE_CHUNK_MIN_BYTES
from moe_replay.trace import RolloutTrace


class WorkerDied(MoeReplayError):
    """A scoring actor died (or was killed) while it held a batch; it has been replaced."""


@dataclass(frozen=True)
class RayPoolConfig:
    num_actors: int = 2
    """Scoring actors (one scorer each)."""
    actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 1})
    """Passed to `.options()` of each actor (num_cpus, num_gpus, resources, ...)."""
    store_uri: str | None = None
    """A DirectoryStore path the actors read traces from; None sends traces by value."""
    call_timeout_s: float | None = None
    """Treat an actor that takes longer than this on one batch as dead."""
    by_reference: bool = True
    """Without store_uri: send batches as records and object refs of their shared route chunks
    (refs.py); False pickles every trace whole."""
    chunk_min_bytes: int = WIRE_CHUNK_MIN_BYTES
    """A run of shared routes shipped as its own object when it holds at least this many bytes
    (at the order-preserving bound; smaller runs travel in their records)."""

    def __post_init__(self) -> None:
        if self.num_actors < 1:
            raise ValueError(f"RayPoolConfig.num_actors must be >= 1, got {self.num_actors}")
        if isinstance(self.chunk_min_bytes, bool) or not isinstance(self.chunk_min_bytes, int) or self.chunk_min_bytes < 0:
            raise ValueError(f"RayPoolConfig.chunk_min_bytes must be an int >= 0, got {self.chunk_min_bytes!r}")
        if self.store_uri is not None and self.store_uri.startswith("memory://"):
            raise ValueError(f"RayPoolConfig.store_uri: actors in other processes cannot read {self.store_uri!r}; use a directory store")


class _ScorerActor:
    """Body of the Ray actor (made remote lazily so importing this module never imports ray)."""

    def __init__(self, factory: Callable[[], Any], store_uri: str | None) -> None:
        import ray

        from .refs import ChunkCache

        self.scorer = factory()
        self.store = None
        self.cache = ChunkCache(ray.get)
        if store_uri is not None:
            from moe_replay.store import open_store

            self.store = open_store(store_uri, readonly=True)

    def score(self, traces: Sequence[RolloutTrace]) -> list[np.ndarray]:
        return self.scorer.score_batch(traces)

    def score_shipment(self, shipment) -> list[np.ndarray]:
        return self.scorer.score_batch(self.cache.traces(shipment))

    def fetched(self) -> int:
        """Route chunks this actor has fetched from the object store."""
        return self.cache.fetched

    def score_keys(self, keys: Sequence[str]) -> list[np.ndarray]:
        missing = [k for k in keys if k not in self.store]
        if missing:
            self.store.refresh()  # records appended since this actor opened the store
        return self.scorer.score_batch(self.store.get_many(list(keys)))

    def identity(self) -> tuple:
        """What the scorer states of the traces it takes (moe_replay.identity.consumer_identity)."""
        from moe_replay.identity import consumer_identity

        return consumer_identity(self.scorer)

    def pid(self) -> int:
        import os

        return os.getpid()


class RayScorerPool:
    """ScoringBackend over Ray actors; call `shutdown()` (or use as a context manager) when done."""

    def __init__(self, factory: Callable[[], Any], config: RayPoolConfig = RayPoolConfig()) -> None:
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RayScorerPool needs a running Ray: call ray.init(...) first")
        self._ray = ray
        self._remote_cls = ray.remote(max_restarts=0)(_ScorerActor)
        self.factory, self.config = factory, config
        from .refs import ChunkShipper

        self.shipper = ChunkShipper(ray.put, chunk_min_bytes=config.chunk_min_bytes)
        """Puts each shared route chunk into the object store once (by_reference)."""
        self._idle: asyncio.Queue | None = None
        self.actors = [self._spawn() for _ in range(config.num_actors)]
        self.replaced = 0
        ray.get([a.pid.remote() for a in self.actors])  # fail fast if the factory cannot build a scorer
        self.geometry, self.weights_version, self.off_policy = ray.get(self.actors[0].identity.remote())
        """What the actors' scorers state (identity.py): the estimator checks each rollout against it at
        submit, before any batch is shipped (a refusal is not retried), and every actor checks again."""

    def _spawn(self):
        return self._remote_cls.options(**self.config.actor_options).remote(self.factory, self.config.store_uri)

    def _queue(self) -> asyncio.Queue:
        if self._idle is None:  # bound to the loop that first uses the pool
            self._idle = asyncio.Queue()
            for a in self.actors:
                self._idle.put_nowait(a)
        return self._idle

    async def score(self, traces: Sequence[RolloutTrace]) -> list[np.ndarray]:
        idle = self._queue()
        actor = await idle.get()
        replacement = actor
        try:
            if self.config.store_uri is not None:
                ref = actor.score_keys.remote([t.key for t in traces])
            elif self.config.by_reference:
                ref = actor.score_shipment.remote(self.shipper.ship(traces))
            else:
                ref = actor.score.remote(list(traces))
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.config.call_timeout_s)
        except (self._ray.exceptions.RayActorError, asyncio.TimeoutError) as e:
            replacement = self._replace(actor)
            raise WorkerDied(f"scoring actor died with a batch of {len(traces)} rollouts ({type(e).__name__}); replaced") from e
        finally:
            idle.put_nowait(replacement)

    def _replace(self, actor):
        try:
            self._ray.kill(actor)
        except Exception:  # already dead
            pass
        new = self._spawn()
        self.actors[self.actors.index(actor)] = new
        self.replaced += 1
        return new

    def kill_one(self, index: int = 0) -> None:
        """Kill an actor abruptly (as a crash would); for fault-tolerance tests and drills."""
        self._ray.kill(self.actors[index], no_restart=True)

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                self._ray.kill(a)
            except Exception:
                pass
        self.actors = []

    def __enter__(self) -> "RayScorerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
