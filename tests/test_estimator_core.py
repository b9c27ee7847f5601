"""Estimator core: probability-space averaging, variance, adaptive replicas, batch placement.

The scorers here are pure-logic fakes: these tests check arithmetic and bookkeeping. The claims
about a real engine are tested against vLLM in the integration tests.
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_replay.estimator import EstimatorConfig, combine, estimate, placements
from moe_replay.geometry import ModelGeometry
from moe_replay.trace import RolloutTrace

GEOM = ModelGeometry(2, (0, 1), 8, 2, 64)


def trace(key: str, s: int = 8, prompt: int = 3) -> RolloutTrace:
    return RolloutTrace(key, np.arange(s) % 64, prompt, GEOM)


def test_prob_averaging_is_arithmetic_mean_of_probabilities():
    lp = np.log(np.array([[0.2, 0.9], [0.4, 0.7]]))
    est = combine("a", lp, "prob")
    assert np.allclose(est.prob_G, [0.3, 0.8])
    assert np.allclose(est.logprob_G, np.log([0.3, 0.8]))
    assert np.allclose(est.replica_var_G, [0.02, 0.02])  # ddof=1: ((0.1)^2 * 2) / 1
    assert np.allclose(est.estimate_var_G, [0.01, 0.01])
    geo = combine("a", lp, "log")
    assert np.allclose(geo.prob_G, np.sqrt([0.08, 0.63]))  # geometric mean, biased low
    assert np.all(geo.prob_G < est.prob_G)


def test_single_replica_has_zero_variance_and_identity():
    lp = np.log(np.array([[0.25, 0.5, 1.0]]))
    est = combine("a", lp)
    assert est.n == 1 and np.all(est.replica_var_G == 0)
    assert np.allclose(est.logprob_G, lp[0], atol=1e-12)


def test_combine_rejects_bad_logprobs():
    with pytest.raises(ValueError, match=r"'k'.*<= 0"):
        combine("k", np.array([[0.5]]))
    with pytest.raises(ValueError, match=r"\[R >= 1, G\]"):
        combine("k", np.zeros(3))


def test_identical_replicas_give_the_single_score():
    traces = [trace(f"r{i}", s=6 + i) for i in range(5)]
    single = {t.key: -np.linspace(0.1, 2.0, t.num_generated) for t in traces}
    est = estimate(traces, lambda batch: [single[t.key] for t in batch], EstimatorConfig(n=4), batch_size=2)
    for t, e in zip(traces, est):
        assert e.key == t.key and e.n == 4
        assert np.max(np.abs(e.logprob_G - single[t.key])) < 1e-12
        assert np.all(e.replica_var_G < 1e-24)


def test_scorer_misalignment_is_an_error_naming_the_rollout():
    traces = [trace("x"), trace("y", s=10)]
    with pytest.raises(ValueError, match=r"rollout 'y': expected \[7\]"):
        estimate(traces, lambda batch: [np.zeros(5) for _ in batch], EstimatorConfig(n=1))
    with pytest.raises(ValueError, match="returned 1 results for a batch of 2"):
        estimate(traces, lambda batch: [np.zeros(5)], EstimatorConfig(n=1))


def test_duplicate_keys_refused():
    with pytest.raises(ValueError, match="unique"):
        estimate([trace("a"), trace("a")], lambda b: [np.zeros(5)] * len(b))


def test_rotate_placement_changes_neighbours():
    rounds = placements(8, 4, 4, "rotate")
    assert len(rounds) == 4
    for batches in rounds:  # every round scores everyone exactly once
        assert sorted(i for b in batches for i in b) == list(range(8))
    neighbours = [{frozenset(b) for b in batches} for batches in rounds]
    assert neighbours[0] != neighbours[1]


def test_adaptive_adds_replicas_only_where_they_disagree():
    traces = [trace("quiet"), trace("noisy")]
    rng = np.random.default_rng(0)

    def scorer(batch):
        out = []
        for t in batch:
            base = np.full(t.num_generated, -0.5)
            out.append(base if t.key == "quiet" else base + rng.normal(0, 0.2, t.num_generated).clip(-0.4, 0.4))
        return out

    cfg = EstimatorConfig(n=2, adaptive=True, min_n=2, max_n=16, rel_tol=1e-3)
    quiet, noisy = estimate(traces, scorer, cfg)
    assert quiet.n == 2
    assert noisy.n == 16


def test_noise_variance_falls_as_one_over_n():
    """With independent replica noise, the estimate's variance across trials scales as 1/n."""
    rng = np.random.default_rng(1)
    t = trace("a", s=20_003, prompt=3)
    p_true = 0.3

    def scorer(batch):
        return [np.log(np.clip(p_true + rng.normal(0, 0.05, b.num_generated), 1e-6, 1)) for b in batch]

    var = {n: estimate([t], scorer, EstimatorConfig(n=n))[0].prob_G.var() for n in (1, 4)}
    assert var[4] / var[1] == pytest.approx(0.25, rel=0.1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n=0), "n must be >= 1"),
        (dict(averaging="median"), "averaging"),
        (dict(adaptive=True, min_n=4, max_n=2, n=3), "min_n <= max_n"),
        (dict(adaptive=True, n=32, max_n=16), r"n \(32\) must lie"),
        (dict(batch_placement="random"), "batch_placement"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EstimatorConfig(**kwargs)
