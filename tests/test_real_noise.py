"""A real noise source on this CPU: HF bf16 scoring depends on the batch a rollout sits in.

The vLLM-CPU engine is deterministic and batch-invariant, so the estimator's variance figures on it
need injected noise. The HF scorer in bf16 is not batch-invariant: padding and the GEMMs' row count
change the kernels' blocking, so a rollout scored beside other neighbours gets a different score,
while a repeat of the same batch is bit-identical. This is the kind of noise the multi-sample
estimator exists to average, measured here without injecting anything.
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_replay.estimator import EstimatorConfig, estimate
from moe_replay.geometry import EngineInfo
from moe_replay.integrations.hf.scorer import HFScorer, HFScorerConfig
from moe_replay.models import geometry_of
from moe_replay.trace import RolloutTrace


@pytest.fixture(scope="module")
def setup(tiny_model):
    model_dir = tiny_model("qwen3_moe")
    geometry = geometry_of(model_dir)
    rng = np.random.default_rng(3)
    traces = []
    for i in range(8):
        prompt, gen = int(rng.integers(6, 30)), int(rng.integers(6, 20))
        ids = rng.integers(3, geometry.vocab_size, prompt + gen)
        traces.append(RolloutTrace(f"r{i}", ids, prompt, geometry, engine=EngineInfo("hf", dtype="bfloat16")))
    return HFScorer(HFScorerConfig(str(model_dir), dtype="bfloat16")), traces


def _gap(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def test_bf16_scores_depend_on_the_batch_not_on_the_repeat(setup):
    hf, traces = setup
    full = hf.score_batch(traces)
    assert _gap(full, hf.score_batch(traces)) == 0.0  # same batch again: bit-identical
    alone = [hf.score_batch([t])[0] for t in traces]
    assert _gap(full, alone) > 1e-3  # other neighbours: a different score


def test_replicas_in_random_batches_carry_real_variance_that_averaging_reduces(setup):
    hf, traces = setup
    same = estimate(traces, hf, EstimatorConfig(n=3, batch_placement="same"), batch_size=4, keep_replicas=True)
    assert all(np.array_equal(e.replicas_RG, np.repeat(e.replicas_RG[:1], 3, 0)) for e in same)  # fixed: no noise
    probs = {1: [], 4: []}
    for k in range(10):
        for n in probs:
            est = estimate(traces, hf, EstimatorConfig(n=n, batch_placement="shuffle", seed=100 * k + n), batch_size=4)
            probs[n].append(np.concatenate([e.prob_G for e in est]))
    var = {n: float(np.stack(p).var(axis=0, ddof=1).sum()) for n, p in probs.items()}
    assert var[1] > 0, "shuffled placements should give different replica scores"
    print(f"variance ratio n=4: {var[4] / var[1]:.3f}")
    assert var[4] / var[1] < 0.6, var  # expected ~1/4 for independent placements
