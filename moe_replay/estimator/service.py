"""The async π_old sidecar: rollouts stream in as they finish, estimates stream out.

Each submitted rollout yields exactly one outcome: a PiOldEstimate, a ScoringFailed error
after `max_attempts` tries of each of its replicas, a RolloutReplicaError when its recorded
logprobs were to count as a replica (EstimatorConfig.rollout_replica) and cannot, or Cancelled.
Memory stays flat because `submit` waits while the tokens of unfinished rollouts exceed
`max_inflight_tokens` (backpressure). Replicas of one rollout are queued round-robin with other
rollouts' replicas, so they land in different batches (different neighbours, different slots),
which is what makes engine noise independent.

A backend is anything with `async score(traces) -> list[logprobs_G]` for one batch; the local
backend wraps a synchronous scorer in a thread, the Ray pool (integrations/ray) spreads batches
over actors and replaces dead ones.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol, Sequence

import numpy as np

from ..errors import MoeReplayError, TraceError
from ..identity import check_consumer, consumer_identity
from ..trace import RolloutTrace
from .core import EstimatorConfig, PiOldEstimate, RolloutReplicaError, _rel_stderr_max, combine, rollout_replica_G


class ScoringBackend(Protocol):
    async def score(self, traces: Sequence[RolloutTrace]) -> list[np.ndarray]:
        """One batch, one replica each: the logprobs of every trace's generated tokens."""
        ...


class ScoringFailed(MoeReplayError):
    """A rollout could not be scored; carries the rollout key and the last underlying error."""

    def __init__(self, key: str, attempts: int, cause: BaseException | str) -> None:
        self.key, self.attempts, self.cause = key, attempts, cause
        super().__init__(f"rollout {key!r}: scoring failed after {attempts} attempt(s): {cause!r}")

    def __reduce__(self):
        return (type(self), (self.key, self.attempts, repr(self.cause)))


class Cancelled(MoeReplayError):
    """The caller cancelled this rollout before it finished."""


@dataclass(frozen=True)
class ServiceConfig:
    """Scheduling of the sidecar (the estimator math lives in EstimatorConfig)."""

    batch_size: int = 8
    """Rollout replicas per scoring batch."""
    concurrency: int = 1
    """Batches in flight at once (set to the number of backend workers/actors)."""
    max_inflight_tokens: int = 1 << 20
    """Backpressure: submit() waits while unfinished rollouts hold more tokens than this."""
    max_attempts: int = 3
    """Tries per replica before the rollout is reported as failed."""
    retry_backoff_s: float = 0.05
    """Sleep before re-queueing a failed batch (doubles per attempt)."""
    batch_wait_s: float = 0.002
    """How long a partial batch waits for more work before it is sent anyway."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "concurrency", "max_inflight_tokens", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServiceConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.retry_backoff_s < 0 or self.batch_wait_s < 0:
            raise ValueError(f"ServiceConfig backoff/wait must be >= 0, got {self.retry_backoff_s}, {self.batch_wait_s}")


@dataclass
class _Job:
    trace: RolloutTrace
    future: asyncio.Future
    replicas: list[np.ndarray] = field(default_factory=list)
    queued: int = 0  # replicas queued or running
    target: int = 0  # replicas wanted so far
    attempts: dict[int, int] = field(default_factory=dict)  # replica slot -> failed tries
    done: bool = False
    off_policy: bool = False  # sampled under other weights than the backend's, scored on purpose


class ThreadBackend:
    """Runs a synchronous batch scorer in a worker thread so the event loop stays responsive.

    Takes a scorer (anything with `score_batch`) or a batch function; whether a rollout's recorded
    logprobs count as a replica is the scorer's to say (`recorded_logprobs_problem`), so a bare
    function, or the bound method of a scorer that cannot say, is refused for it.
    """

    def __init__(self, score_batch: Callable[[Sequence[RolloutTrace]], list[np.ndarray]] | object) -> None:
        self._score = getattr(score_batch, "score_batch", score_batch)
        self._owner = score_batch if hasattr(score_batch, "score_batch") else getattr(score_batch, "__self__", None)

    async def score(self, traces):
        return await asyncio.to_thread(self._score, list(traces))

    @property
    def geometry(self):
        """The wrapped scorer's identity (identity.consumer_identity), checked at submit."""
        return consumer_identity(self._owner)[0]

    @property
    def weights_version(self):
        return consumer_identity(self._owner)[1]

    @property
    def off_policy(self) -> bool:
        return consumer_identity(self._owner)[2]

    def recorded_logprobs_problem(self, trace: RolloutTrace) -> str | None:
        check = getattr(self._owner, "recorded_logprobs_problem", None)
        if check is None:
            return f"the wrapped scorer ({type(self._owner or self._score).__name__}) cannot say what its scores mean"
        return check(trace)


