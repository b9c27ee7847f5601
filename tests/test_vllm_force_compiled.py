"""Forced routes inside vLLM's default compiled forward (enforce_eager=False: torch.compile on
vLLM-CPU, the stand-in for CUDA graphs' tracing constraints) against forcing on an eager engine.

One compiled and one eager engine for the module (the compiled one's start compiles the model,
about 1-2 min on CPU), both built by scoring_engine_kwargs (prompt reuse on); rollouts are
captured on the eager one. Scorers are installed per test and uninstalled after it.

Tolerance between the engines, COMPILED_TOL = 1e-4 nats: Inductor fuses the forward's float ops,
so compiled logits differ from eager ones by rounding (capture's compiled-vs-eager check sees at
most 5e-6, and the figure seen here is printed); one changed expert moves a score by > 1e-3
(test_vllm_scorer), and random routes by far more, so the bound separates rounding from routing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from moe_replay.estimator.core import EstimatorConfig, estimate  # noqa: E402
from moe_replay.integrations.vllm import (  # noqa: E402
    ForceRouteError,
    ScoringError,
    VllmCapture,
    VllmScorer,
    VllmScorerConfig,
)
from moe_replay.integrations.vllm.model import find_moe_layers  # noqa: E402
from moe_replay.integrations.vllm.scoring.force_step import FORCE_STEP_ATTR  # noqa: E402

from .test_vllm_scorer import engine_kwargs, rollouts, shutdown  # noqa: E402

COMPILED_TOL = 1e-4


def _runner(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


@pytest.fixture(scope="module")
def engines(tiny_model):
    from vllm import LLM

    model_dir = tiny_model("qwen3_moe")
    with contextlib.ExitStack() as stack:  # an engine made before a failure is shut down all the same
        compiled = LLM(**engine_kwargs(model_dir, enforce_eager=False))
        stack.callback(shutdown, compiled)
        eager = LLM(**engine_kwargs(model_dir))
        stack.callback(shutdown, eager)
        cap = VllmCapture(eager)
        try:
            traces = rollouts(cap, seed=20)
        finally:
            cap.uninstall()
        yield compiled, eager, traces, model_dir


def _random_routes(t, seed):
    rng = np.random.default_rng(seed)
    E, K, L = t.geometry.num_experts, t.geometry.top_k, t.geometry.num_moe_layers
    rand = np.stack([[rng.permutation(E)[:K] for _ in range(L)] for _ in range(t.num_route_rows)])
    return dataclasses.replace(t, key=f"{t.key}-random", routes_TLK=rand.astype(t.routes_TLK.dtype))


def _scorers(compiled, eager, config=None):
    return VllmScorer(compiled, config or VllmScorerConfig()), VllmScorer(eager, config or VllmScorerConfig())


def test_compiled_forced_scoring_equals_eager(engines):
    """The compiled engine's routers got their forcing step at load (before torch.compile traced
    them), the eager one's at install. Forced scoring of the same rollouts agrees between them to
    COMPILED_TOL and with the rollout's own sampled logprobs; random routes, forced on both, agree
    too and differ from free scoring: the compiled forward really uses the forced ids."""
    compiled, eager, traces, _ = engines
    assert getattr(_runner(compiled).model, FORCE_STEP_ATTR, None) is not None
    assert getattr(_runner(eager).model, FORCE_STEP_ATTR, None) is None  # eager: bound at install
    sc, se = _scorers(compiled, eager)
    try:
        forced_c, forced_e = sc.score_batch(traces), se.score_batch(traces)
        gap = max(np.abs(c - e).max() for c, e in zip(forced_c, forced_e))
        print(f"compiled vs eager forced scoring: max |diff| = {gap:.2e} nats")
        assert gap < COMPILED_TOL
        for t, c in zip(traces, forced_c):
            assert np.abs(c - t.logprobs_G).max() < COMPILED_TOL, t.key
        rand = [_random_routes(t, seed=i) for i, t in enumerate(traces[:3])]
        rand_c, rand_e = sc.score_batch(rand), se.score_batch(rand)
        free_c = sc.with_config(VllmScorerConfig(force_routes=False)).score_batch(rand)
        for t, c, e, f in zip(rand, rand_c, rand_e, free_c):
            assert np.abs(c - e).max() < COMPILED_TOL, t.key
            assert np.abs(c - f).max() > 1e-2, f"{t.key}: random routes scored like free routing"
        st = sc.stats()
        assert st["forced_rows"] > 0 and st["force_refusal"] is None
        assert st["force_binding"] == "load" and se.stats()["force_binding"] == "install"
    finally:
        sc.uninstall()
        se.uninstall()


def test_unregistered_rows_in_the_same_step_route_freely(engines):
    """A plain request (not registered for scoring) shares one compiled engine step with a scoring
    request under random routes: its prompt logprobs equal those of the same request run alone,
    and the scored request still gets its forced scores."""
    from vllm import SamplingParams

    compiled, _, traces, _ = engines
    sc = VllmScorer(compiled, VllmScorerConfig(prompt_reuse=False))
    eng = compiled.llm_engine
    plain = {"prompt_token_ids": traces[0].token_ids_S[:20].tolist()}
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)

    def plain_logprobs(out):
        return np.array([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])

    try:
        (alone,) = compiled.generate([plain], sp, use_tqdm=False)
        t = _random_routes(traces[3], seed=7)  # 9 words: prompt + response fit one step with `plain`
        ref = sc.score_batch([t])[0]
        ids = sc.submit([t])
        eng.add_request("plain-0", plain, sp)
        outs = {o.request_id: o for o in eng.step()}
        assert set(outs) == {ids[0], "plain-0"} and all(o.finished for o in outs.values()), \
            "both requests must run in one step"
        got = sc.finish([t], ids)[0]
        assert np.abs(got - ref).max() < COMPILED_TOL
        assert np.abs(plain_logprobs(outs["plain-0"]) - plain_logprobs(alone)).max() < COMPILED_TOL
    finally:
        sc.uninstall()


def test_estimator_on_a_compiled_engine(engines):
    """The π_old estimator (n = 3, prompt reuse on: later replicas read the first one's prompt KV)
    runs on the compiled engine; every replica agrees with the eager engine's single score."""
    compiled, eager, traces, _ = engines
    sc, se = _scorers(compiled, eager)
    try:
        ref = se.score_batch(traces)
        est = estimate(traces, sc, EstimatorConfig(n=3), batch_size=2, keep_replicas=True)
        for t, e, r in zip(traces, est, ref):
            assert e.key == t.key and e.replicas_RG.shape == (3, t.num_generated)
            assert np.abs(e.replicas_RG - r).max() < COMPILED_TOL, t.key
        assert sc.prompt_reuse and sc.reuse_stats["cached_tokens"] > 0 and sc.reuse_stats["misses"] == 0
    finally:
        sc.uninstall()
        se.uninstall()


def test_compiled_engine_without_load_time_forcing_refuses_forced_routes(engines, monkeypatch):
    """A compiled forward whose routers got no forcing step at load would route freely whatever is
    registered: forced scoring is refused by name (free scoring still works), never routed freely."""
    compiled, _, traces, _ = engines
    monkeypatch.delitem(_runner(compiled).model.__dict__, FORCE_STEP_ATTR)
    sc = VllmScorer(compiled, VllmScorerConfig(prompt_reuse=False))
    try:
        assert "no forcing step at model load" in sc.stats()["force_refusal"]
        with pytest.raises(ForceRouteError, match="enforce_eager=False.*scoring_engine_kwargs"):
            sc.score_batch(traces[:1])
        free = sc.with_config(VllmScorerConfig(force_routes=False, prompt_reuse=False)).score_batch(traces[:1])
        assert np.isfinite(free[0]).all()
    finally:
        sc.uninstall()


def test_a_router_that_skips_the_forcing_step_fails_its_request(engines):
    """Every layer acknowledges the rows it forced (ack buffer, written inside the forward). A layer
    whose router bypasses the forcing step (here: its wrapper replaced by the plain router on the
    eager engine) fails the requests of that step with an error naming the layer, never a score
    under free routing; the next batch scores normally."""
    _, eager, traces, _ = engines
    se = VllmScorer(eager, VllmScorerConfig(prompt_reuse=False))
    router = find_moe_layers(_runner(eager).model)[1][1].router
    wrapped = router.__dict__["_compute_routing"]
    try:
        router._compute_routing = type(router)._compute_routing.__get__(router)
        try:
            with pytest.raises(ScoringError, match=r"MoE layers \[1\] did not force"):
                se.score_batch(traces[:2])
        finally:
            router._compute_routing = wrapped
        ok = se.score_batch(traces[:2])
        assert all(np.abs(s - t.logprobs_G).max() < COMPILED_TOL for s, t in zip(ok, traces))
    finally:
        se.uninstall()


def test_async_scorer_on_a_compiled_engine_in_its_own_process(engines):
    """AsyncLLM, engine core in its own process (the load hook arrives there through the package's
    vllm.general_plugins entry point), enforce_eager=False: AsyncVllmScorer's forced scores equal
    the eager engine's to COMPILED_TOL, and random routes are honoured there too."""
    import asyncio

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from moe_replay.integrations.vllm import AsyncVllmScorer

    _, eager, traces, model_dir = engines
    rand = [_random_routes(t, seed=30 + i) for i, t in enumerate(traces[:2])]

    async def run():
        kw = engine_kwargs(model_dir, enforce_eager=False)
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
        try:
            backend = await AsyncVllmScorer.attach(engine, VllmScorerConfig(prompt_reuse=False))
            return await backend.score(traces + rand)
        finally:
            engine.shutdown()

    got = asyncio.run(run())
    se = VllmScorer(eager, VllmScorerConfig(prompt_reuse=False))
    try:
        ref = se.score_batch(traces + rand)
        free = se.with_config(VllmScorerConfig(prompt_reuse=False, force_routes=False)).score_batch(rand)
    finally:
        se.uninstall()
    for t, g, r in zip(traces + rand, got, ref):
        assert np.abs(g - r).max() < COMPILED_TOL, t.key
    for g, f in zip(got[len(traces):], free):
        assert np.abs(g - f).max() > 1e-2
