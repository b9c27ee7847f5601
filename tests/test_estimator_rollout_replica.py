"""The rollout as a replica (EstimatorConfig.rollout_replica): bookkeeping of the core and the service.

Scorers here are pure-logic fakes that vouch for (or refuse) the recorded logprobs through
`recorded_logprobs_problem`; the real-engine claims (vLLM's scorer, its refusals) are tested in
tests/test_vllm_scorer.py.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from moe_replay.estimator import EstimatorConfig, RolloutReplicaError, estimate
from moe_replay.estimator.service import EstimatorService, ServiceConfig, ThreadBackend, estimate_stream
from moe_replay.geometry import ModelGeometry
from moe_replay.trace import RolloutTrace

GEOM = ModelGeometry(2, (0, 1), 8, 2, 64)


def trace(i: int, s: int = 10, prompt: int = 4, logprobs: bool = True) -> RolloutTrace:
    g = s - prompt
    lp = -(np.arange(g) % 3 + 1) / 4.0 - 0.01 * i if logprobs else None  # recorded: differs from the engine
    return RolloutTrace(f"r{i}", np.arange(s) % 64, prompt, GEOM, logprobs_G=lp)


def engine(t: RolloutTrace) -> np.ndarray:
    return -np.full(t.num_generated, 0.3)


class Vouching:
    """Scores every token -0.3 and counts how many rollout-replicas it was asked to score."""

    def __init__(self, refuse: set[str] = frozenset()):
        self.refuse, self.scored = refuse, []

    def score_batch(self, batch):
        self.scored += [t.key for t in batch]
        return [engine(t) for t in batch]

    def recorded_logprobs_problem(self, t):
        return "another normaliser" if t.key in self.refuse else None

    async def score(self, batch):  # also a ScoringBackend
        await asyncio.sleep(0)
        return self.score_batch(batch)


@pytest.mark.parametrize("averaging", ["prob", "log"])
def test_estimate_is_the_mean_over_the_rollout_and_n_minus_1_scorings(averaging):
    traces = [trace(i) for i in range(5)]
    sc = Vouching()
    est = estimate(traces, sc, EstimatorConfig(n=4, averaging=averaging, rollout_replica=True), batch_size=2,
                   keep_replicas=True)
    assert sorted(sc.scored) == sorted([t.key for t in traces] * 3), "n = 4 costs 3 scorings per rollout"
    for t, e in zip(traces, est):
        reps = np.stack([t.logprobs_G.astype(np.float64)] + [engine(t)] * 3)
        want = np.log(np.exp(reps).mean(0)) if averaging == "prob" else reps.mean(0)
        assert e.n == 4 and e.from_rollout and e.summary()["engine_replicas"] == 3.0
        assert np.array_equal(e.replicas_RG[0], t.logprobs_G.astype(np.float64))
        assert np.allclose(e.logprob_G, want, rtol=0, atol=1e-12)


def test_n1_is_the_rollout_alone_and_adaptive_counts_the_rollout():
    traces = [trace(i) for i in range(3)]
    sc = Vouching()
    (e, *_) = estimate(traces, sc, EstimatorConfig(n=1, rollout_replica=True))
    assert sc.scored == [] and np.array_equal(e.logprob_G, traces[0].logprobs_G.astype(np.float64))
    # the recorded values disagree with the engine: min_n = 2 (1 scoring), then doubled to 4, then 8
    cfg = EstimatorConfig(n=2, adaptive=True, min_n=2, max_n=8, rel_tol=1e-3, rollout_replica=True)
    est = estimate(traces, sc, cfg, batch_size=3)
    assert [x.n for x in est] == [8, 8, 8] and len(sc.scored) == 3 * 7
    # agreeing recorded values stop at min_n with one scoring each
    agree = [RolloutTrace(t.key, t.token_ids_S, t.prompt_len, GEOM, logprobs_G=engine(t)) for t in traces]
    sc2 = Vouching()
    assert [x.n for x in estimate(agree, sc2, cfg)] == [2, 2, 2] and len(sc2.scored) == 3


def test_refusals_name_the_rollout_and_cost_no_scoring():
    sc = Vouching(refuse={"r1"})
    with pytest.raises(RolloutReplicaError, match=r"record 'r1', field 'logprobs_G'.*another normaliser"):
        estimate([trace(0), trace(1)], sc, EstimatorConfig(n=2, rollout_replica=True))
    with pytest.raises(RolloutReplicaError, match=r"record 'r2'.*recorded logprobs.*found none"):
        estimate([trace(2, logprobs=False)], sc, EstimatorConfig(n=2, rollout_replica=True))
    bad = trace(3)
    bad.logprobs_G[2] = np.nan
    with pytest.raises(RolloutReplicaError, match="nan at generated token 2"):
        estimate([bad], sc, EstimatorConfig(n=2, rollout_replica=True))
    assert sc.scored == [], "nothing is scored before every rollout's recorded values are checked"
    with pytest.raises(RolloutReplicaError, match="recorded_logprobs_problem.*function, which cannot"):
        estimate([trace(0)], lambda b: [engine(t) for t in b], EstimatorConfig(n=2, rollout_replica=True))
    # off (the default): the recorded values are never read, a trace without them is fine
    assert estimate([trace(2, logprobs=False)], sc, EstimatorConfig(n=2))[0].n == 2


def test_config_validation():
    with pytest.raises(ValueError, match="rollout_replica must be True or False, got 'yes'"):
        EstimatorConfig(rollout_replica="yes")


def test_service_one_outcome_per_rollout_with_rollout_replicas():
    """Good rollouts get n = 4 from 3 scorings; a rollout without logprobs and one the scorer refuses
    get one RolloutReplicaError each, from submit, with no scoring spent on them; n = 1 needs no backend."""
    good = [trace(i) for i in range(6)]
    refused, missing = trace(7), trace(8, logprobs=False)
    backend = Vouching(refuse={"r7"})
    svc_cfg = ServiceConfig(batch_size=3, concurrency=2)
    out = asyncio.run(estimate_stream(good + [refused, missing], backend, EstimatorConfig(n=4, rollout_replica=True), svc_cfg))
    assert list(out) == [t.key for t in good + [refused, missing]]
    for t in good:
        e = out[t.key]
        want = np.log(np.exp(np.stack([t.logprobs_G.astype(np.float64)] + [engine(t)] * 3)).mean(0))
        assert e.n == 4 and e.from_rollout and np.allclose(e.logprob_G, want, atol=1e-12)
    assert isinstance(out["r7"], RolloutReplicaError) and "another normaliser" in str(out["r7"])
    assert isinstance(out["r8"], RolloutReplicaError) and "found none" in str(out["r8"])
    assert sorted(backend.scored) == sorted([t.key for t in good] * 3)

    async def n1():
        async with EstimatorService(Vouching(), EstimatorConfig(n=1, rollout_replica=True)) as svc:
            await svc.submit(good[0])
            svc.close()
            got = [x async for x in svc.results()]
            return got, svc.stats, svc.inflight_tokens

    got, stats, inflight = asyncio.run(n1())
    assert got[0][0] == "r0" and got[0][1].n == 1 and stats["estimated"] == 1 and inflight == 0


def test_service_adaptive_and_thread_backend():
    """Adaptive in the service counts the rollout (min_n = 2: one scoring, doubled while replicas
    disagree); a ThreadBackend vouches through the scorer it wraps, and refuses for a bare function."""
    traces = [trace(i) for i in range(4)]
    sc = Vouching()
    cfg = EstimatorConfig(n=2, adaptive=True, min_n=2, max_n=4, rel_tol=1e-3, rollout_replica=True)
    out = asyncio.run(estimate_stream(traces, ThreadBackend(sc), cfg, ServiceConfig(batch_size=2)))
    assert [out[t.key].n for t in traces] == [4] * 4 and len(sc.scored) == 4 * 3
    bare = ThreadBackend(lambda b: [engine(t) for t in b])
    out = asyncio.run(estimate_stream(traces[:1], bare, EstimatorConfig(n=2, rollout_replica=True)))
    assert isinstance(out["r0"], RolloutReplicaError) and "cannot say" in str(out["r0"])


class Identified(Vouching):
    """A Vouching scorer that states its identity (moe_replay/identity.py): the geometry it serves and its weights."""

    def __init__(self, geometry=GEOM, weights_version=None, off_policy=False):
        super().__init__()
        self.geometry, self.weights_version, self.off_policy = geometry, weights_version, off_policy


def test_pi_old_refuses_another_model_and_other_weights_before_scoring():
    """The estimator runs the trainer's identity check on what the scorer states, before any scoring:
    a trace of another family of the same shape is a GeometryMismatchError naming geometry.family (as
    build_plan's), one of other weights a WeightsVersionError (sync, direct, or through the service, as
    its one outcome, never retried); with off_policy the estimate says which version scored it; the
    rollout's recorded logprobs of version 1 are never averaged with replicas under version 2."""
    import dataclasses

    from moe_replay.errors import GeometryMismatchError, WeightsVersionError
    from moe_replay.estimator import ReplicaVersionError
    from moe_replay.replay import build_plan

    qwen3 = dataclasses.replace(GEOM, family="qwen3_moe")
    other = dataclasses.replace(trace(0), geometry=dataclasses.replace(GEOM, family="qwen2_moe"))
    v1 = [dataclasses.replace(trace(i), weights_version=1) for i in range(3)]
    for refused, sc, err, match in [
        (other, Identified(qwen3), GeometryMismatchError, r"field 'geometry.family'.*'qwen3_moe', found 'qwen2_moe'"),
        (v1[0], Identified(qwen3, weights_version=2), WeightsVersionError, r"field 'weights_version': expected 2, found 1"),
    ]:
        with pytest.raises(err, match=match):  # the trainer's refusal, and π_old's
            build_plan([refused], qwen3, routes=False, weights_version=sc.weights_version)
        with pytest.raises(err, match=match):
            estimate([refused], sc, EstimatorConfig(n=2))
        ok = dataclasses.replace(trace(5), weights_version=sc.weights_version)
        out = asyncio.run(estimate_stream([refused, ok], ThreadBackend(sc), EstimatorConfig(n=2)))
        assert isinstance(out[refused.key], err) and out["r5"].n == 2
        assert refused.key not in sc.scored
    # off_policy on purpose: scored under version 2, and said so
    sc = Identified(qwen3, weights_version=2, off_policy=True)
    est = estimate(v1 + [dataclasses.replace(trace(4), weights_version=2)], sc, EstimatorConfig(n=2))
    assert [(e.weights_version, e.off_policy) for e in est] == [(2, True)] * 3 + [(2, False)]
    out = asyncio.run(estimate_stream(v1, sc, EstimatorConfig(n=2)))
    assert all(out[t.key].weights_version == 2 and out[t.key].off_policy for t in v1)
    # the rollout's replica never mixes versions, off_policy or not
    cfg = EstimatorConfig(n=2, rollout_replica=True)
    with pytest.raises(ReplicaVersionError, match=r"record 'r0', field 'weights_version'.*mix two policies"):
        estimate(v1, sc, cfg)
    out = asyncio.run(estimate_stream(v1, sc, cfg))
    assert all(isinstance(out[t.key], WeightsVersionError) for t in v1)
    same = estimate([dataclasses.replace(t, weights_version=2) for t in v1], sc, EstimatorConfig(n=2, rollout_replica=True))
    assert all(e.from_rollout and not e.off_policy for e in same)