class EstimatorService:
    """Use as `async with EstimatorService(backend, cfg) as svc: await svc.submit(t); await svc.result(k)`."""

    def __init__(self, backend: ScoringBackend, config: EstimatorConfig = EstimatorConfig(),
                 service: ServiceConfig = ServiceConfig(), *, keep_replicas: bool = False) -> None:
        self.backend, self.config, self.service, self.keep_replicas = backend, config, service, keep_replicas
        self._jobs: dict[str, _Job] = {}
        self._queue: collections.deque[tuple[str, int]] = collections.deque()  # (key, replica slot)
        self._inflight_tokens = 0
        self._cond: asyncio.Condition | None = None
        self._work: asyncio.Event | None = None
        self._finished: asyncio.Queue | None = None
        self._workers: list[asyncio.Task] = []
        self._closed = False
        self.stats = collections.Counter()

    # -- lifecycle -------------------------------------------------------------------------------
    async def __aenter__(self) -> "EstimatorService":
        self._cond, self._work, self._finished = asyncio.Condition(), asyncio.Event(), asyncio.Queue()
        self._workers = [asyncio.create_task(self._worker(i)) for i in range(self.service.concurrency)]
        return self

    async def __aexit__(self, *exc) -> None:
        for w in self._workers:
            w.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        for job in self._jobs.values():
            if not job.done:
                self._finish(job, error=Cancelled(f"rollout {job.trace.key!r}: service closed before it finished"))

    @property
    def inflight_tokens(self) -> int:
        return self._inflight_tokens

    # -- client side -----------------------------------------------------------------------------
    async def submit(self, trace: RolloutTrace) -> None:
        """Queue a finished rollout; waits (backpressure) while too many tokens are in flight."""
        if self._cond is None:
            raise RuntimeError("EstimatorService must be used inside `async with`")
        if self._closed:
            raise RuntimeError(f"rollout {trace.key!r} submitted after close()")
        if trace.key in self._jobs:
            raise ValueError(f"rollout {trace.key!r} was already submitted to this service")
        need = min(trace.num_tokens, self.service.max_inflight_tokens)  # a huge rollout still runs alone
        async with self._cond:
            await self._cond.wait_for(lambda: self._inflight_tokens + need <= self.service.max_inflight_tokens)
            self._inflight_tokens += need
        job = _Job(trace, asyncio.get_running_loop().create_future())
        job.future.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)  # no "never retrieved"
        self._jobs[trace.key] = job
        self.stats["submitted"] += 1
        try:  # the one identity check (identity.py), against what the backend states: refused once, not retried
            job.off_policy = bool(check_consumer([trace], self.backend)[0])
        except TraceError as e:
            self._finish(job, error=e)
            return
        first = self.config.min_n if self.config.adaptive else self.config.n
        if self.config.rollout_replica:  # replica 0 is the rollout's own; refused here, before any scoring
            try:
                job.replicas.append(rollout_replica_G(trace, self.backend))
            except RolloutReplicaError as e:
                self._finish(job, error=e)
                return
            job.target = 1
            self.stats["rollout_replicas"] += 1
            if first == 1:
                self._settle(job)
                return
        self._enqueue(job, first - job.target)

    async def result(self, key: str) -> PiOldEstimate:
        """The estimate for one rollout (raises its ScoringFailed / Cancelled)."""
        try:
            job = self._jobs[key]
        except KeyError:
            raise KeyError(f"rollout {key!r} was never submitted to this service") from None
        return await asyncio.shield(job.future)

    def close(self) -> None:
        """No more submissions: `results()` ends once every submitted rollout has its outcome."""
        self._closed = True
        self._finished.put_nowait(None)  # wake a waiting results() so it can re-check

    async def results(self) -> AsyncIterator[tuple[str, PiOldEstimate | MoeReplayError]]:
        """(key, estimate or error) in completion order; ends after close() and the last outcome."""
        delivered = 0
        while not (self._closed and delivered == len(self._jobs)):
            item = await self._finished.get()
            if item is None:
                continue
            delivered += 1
            yield item

    def cancel(self, key: str) -> bool:
        """Drop a rollout's pending work; its outcome becomes Cancelled. False if already done."""
        job = self._jobs.get(key)
        if job is None or job.done:
            return False
        self._finish(job, error=Cancelled(f"rollout {key!r} was cancelled"))
        return True

    # -- scheduling ------------------------------------------------------------------------------
    def _enqueue(self, job: _Job, replicas: int) -> None:
        # Siblings are appended together; _next_batch never puts two replicas of one rollout in
        # one batch, so each replica is scored beside different neighbours.
        self._queue.extend((job.trace.key, slot) for slot in range(job.target, job.target + replicas))
        job.target += replicas
        job.queued += replicas
        self._work.set()

    def _next_batch(self) -> list[tuple[str, int]]:
        batch, seen = [], set()
        skipped = []
        while self._queue and len(batch) < self.service.batch_size:
            key, slot = self._queue.popleft()
            job = self._jobs[key]
            if job.done:
                continue
            if key in seen:  # never two replicas of one rollout in one batch
                skipped.append((key, slot))
                continue
            seen.add(key)
            batch.append((key, slot))
        self._queue.extendleft(reversed(skipped))
        if not self._queue:
            self._work.clear()
        return batch

    async def _worker(self, wid: int) -> None:
        while True:
            await self._work.wait()
            if self.service.batch_wait_s and len(self._queue) < self.service.batch_size:
                await asyncio.sleep(self.service.batch_wait_s)
            batch = self._next_batch()
            if not batch:
                continue
            traces = [self._jobs[k].trace for k, _ in batch]
            try:
                out = await self.backend.score(traces)
                if len(out) != len(batch):
                    raise ValueError(f"backend returned {len(out)} results for a batch of {len(batch)}")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a dead worker, a timeout, a bad result: retry each replica
                self.stats["batch_failures"] += 1
                await self._retry(batch, e)
                continue
            self.stats["batches"] += 1
            for (key, slot), lp in zip(batch, out):
                self._accept(self._jobs[key], slot, lp)

    async def _retry(self, batch: list[tuple[str, int]], error: BaseException) -> None:
        again = []
        for key, slot in batch:
            job = self._jobs[key]
            if job.done:
                continue
            job.attempts[slot] = job.attempts.get(slot, 0) + 1
            if job.attempts[slot] >= self.service.max_attempts:
                self._finish(job, error=ScoringFailed(key, job.attempts[slot], error))
            else:
                again.append((key, slot))
        if again:
            worst = max(self._jobs[k].attempts[s] for k, s in again)
            await asyncio.sleep(self.service.retry_backoff_s * 2 ** (worst - 1))
            self._queue.extend(again)
            self.stats["retried"] += len(again)
            self._work.set()

    def _accept(self, job: _Job, slot: int, lp: np.ndarray) -> None:
        if job.done:
            return
        lp = np.asarray(lp, dtype=np.float64)
        if lp.shape != (job.trace.num_generated,):
            self._finish(job, error=ScoringFailed(job.trace.key, 1, ValueError(
                f"expected [{job.trace.num_generated}] generated-token logprobs, found shape {list(lp.shape)}")))
            return
        job.replicas.append(lp)
        job.queued -= 1
        if not job.queued:
            self._settle(job)

    def _settle(self, job: _Job) -> None:
        """Every queued replica is in: add replicas (adaptive) or finish with the estimate."""
        cfg = self.config
        if cfg.adaptive and job.target < cfg.max_n and _rel_stderr_max(job.replicas) > cfg.rel_tol:
            self._enqueue(job, min(cfg.max_n, job.target * 2) - job.target)
            return
        try:
            self._finish(job, estimate=combine(job.trace.key, np.stack(job.replicas), cfg.averaging,
                                               self.keep_replicas, cfg.rollout_replica,
                                               weights_version=consumer_identity(self.backend)[1],
                                               off_policy=job.off_policy))
        except ValueError as e:
            self._finish(job, error=ScoringFailed(job.trace.key, 1, e))

    def _finish(self, job: _Job, *, estimate: PiOldEstimate | None = None, error: MoeReplayError | None = None) -> None:
        job.done = True
        if estimate is not None:
            job.future.set_result(estimate)
            self.stats["estimated"] += 1
        else:
            job.future.set_exception(error)
            self.stats["cancelled" if isinstance(error, Cancelled) else "failed"] += 1
        self._finished.put_nowait((job.trace.key, estimate if estimate is not None else error))
        self._inflight_tokens -= min(job.trace.num_tokens, self.service.max_inflight_tokens)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()


async def estimate_stream(
    traces: Sequence[RolloutTrace],
    backend: ScoringBackend,
    config: EstimatorConfig = EstimatorConfig(),
    service: ServiceConfig = ServiceConfig(),
) -> dict[str, PiOldEstimate | MoeReplayError]:
    """Run a set of rollouts through a service, submitting while results flow; outcome per key."""
    async with EstimatorService(backend, config, service) as svc:

        async def feed() -> None:
            for t in traces:
                await svc.submit(t)
            svc.close()

        feeder = asyncio.create_task(feed())
        out = {key: outcome async for key, outcome in svc.results()}
        await feeder
    return {t.key: out[t.key] for t in traces}
