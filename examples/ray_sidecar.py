"""The π_old sidecar on a Ray actor pool: rollouts stream in, estimates stream out, a dead
actor is replaced and its work retried. (Scorers here are HF; on a GPU cluster use one vLLM
engine per actor via a factory that builds `moe_replay.integrations.vllm.VllmScorer`.)

    python examples/ray_sidecar.py
"""

import asyncio
import functools
import tempfile

import numpy as np
import ray

from moe_replay.estimator import EstimatorConfig
from moe_replay.estimator.service import EstimatorService, ServiceConfig
from moe_replay.integrations.hf.scorer import HFScorer, HFScorerConfig
from moe_replay.integrations.ray.pool import RayPoolConfig, RayScorerPool
from moe_replay.models import build_tiny_model, geometry_of
from moe_replay.trace import RolloutTrace


async def run(pool, traces):
    cfg = ServiceConfig(batch_size=4, concurrency=2, max_inflight_tokens=4096)
    async with EstimatorService(pool, EstimatorConfig(n=4), cfg) as svc:
        for t in traces:  # in a pipeline: submit each rollout as it finishes
            await svc.submit(t)
        svc.close()
        async for key, est in svc.results():
            print(key, "n =", est.n, "mean token logprob", round(float(est.logprob_G.mean()), 4))


if __name__ == "__main__":
    model_dir = build_tiny_model("qwen3_moe", tempfile.mkdtemp() + "/m")
    geometry, rng = geometry_of(model_dir), np.random.default_rng(0)
    traces = [RolloutTrace(f"r{i}", rng.integers(3, 512, 24), 16, geometry) for i in range(8)]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    with RayScorerPool(functools.partial(HFScorer, HFScorerConfig(str(model_dir))), RayPoolConfig(num_actors=2)) as pool:
        asyncio.run(run(pool, traces))
    ray.shutdown()
