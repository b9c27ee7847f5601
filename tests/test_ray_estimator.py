"""The π_old sidecar on a Ray actor pool with a real HF scorer: a killed worker loses nothing."""

from __future__ import annotations

import asyncio
import functools

import numpy as np
import pytest

from moe_replay.estimator import EstimatorConfig
from moe_replay.estimator.service import EstimatorService, ServiceConfig
from moe_replay.geometry import EngineInfo
from moe_replay.integrations.hf.scorer import HFScorer, HFScorerConfig
from moe_replay.models import geometry_of
from moe_replay.store import DirectoryStore
from moe_replay.trace import RolloutTrace

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("qwen3_moe")


def make_traces(model_dir, n: int, seed: int = 0) -> list[RolloutTrace]:
    geometry = geometry_of(model_dir)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt, gen = int(rng.integers(4, 12)), int(rng.integers(3, 10))
        ids = rng.integers(3, geometry.vocab_size, prompt + gen)
        out.append(RolloutTrace(f"roll-{i}", ids, prompt, geometry, engine=EngineInfo("hf", dtype="float32")))
    return out


def run_service(pool, traces, *, kill_after_batches=None, n=2):
    async def main():
        cfg = ServiceConfig(batch_size=3, concurrency=2, max_attempts=4, retry_backoff_s=0.01)
        async with EstimatorService(pool, EstimatorConfig(n=n), cfg) as svc:
            async def killer():
                while svc.stats["batches"] < kill_after_batches:
                    await asyncio.sleep(0.005)
                pool.kill_one(0)

            k = asyncio.create_task(killer()) if kill_after_batches is not None else None
            for t in traces:
                await svc.submit(t)
            svc.close()
            out = {key: o async for key, o in svc.results()}
            if k:
                await k
            return out, dict(svc.stats)

    return asyncio.run(main())


def test_killed_actor_is_replaced_and_every_rollout_gets_one_estimate(ray_session, model_dir):
    from moe_replay.integrations.ray.pool import RayPoolConfig, RayScorerPool

    traces = make_traces(model_dir, 12)
    reference = HFScorer(HFScorerConfig(str(model_dir))).score_batch(traces)
    factory = functools.partial(HFScorer, HFScorerConfig(str(model_dir)))
    with RayScorerPool(factory, RayPoolConfig(num_actors=2)) as pool:
        out, stats = run_service(pool, traces, kill_after_batches=2)
        assert pool.replaced >= 1 and stats["retried"] >= 1
    assert sorted(out) == sorted(t.key for t in traces)
    for t, ref in zip(traces, reference):
        est = out[t.key]
        assert not isinstance(est, Exception), est
        assert est.n == 2
        # fp32 CPU scoring is deterministic: replicas agree and the mean is the single score
        assert np.max(np.abs(est.logprob_G - ref)) < 1e-5


def test_actors_read_traces_from_a_shared_directory_store(ray_session, model_dir, tmp_path):
    from moe_replay.integrations.ray.pool import RayPoolConfig, RayScorerPool

    traces = make_traces(model_dir, 5, seed=1)
    with DirectoryStore(tmp_path / "store") as store:
        store.put_many(traces[:2])
        factory = functools.partial(HFScorer, HFScorerConfig(str(model_dir)))
        with RayScorerPool(factory, RayPoolConfig(num_actors=1, store_uri=str(tmp_path / "store"))) as pool:
            store.put_many(traces[2:])  # appended after the actor opened the store: it must refresh
            out, _ = run_service(pool, traces, n=1)
    assert all(out[t.key].n == 1 and out[t.key].logprob_G.shape == (t.num_generated,) for t in traces)


def test_batches_by_reference_carry_a_shared_prefix_once_per_actor(ray_session, model_dir):
    """n = 4 samples of one prompt, each re-scored twice under its recorded routes: the prompt's routes
    are put into the object store once and fetched once by the actor; every estimate equals a direct
    score of the whole traces."""
    from moe_replay.integrations.ray.pool import RayPoolConfig, RayScorerPool
    from tests.trace_factory import random_routes

    geometry = geometry_of(model_dir)
    rng = np.random.default_rng(2)
    prompt_S, prompt_TLK = rng.integers(3, geometry.vocab_size, 48), random_routes(rng, 48, geometry)
    traces = []
    for i in range(4):
        tokens = np.concatenate([prompt_S, rng.integers(3, geometry.vocab_size, 6 + i)])
        routes = np.concatenate([prompt_TLK, random_routes(rng, len(tokens) - 1 - 48, geometry)])
        traces.append(RolloutTrace(f"q#{i}", tokens, 48, geometry, routes_TLK=routes, engine=EngineInfo("hf", dtype="float32")))
    config = HFScorerConfig(str(model_dir), force_routes=True)
    reference = HFScorer(config).score_batch(traces)
    with RayScorerPool(functools.partial(HFScorer, config), RayPoolConfig(num_actors=1, chunk_min_bytes=16)) as pool:
        out, _ = run_service(pool, traces, n=2)
        shipped, fetched = pool.shipper.stats, ray.get(pool.actors[0].fetched.remote())
    for t, ref in zip(traces, reference):
        assert np.max(np.abs(out[t.key].logprob_G - ref)) < 1e-5
    # the prompt's chunk (48 rows) named by all 8 records sent, put once and fetched once; the completions
    # (5-8 rows, under chunk_min_bytes) travel inside their records
    assert shipped.chunks_reused == 4 * 2 - 1 and fetched == 1
    assert shipped.chunk_bytes_put < shipped.record_bytes


def test_memory_store_uri_refused():
    from moe_replay.integrations.ray.pool import RayPoolConfig

    with pytest.raises(ValueError, match="directory store"):
        RayPoolConfig(store_uri="memory://x")
