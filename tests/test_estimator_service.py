"""The async sidecar's bookkeeping: exactly one outcome per rollout, retries, backpressure, cancel.

Backends here are pure-logic fakes (they test scheduling, not an engine); the real-engine and
Ray tests live beside their adapters.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from moe_replay.estimator import EstimatorConfig
from moe_replay.estimator.service import (
    Cancelled,
    EstimatorService,
    ScoringFailed,
    ServiceConfig,
    ThreadBackend,
    estimate_stream,
)
from moe_replay.geometry import ModelGeometry
from moe_replay.trace import RolloutTrace

GEOM = ModelGeometry(2, (0, 1), 8, 2, 64)


def traces(n: int, s: int = 12, prompt: int = 4) -> list[RolloutTrace]:
    return [RolloutTrace(f"r{i}", np.arange(s + i % 3) % 64, prompt, GEOM) for i in range(n)]


def exact(batch):
    return [-np.arange(1, t.num_generated + 1) / 10.0 for t in batch]


class Recording:
    """Records batches; fails the batches whose running index is in `fail_on`."""

    def __init__(self, fail_on=(), delay=0.0):
        self.batches, self.calls, self.fail_on, self.delay = [], 0, set(fail_on), delay

    async def score(self, batch):
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.calls in self.fail_on:
            raise RuntimeError(f"worker died on call {self.calls}")
        self.batches.append([t.key for t in batch])
        return exact(batch)


def run(coro):
    return asyncio.run(coro)


def test_every_rollout_gets_one_estimate_and_replicas_never_share_a_batch():
    backend = Recording()
    out = run(estimate_stream(traces(10), backend, EstimatorConfig(n=4), ServiceConfig(batch_size=4)))
    assert list(out) == [f"r{i}" for i in range(10)]
    for t, (key, est) in zip(traces(10), out.items()):
        assert est.n == 4 and np.allclose(est.logprob_G, exact([t])[0], atol=1e-12)
    assert all(len(b) == len(set(b)) for b in backend.batches)
    assert sum(len(b) for b in backend.batches) == 40


def test_failed_batches_are_retried_and_nothing_is_lost_or_duplicated():
    backend = Recording(fail_on={2, 3, 7})
    cfg = ServiceConfig(batch_size=3, max_attempts=3, retry_backoff_s=0)
    out = run(estimate_stream(traces(9), backend, EstimatorConfig(n=2), cfg))
    assert all(not isinstance(v, Exception) and v.n == 2 for v in out.values())
    scored = [k for b in backend.batches for k in b]
    assert sorted(scored) == sorted([f"r{i}" for i in range(9)] * 2)  # each replica exactly once


def test_persistent_failure_is_reported_once_per_rollout():
    class Dead:
        async def score(self, batch):
            raise RuntimeError("engine gone")

    out = run(estimate_stream(traces(5), Dead(), EstimatorConfig(n=2), ServiceConfig(max_attempts=2, retry_backoff_s=0)))
    assert len(out) == 5
    for key, v in out.items():
        assert isinstance(v, ScoringFailed) and v.key == key and v.attempts == 2 and "engine gone" in str(v)


def test_backpressure_bounds_inflight_tokens():
    seen = []

    async def main():
        backend = Recording(delay=0.01)
        cfg = ServiceConfig(batch_size=2, max_inflight_tokens=40)
        async with EstimatorService(backend, EstimatorConfig(n=2), cfg) as svc:
            async def watch():
                while True:
                    seen.append(svc.inflight_tokens)
                    await asyncio.sleep(0.001)

            watcher = asyncio.create_task(watch())
            ts = traces(12)
            for t in ts:
                await svc.submit(t)
                seen.append(svc.inflight_tokens)
            for t in ts:
                await svc.result(t.key)
            watcher.cancel()
            return svc.inflight_tokens

    assert run(main()) == 0
    assert max(seen) <= 40 and max(seen) >= 24  # bounded, yet more than one rollout at a time


def test_cancel_and_unknown_key():
    async def main():
        async with EstimatorService(Recording(delay=0.05), EstimatorConfig(n=2)) as svc:
            a, b = traces(2)
            await svc.submit(a)
            await svc.submit(b)
            assert svc.cancel("r1")
            with pytest.raises(Cancelled):
                await svc.result("r1")
            est = await svc.result("r0")
            assert est.n == 2 and not svc.cancel("r0")
            with pytest.raises(KeyError, match="never submitted"):
                await svc.result("nope")
            with pytest.raises(ValueError, match="already submitted"):
                await svc.submit(a)

    run(main())


def test_thread_backend_and_adaptive_mode():
    rng = np.random.default_rng(0)

    def noisy(batch):
        return [np.full(t.num_generated, -0.7) + (0 if t.key == "r0" else rng.normal(0, 0.1, t.num_generated)) for t in batch]

    cfg = EstimatorConfig(n=2, adaptive=True, min_n=2, max_n=8, rel_tol=1e-4)
    out = run(estimate_stream(traces(2), ThreadBackend(noisy), cfg))
    assert out["r0"].n == 2 and out["r1"].n == 8
