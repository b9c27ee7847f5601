"""vLLM scorer: re-scoring traces inside the real CPU engine under forced routes and support.

One fp32 engine (chunked prefill: 64-token steps; prefix caching ON, block 32, built by
scoring_engine_kwargs: prompt reuse on by default) holds capture and scoring at once; rollouts of different lengths are captured on it and scored
back. What each test proves is in its docstring.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from moe_replay.estimator.core import EstimatorConfig, estimate  # noqa: E402
from moe_replay.estimator.service import ServiceConfig, estimate_stream  # noqa: E402
from moe_replay.integrations.hf.scorer import HFScorer, HFScorerConfig  # noqa: E402
from moe_replay.integrations.vllm import (  # noqa: E402
    AsyncVllmScorer,
    ForceRouteError,
    ScoringError,
    VllmCapture,
    VllmScorer,
    VllmScorerConfig,
    scoring_engine_kwargs,
)

from .test_vllm_capture import check_against_hf, prompt_text, sampling_params  # noqa: E402

TOL = 2e-5  # fp32 engine vs fp32 HF (observed <= 1e-5)
WORDS_LENS = [3, 40, 110, 9, 25]  # 110 words > 64 tokens: chunk-prefilled; all share steps
MAX_TOKENS = [6, 12, 8, 10, 16]


def engine_kwargs(model_dir, **over):
    kw = dict(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8,
              max_num_batched_tokens=64, seed=0, distributed_executor_backend="uni", block_size=32,
              enable_prefix_caching=True)
    kw.update(over)
    return scoring_engine_kwargs(**kw)


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def rollouts(cap, seed=0):
    prompts = [prompt_text(n, seed=seed + i) for i, n in enumerate(WORDS_LENS)]
    sps = [sampling_params(1.0, -1, 0.9, 0.0, max_tokens=m) for m in MAX_TOKENS]
    return cap.generate(prompts, sps)[1]


def test_bf16_forced_equals_free_and_replicas_agree(tiny_model):
    """(Runs first: two in-process engines must not be alive at once.) bf16 engine: forcing the captured routes reproduces free scoring bit for bit, replicas in
    different batches are identical (CPU bf16 is batch-invariant too). The bf16 gap between
    prefill scoring and the rollout's decode-time logprobs is printed (it is systematic, the same
    for every replica, so averaging cannot remove it)."""
    from vllm import LLM

    llm = LLM(**engine_kwargs(tiny_model("qwen3_moe"), dtype="bfloat16", enable_prefix_caching=False, prompt_reuse=False))
    try:
        cap = VllmCapture(llm)
        traces = rollouts(cap, seed=10)[:4]
        cap.uninstall()
        with pytest.raises(ScoringError, match="enable_prefix_caching=False"):
            VllmScorer(llm, VllmScorerConfig(prompt_reuse=True))
        scorer = VllmScorer(llm, VllmScorerConfig())
        assert not scorer.prompt_reuse
        forced = scorer.score_batch(traces)
        free = scorer.with_config(VllmScorerConfig(force_routes=False)).score_batch(traces)
        est = estimate(traces, scorer, EstimatorConfig(n=3), batch_size=2, keep_replicas=True)
        for f, u, e in zip(forced, free, est):
            assert np.array_equal(f, u)
            assert np.abs(e.replicas_RG - f).max() == 0.0
        gap = max(np.abs(f - t.logprobs_G).max() for f, t in zip(forced, traces))
        print(f"bf16: prefill scoring vs decode-time sampled logprobs, max |diff| = {gap:.4f}")
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def fp32(tiny_model):
    from vllm import LLM

    model_dir = tiny_model("qwen3_moe")
    llm = LLM(**engine_kwargs(model_dir))
    cap = VllmCapture(llm)
    traces = rollouts(cap)
    scorer = VllmScorer(llm, VllmScorerConfig())  # installed beside capture: both share the step bracket
    hf = HFScorer(HFScorerConfig(str(model_dir), force_routes=True, use_support=True))
    yield {"llm": llm, "cap": cap, "traces": traces, "scorer": scorer, "hf": hf, "model_dir": model_dir}
    scorer.uninstall()
    cap.uninstall()
    shutdown(llm)


def test_scores_line_up_and_match_hf_replay(fp32):
    """All rollouts scored in one engine batch (shared, chunk-prefilled steps): one score per
    generated token, equal to HF replay + support scoring and to the engine's own sampled
    logprobs to ~1e-5; without support, equal to HF's full-softmax replay. Capture stays correct
    beside scoring and records nothing for scoring requests."""
    traces, scorer, cap = fp32["traces"], fp32["scorer"], fp32["cap"]
    before = cap.stats()["unclaimed"]
    out = scorer.score_batch(traces)
    assert cap.stats()["unclaimed"] == before, "scoring requests must not leave capture records"
    ref = fp32["hf"].score_batch(traces)
    for t, lp, r in zip(traces, out, ref):
        assert lp.shape == (t.num_generated,) == (len(t.token_ids_S[t.prompt_len:]),)
        assert np.abs(lp - r).max() < TOL, f"{t.key}: vs HF replay+support {np.abs(lp - r).max()}"
        assert np.abs(lp - t.logprobs_G).max() < TOL, f"{t.key}: vs engine sampled logprobs"
    full = scorer.with_config(VllmScorerConfig(use_support=False)).score_batch(traces)
    hf_full = dataclasses.replace(fp32["hf"].config, use_support=False)
    ref_full = HFScorer(hf_full).score_batch(traces)
    for t, lp, r, s in zip(traces, full, ref_full, out):
        assert np.abs(lp - r).max() < TOL
        assert np.all(lp <= s + 1e-6), "renormalising over the kept set can only raise a logprob"
    # capture still works with scoring installed
    (t_new,) = cap.generate([prompt_text(20, seed=77)], sampling_params(1.0, -1, 0.9, 0.0, max_tokens=5))[1]
    check_against_hf(t_new, fp32["model_dir"], (1.0, -1, 0.9, 0.0))


def test_replicas_agree_and_give_the_single_score(fp32):
    """n = 4 replicas in rotated batch placements (prefix caching is on, scoring bypasses it):
    replicas are identical and the estimate equals the single score to 1e-6."""
    traces, scorer = fp32["traces"], fp32["scorer"]
    single = scorer.score_batch(traces)
    est = estimate(traces, scorer, EstimatorConfig(n=4), batch_size=3, keep_replicas=True)
    for t, e, s in zip(traces, est, single):
        assert e.key == t.key and e.n == 4 and e.replicas_RG.shape == (4, t.num_generated)
        assert np.abs(e.replicas_RG - s).max() <= 1e-6
        assert np.abs(e.logprob_G - s).max() <= 1e-6


class _Drained:
    """The scorer seen through score_batch alone: the estimator drains one batch at a time."""

    def __init__(self, scorer):
        self.scorer = scorer

    def score_batch(self, traces):
        return self.scorer.score_batch(traces)


def test_replicas_in_flight_together_score_as_drained_batches(fp32):
    """The estimator hands a VllmScorer every round's batches at once (score_batches): all n x
    rollouts requests are queued before the engine steps (while the last batch is submitted, the
    others' requests wait unfinished in the engine), and each replica equals the same replica scored
    batch by batch to 1e-6 (the CPU engine has no batch-dependent noise)."""
    traces, scorer = fp32["traces"], fp32["scorer"]
    waiting = []
    submit = scorer.submit

    def counting_submit(batch):
        waiting.append(scorer.llm.llm_engine.get_num_unfinished_requests())
        return submit(batch)

    scorer.submit = counting_submit
    try:
        together = estimate(traces, scorer, EstimatorConfig(n=3), batch_size=2, keep_replicas=True)
    finally:
        del scorer.submit
    drained = estimate(traces, _Drained(scorer), EstimatorConfig(n=3), batch_size=2, keep_replicas=True)
    assert len(traces) == 5  # batches of 2, 2, 1 per round: 9 batches, the last one rollout alone
    assert len(waiting) == 9 and waiting[0] == 0 and waiting[-1] == 3 * 5 - 1
    for a, b in zip(together, drained):
        assert a.key == b.key and a.replicas_RG.shape == b.replicas_RG.shape == (3, a.replicas_RG.shape[1])
        assert np.abs(a.replicas_RG - b.replicas_RG).max() <= 1e-6


def _shifted(traces):
    """The traces with their recorded logprobs lowered by 0.05-0.15 nats: CPU scoring reproduces the
    recorded values to ~1e-5, so only shifted ones can tell the rollout's replica from an engine one."""
    return [dataclasses.replace(t, logprobs_G=(t.logprobs_G - 0.05 * (1 + np.arange(t.num_generated) % 3)).astype(np.float32))
            for t in traces]


def test_the_rollout_counts_as_one_replica(fp32):
    """EstimatorConfig(rollout_replica=True) on the engine: n = 4 sends 3 scoring requests per rollout
    (the engine's count) and the estimate is the mean over the rollout's recorded logprobs and the 3
    engine replicas, in probability and in log space (recorded values shifted, see _shifted). Unshifted,
    the recorded values equal a replica to 2e-5 and adaptive mode stops at min_n = 2 after one scoring;
    shifted, it doubles to max_n = 8 (7 scorings)."""
    traces = fp32["traces"]
    single = fp32["scorer"].score_batch(traces)
    shifted = _shifted(traces)
    for averaging in ("prob", "log"):
        sc = fp32["scorer"].with_config(VllmScorerConfig(prompt_reuse=False))
        cfg = EstimatorConfig(n=4, averaging=averaging, rollout_replica=True)
        est = estimate(shifted, sc, cfg, batch_size=3, keep_replicas=True)
        assert sc.reuse_stats["requests"] == 3 * len(traces)
        for t, e, s in zip(shifted, est, single):
            reps = np.stack([t.logprobs_G.astype(np.float64)] + [s] * 3)
            want = np.log(np.exp(reps).mean(0)) if averaging == "prob" else reps.mean(0)
            assert e.n == 4 and e.from_rollout and np.array_equal(e.replicas_RG[0], reps[0])
            assert np.abs(e.replicas_RG[1:] - s).max() <= 1e-6
            assert np.abs(e.logprob_G - want).max() <= 1e-9
            assert np.abs(e.logprob_G - s).max() > 1e-3, "the rollout's replica must move the estimate"
    adaptive = EstimatorConfig(n=2, adaptive=True, min_n=2, max_n=8, rel_tol=1e-3, rollout_replica=True)
    for given, n, scorings in ((traces, 2, 1), (shifted, 8, 7)):
        sc = fp32["scorer"].with_config(VllmScorerConfig(prompt_reuse=False))
        est = estimate(given, sc, adaptive, batch_size=3)
        assert [e.n for e in est] == [n] * len(traces) and sc.reuse_stats["requests"] == scorings * len(traces)
    for t, s in zip(traces, single):
        assert np.abs(t.logprobs_G - s).max() < TOL


def test_the_rollout_replica_is_refused_where_it_means_something_else(fp32):
    """Recorded logprobs are normalised over the kept set, in the rollout's precision, under its
    weights: a scorer over the vocabulary, a trace without its kept set (not recorded or omitted),
    a rollout in another dtype or under other weights is refused by name before anything is scored; a
    rollout under other weights even where the scorer scores it off-policy on purpose (ReplicaVersionError:
    π_old never averages two policies)."""
    from moe_replay.estimator import ReplicaVersionError, RolloutReplicaError
    from moe_replay.geometry import EngineInfo

    t = fp32["traces"][0]
    cfg = EstimatorConfig(n=2, rollout_replica=True)
    def scorer(**kw):  # fresh request counts
        return fp32["scorer"].with_config(VllmScorerConfig(**kw))

    cases = [(scorer(use_support=False), t, "whole vocabulary"),
             (scorer(), dataclasses.replace(t, support=None), "kept set is not recorded"),
             (scorer(), dataclasses.replace(t, support=None, extra={"support_omitted": 3}), "omitted"),
             (scorer(), dataclasses.replace(t, engine=EngineInfo("vllm", t.engine.version, "bfloat16")),
              "ran in bfloat16, this scoring engine in float32"),
             (scorer(weights_version="w2", off_policy=True), dataclasses.replace(t, weights_version="w1"),
              "sampled under weights 'w1' and its replicas are scored under 'w2'")]
    # a request with a repetition penalty and min_tokens: capture records both by name (the codec
    # keeps them), so its recorded logprob, of the penalised logits, is no replica
    from vllm import SamplingParams

    from moe_replay.codec import decode_trace, encode_trace

    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, seed=3, repetition_penalty=1.3, min_tokens=2)
    (pen,) = fp32["cap"].generate([prompt_text(16, seed=5)], params)[1]
    assert pen.sampling.adjusted == ("min_tokens", "repetition_penalty")
    assert decode_trace(encode_trace(pen)).sampling == pen.sampling
    assert t.sampling.adjusted == ()  # the fixture's rollouts adjusted nothing
    cases.append((scorer(), pen, "adjusted by min_tokens, repetition_penalty"))
    for sc, tr, why in cases:
        with pytest.raises(RolloutReplicaError, match=f"record {tr.key!r}.*{why}") as err:
            estimate([tr], sc, cfg)
        assert sc.reuse_stats["requests"] == 0
        assert isinstance(err.value, ReplicaVersionError) == (tr.weights_version == "w1")  # also a WeightsVersionError


def test_forced_routes_are_honoured_per_request(fp32):
    """Forcing the engine's own routes reproduces the free-routing score bit for bit; one changed
    expert in one request changes its scores from that position on (not before), while a
    neighbour in the same steps is untouched; fully random routes for another request match HF
    replay of the same random routes (per-request row mapping under chunked prefill)."""
    traces, scorer, hf = fp32["traces"], fp32["scorer"], fp32["hf"]
    forced = scorer.score_batch(traces)
    free = scorer.with_config(VllmScorerConfig(force_routes=False)).score_batch(traces)
    for f, u in zip(forced, free):
        assert np.array_equal(f, u)

    a, b, c = traces[2], traces[1], traces[4]  # a is chunk-prefilled
    routes = a.routes_TLK.copy()
    p = a.prompt_len + 2  # forward at p produces the logits of generated token g = 3
    routes[p, 0, 0] = next(e for e in range(a.geometry.num_experts) if e not in routes[p, 0])
    a2 = dataclasses.replace(a, key="a-changed", routes_TLK=routes)
    rng = np.random.default_rng(0)
    E, K = b.geometry.num_experts, b.geometry.top_k
    rand = np.stack([[rng.permutation(E)[:K] for _ in range(b.geometry.num_moe_layers)] for _ in range(b.num_route_rows)])
    b2 = dataclasses.replace(b, key="b-random", routes_TLK=rand.astype(b.routes_TLK.dtype))
    out_a, out_b, out_c = scorer.score_batch([a2, b2, c])
    base_a, base_c = forced[2], forced[4]
    g = p + 1 - a.prompt_len
    assert np.array_equal(out_a[:g], base_a[:g]), "scores before the changed position must not move"
    assert np.abs(out_a[g:] - base_a[g:]).max() > 1e-3, "a changed expert must change the score"
    assert np.array_equal(out_c, base_c), "a neighbour's routes must not leak into others' rows"
    ref_a, ref_b = hf.score_batch([a2, b2])
    assert np.abs(out_a - ref_a).max() < TOL and np.abs(out_b - ref_b).max() < TOL
    with pytest.raises(ForceRouteError, match="no routes"):
        scorer.score_batch([dataclasses.replace(c, key="none", routes_TLK=None)])


def test_async_backend_under_estimator_service(fp32):
    """AsyncLLM (engine core in its own process) as the EstimatorService backend: n = 2,
    two batches in flight; every estimate equals the sync scorer's score to 1e-6. With the rollout
    as replica 0 (n = 3: 2 scorings each), a trace without its kept set gets its refusal as its one
    outcome and the others the mean over their recorded values and 2 engine replicas."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    traces = fp32["traces"]
    single = fp32["scorer"].score_batch(traces)

    async def run():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(fp32["model_dir"])))
        try:
            backend = await AsyncVllmScorer.attach(engine, VllmScorerConfig())
            svc = ServiceConfig(batch_size=2, concurrency=2)
            out = await estimate_stream(traces, backend, EstimatorConfig(n=2), svc)
            rr = backend.with_config(VllmScorerConfig(prompt_reuse=False))
            given = [dataclasses.replace(traces[0], support=None)] + _shifted(traces)[1:]
            out_rr = await estimate_stream(given, rr, EstimatorConfig(n=3, rollout_replica=True), svc)
            return out, out_rr, rr.reuse_stats
        finally:
            engine.shutdown()

    out, out_rr, stats_rr = asyncio.run(run())
    for t, s in zip(traces, single):
        e = out[t.key]
        assert not isinstance(e, Exception), e
        assert e.n == 2 and np.abs(e.logprob_G - s).max() <= 1e-6
    # the rollout as replica 0: exactly one outcome per rollout, the refused one named, 2 scorings each
    shifted = _shifted(traces)
    for t, s in zip(shifted[1:], single[1:]):
        e = out_rr[t.key]
        assert e.n == 3 and e.from_rollout
        want = np.log(np.exp(np.stack([t.logprobs_G.astype(np.float64), s, s])).mean(0))
        assert np.abs(e.logprob_G - want).max() <= 1e-6
    assert "kept set is not recorded" in str(out_rr[traces[0].key])
    assert stats_rr["requests"] == 2 * (len(traces) - 1)


def _reuse(fp32, salt, **kw):
    return fp32["scorer"].with_config(VllmScorerConfig(salt=salt, **kw))


def test_prompt_reuse_reads_the_prompt_and_nothing_else(fp32):
    """Prompt reuse (block 32): the first scoring of a salt forwards every token and caches only its
    prompt's whole blocks; every later replica reads exactly floor((P-1)/32)*32 prompt tokens (the
    engine's count: the first position it forwards) and forwards the rest itself, never reading a
    response block. Scores equal full re-scoring bit for bit (CPU is batch-invariant), n = 4 too."""
    from moe_replay.integrations.vllm.scoring.prefix import reusable_tokens

    traces, llm = fp32["traces"], fp32["llm"]
    full = fp32["scorer"].with_config(VllmScorerConfig(prompt_reuse=False)).score_batch(traces)
    assert llm.reset_prefix_cache()
    reuse = _reuse(fp32, "t-reuse")
    assert reuse.prompt_reuse and reuse.block_size == 32
    want = sum(reusable_tokens(t.prompt_len, 32) for t in traces)
    assert want > 0, "some prompt must span a whole block for the test to mean anything"
    first = reuse.score_batch(traces)
    assert reuse.reuse_stats["cached_tokens"] == 0 and reuse.reuse_stats["promised_tokens"] == 0
    for rnd in range(3):
        order = traces[rnd:] + traces[:rnd]  # other neighbours each round
        again = reuse.score_batch(order)
        again = again[len(traces) - rnd:] + again[: len(traces) - rnd]
        for f, a, b in zip(full, first, again):
            assert np.array_equal(f, a) and np.array_equal(f, b)
    st = reuse.reuse_stats
    assert st["cached_tokens"] == st["promised_tokens"] == 3 * want and st["misses"] == 0
    est = estimate(traces, reuse, EstimatorConfig(n=4), batch_size=2, keep_replicas=True)
    for e, f in zip(est, full):
        assert np.abs(e.replicas_RG - f).max() == 0.0


def test_free_prompt_reuse_promises_each_prompt_its_own_blocks(fp32):
    """Free routing keys the cache salt by the mode alone, so every trace shares it; the promise a
    later replica is held to is per prompt (salt and prompt tokens: prefix.prompt_key), so prompts
    spanning different numbers of whole blocks each read exactly their own, with no miss."""
    from moe_replay.integrations.vllm.scoring.prefix import reusable_tokens

    traces, llm = fp32["traces"], fp32["llm"]
    blocks = [reusable_tokens(t.prompt_len, 32) for t in traces]
    assert len(set(blocks)) > 1, blocks  # a promise keyed by the salt alone would promise one prompt another's
    full = fp32["scorer"].with_config(VllmScorerConfig(force_routes=False, prompt_reuse=False)).score_batch(traces)
    assert llm.reset_prefix_cache()
    sc = _reuse(fp32, "t-free", force_routes=False)
    first = sc.score_batch(traces)
    promised = sc.reuse_stats["promised_tokens"]
    again = sc.score_batch(traces)
    st = sc.reuse_stats
    assert promised == 0 and st["promised_tokens"] == sum(blocks) and st.get("misses", 0) == 0, st
    assert st["cached_tokens"] >= sum(blocks)
    for f, a, b in zip(full, first, again):
        assert np.array_equal(f, a) and np.array_equal(f, b)


def test_reused_kv_never_crosses_routes_modes_or_rollouts(fp32):
    """The cache salt keys prompt KV by the forced routes, the routing mode and the weights version:
    prompt KV cached under random routes is not read by the same tokens under their own routes, nor
    by free routing; a rollout of the same prompt reads none of it (vLLM's num_cached_tokens is 0),
    while a second rollout reads the first one's blocks (rollouts still share among themselves)."""
    from moe_replay.integrations.vllm.scoring.prefix import cache_salt, reusable_tokens

    traces, llm, cap = fp32["traces"], fp32["llm"], fp32["cap"]
    b = max(traces, key=lambda t: t.prompt_len)
    assert reusable_tokens(b.prompt_len, 32) > 0
    rng = np.random.default_rng(1)
    E, K = b.geometry.num_experts, b.geometry.top_k
    rand = np.stack([[rng.permutation(E)[:K] for _ in range(b.geometry.num_moe_layers)] for _ in range(b.num_route_rows)])
    b2 = dataclasses.replace(b, key="b-random", routes_TLK=rand.astype(b.routes_TLK.dtype))
    assert len({cache_salt(b, True, "v"), cache_salt(b2, True, "v"), cache_salt(b, False, "v"), cache_salt(b, True, "w")}) == 4
    full = fp32["scorer"].with_config(VllmScorerConfig(prompt_reuse=False)).score_batch([b])[0]
    assert llm.reset_prefix_cache()
    iso = _reuse(fp32, "t-iso")
    iso.score_batch([b2])
    iso.score_batch([b2])
    assert iso.reuse_stats["cached_tokens"] > 0  # b2's salt is warm and was read
    for sc in (iso, _reuse(fp32, "t-iso", force_routes=False)):
        before = sc.reuse_stats["cached_tokens"]
        out = sc.score_batch([b])[0]
        assert sc.reuse_stats["cached_tokens"] == before, "another salt's prompt KV was read"
        assert np.abs(out - full).max() < (1e-12 if sc is iso else TOL)
    prompt = prompt_text(WORDS_LENS[traces.index(b)], seed=traces.index(b))
    (o1,), (r1,) = cap.generate([prompt], sampling_params(1.0, -1, 0.9, 0.0, max_tokens=3))
    (o2,), _ = cap.generate([prompt], sampling_params(1.0, -1, 0.9, 0.0, max_tokens=3))
    assert r1.prompt_len == b.prompt_len and o1.num_cached_tokens == 0, "a rollout read scoring KV"
    assert o2.num_cached_tokens > 0, "rollouts should still share their own prefix blocks"


def test_promised_prefix_cache_miss_is_an_error_naming_the_rollout(fp32):
    """Once a salt is warm, a replica that misses (the cache was reset) fails naming the rollout;
    with on_reuse_miss='count' it is scored in full and counted."""
    from moe_replay.integrations.vllm import PrefixCacheMissError

    traces, llm = fp32["traces"], fp32["llm"]
    a = max(traces, key=lambda t: t.prompt_len)
    sc = _reuse(fp32, "t-miss")
    ref = sc.score_batch([a])[0]
    assert llm.reset_prefix_cache()
    with pytest.raises(PrefixCacheMissError, match=f"trace {a.key!r}.*promised [1-9][0-9]* cached prompt tokens.*found 0"):
        sc.score_batch([a])
    assert llm.reset_prefix_cache()
    counting = _reuse(fp32, "t-miss", on_reuse_miss="count")
    assert np.array_equal(counting.score_batch([a])[0], ref)
    assert counting.reuse_stats["misses"] == 1


def test_sidecar_on_the_rollout_engine(fp32):
    """One AsyncLLM samples and scores (capture + scoring on its worker, prompt reuse on): each rollout
    goes to an EstimatorService over that same engine as soon as it is collected, while longer rollouts
    still decode. Backpressure holds the unfinished tokens under the limit, one rollout is cancelled:
    every rollout yields exactly one outcome, and the estimates equal the sync scorer's scores."""
    import time

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from moe_replay.estimator.service import Cancelled, EstimatorService
    from moe_replay.integrations.vllm import AsyncVllmCapture, CaptureConfig
    from moe_replay.integrations.vllm.capture.api import sampling_summary

    prompts = [prompt_text(n, seed=40 + i) for i, n in enumerate(WORDS_LENS)]
    sps = [sampling_params(1.0, -1, 0.9, 0.0, max_tokens=m) for m in MAX_TOKENS]
    limit = 150

    async def run():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(fp32["model_dir"])))
        try:
            cap = await AsyncVllmCapture.attach(engine, CaptureConfig())
            backend = await AsyncVllmScorer.attach(engine, VllmScorerConfig())
            assert backend.prompt_reuse
            svc_cfg = ServiceConfig(batch_size=2, concurrency=2, max_inflight_tokens=limit)
            inflight = []
            async with EstimatorService(backend, EstimatorConfig(n=3), svc_cfg) as svc:
                async def one(i):
                    rid = f"side-{i}"
                    final = None
                    async for o in engine.generate(prompts[i], sps[i], request_id=rid):
                        final = o
                    (t,) = await cap.collect([final], sampling={rid: sampling_summary(sps[i])})
                    finished[t.key] = time.perf_counter()
                    await svc.submit(t)
                    inflight.append(svc.inflight_tokens)
                    if i == 3:
                        assert svc.cancel(t.key)
                    return t

                outcomes = []

                async def consume():  # outcomes as they come, while rollouts still decode
                    async for key, out in svc.results():
                        estimated[key] = time.perf_counter()
                        outcomes.append((key, out))

                consumer = asyncio.create_task(consume())
                traces = await asyncio.gather(*(one(i) for i in range(len(prompts))))
                svc.close()
                await consumer
            return traces, outcomes, inflight, backend.reuse_stats
        finally:
            engine.shutdown()

    finished, estimated = {}, {}
    traces, outcomes, inflight, stats = asyncio.run(run())
    assert sorted(k for k, _ in outcomes) == sorted(t.key for t in traces), "exactly one outcome per rollout"
    assert max(inflight) <= limit
    short = min(traces, key=lambda t: t.num_generated)  # 6 tokens, vs 16 for the longest rollout
    assert estimated[short.key] < max(finished.values()), "an estimate arrived only after every rollout finished"
    single = fp32["scorer"].score_batch(traces)
    got = dict(outcomes)
    for i, (t, s) in enumerate(zip(traces, single)):
        if i == 3:
            assert isinstance(got[t.key], Cancelled)
            continue
        e = got[t.key]
        assert not isinstance(e, Exception), e
        assert e.n == 3 and np.abs(e.logprob_G - s).max() <= 1e-6
    assert stats["misses"] == 0 and stats["cached_tokens"] > 0


def test_config_refuses_reading_rollout_kv_without_forced_routes_or_reuse():
    with pytest.raises(ValueError, match="read_rollout_kv=True needs force_routes=True.*force_routes=False"):
        VllmScorerConfig(read_rollout_kv=True, force_routes=False)
    with pytest.raises(ValueError, match="prompt_reuse=False"):
        VllmScorerConfig(read_rollout_kv=True, prompt_reuse=False)


def _rollout_kv(fp32, **kw):
    return fp32["scorer"].with_config(VllmScorerConfig(read_rollout_kv=True, **kw))


def test_replicas_read_the_rollouts_own_prompt_kv(fp32):
    """Scoring on the engine that sampled: every replica, the first one included, reads exactly
    floor((P-1)/32)*32 prompt tokens that the rollout itself cached (the engine's count), never a
    block of the rollout's response (which hashes the same tokens: the read cap stops the lookup at
    the prompt), and its scores equal full re-scoring bit for bit, n = 3 replicas per rollout."""
    from moe_replay.integrations.vllm.scoring.prefix import reusable_tokens

    llm, cap = fp32["llm"], fp32["cap"]
    assert llm.reset_prefix_cache()
    traces = rollouts(cap, seed=60)  # fresh prompts: the only KV cached now is these rollouts'
    want = sum(reusable_tokens(t.prompt_len, 32) for t in traces)
    assert want > 0, "some prompt must span a whole block for the test to mean anything"
    assert any((t.num_tokens - 1) // 32 > (t.prompt_len - 1) // 32 for t in traces), \
        "some rollout must have cached a response block for the read cap to be tested"
    full = fp32["scorer"].with_config(VllmScorerConfig(prompt_reuse=False)).score_batch(traces)
    rk = _rollout_kv(fp32)
    est = estimate(traces, rk, EstimatorConfig(n=3), batch_size=2, keep_replicas=True)
    for e, f in zip(est, full):
        assert np.array_equal(e.replicas_RG, np.stack([f] * 3)), np.abs(e.replicas_RG - f).max()
    st = rk.reuse_stats
    assert st["cached_tokens"] == st["promised_tokens"] == 3 * want and st["misses"] == 0
    assert st["tokens"] == 3 * sum(t.num_tokens for t in traces)


def test_rollout_kv_reads_write_nothing_a_free_request_could_read(fp32):
    """A replica reading unsalted rollout KV has write cap 0: after scoring a rollout under routes
    no free forward would take (random expert ids, every token forwarded: its cache was reset and the
    miss is counted), a free request of the same token sequence reads no KV at all."""
    from vllm import TokensPrompt

    traces, llm, cap = fp32["traces"], fp32["llm"], fp32["cap"]
    b = max(traces, key=lambda t: t.prompt_len)
    rng = np.random.default_rng(2)
    E, K = b.geometry.num_experts, b.geometry.top_k
    rand = np.stack([[rng.permutation(E)[:K] for _ in range(b.geometry.num_moe_layers)] for _ in range(b.num_route_rows)])
    b2 = dataclasses.replace(b, key="b-random-unsalted", routes_TLK=rand.astype(b.routes_TLK.dtype))
    assert llm.reset_prefix_cache()
    rk = _rollout_kv(fp32, on_reuse_miss="count")
    rk.score_batch([b2])
    assert rk.reuse_stats["misses"] == 1 and rk.reuse_stats["cached_tokens"] == 0
    (o,), _ = cap.generate([TokensPrompt(prompt_token_ids=b2.token_ids_S.tolist())],
                           sampling_params(1.0, -1, 0.9, 0.0, max_tokens=2))
    assert o.num_cached_tokens == 0, f"a free request read {o.num_cached_tokens} tokens of KV computed under forced routes"


def test_rollout_kv_miss_is_an_error_naming_the_rollout(fp32):
    """The rollout's blocks are gone (the prefix cache was reset, as update_weights does): the
    replica fails naming the rollout instead of scoring under other KV; with on_reuse_miss='count'
    it is scored in full (same scores) and counted."""
    from moe_replay.integrations.vllm import PrefixCacheMissError

    llm, cap = fp32["llm"], fp32["cap"]
    assert llm.reset_prefix_cache()
    traces = rollouts(cap, seed=80)
    a = max(traces, key=lambda t: t.prompt_len)
    ref = _rollout_kv(fp32).score_batch([a])[0]  # its rollout's blocks are still cached
    assert llm.reset_prefix_cache()
    with pytest.raises(PrefixCacheMissError, match=f"trace {a.key!r}.*promised [1-9][0-9]* cached prompt tokens "
                                                   r"\(its rollout on this engine cached them\), found 0"):
        _rollout_kv(fp32).score_batch([a])
    counting = _rollout_kv(fp32, on_reuse_miss="count")
    assert np.array_equal(counting.score_batch([a])[0], ref)
    assert counting.reuse_stats["misses"] == 1


def test_sidecar_reads_the_rollouts_prompt_kv_as_each_finishes(fp32):
    """A sidecar on the rollout AsyncLLM with read_rollout_kv: each rollout goes to the service as
    soon as it is collected; every replica of every rollout, the first included, reads exactly its
    rollout's reusable prompt tokens (no miss), and the estimates equal full re-scoring."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from moe_replay.estimator.service import EstimatorService
    from moe_replay.integrations.vllm import AsyncVllmCapture, CaptureConfig
    from moe_replay.integrations.vllm.capture.api import sampling_summary
    from moe_replay.integrations.vllm.scoring.prefix import reusable_tokens

    prompts = [prompt_text(n, seed=90 + i) for i, n in enumerate(WORDS_LENS)]
    sps = [sampling_params(1.0, -1, 0.9, 0.0, max_tokens=m) for m in MAX_TOKENS]

    async def run():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(fp32["model_dir"])))
        try:
            cap = await AsyncVllmCapture.attach(engine, CaptureConfig())
            backend = await AsyncVllmScorer.attach(engine, VllmScorerConfig(read_rollout_kv=True))
            async with EstimatorService(backend, EstimatorConfig(n=2), ServiceConfig(batch_size=2, concurrency=2)) as svc:
                async def one(i):
                    final = None
                    async for o in engine.generate(prompts[i], sps[i], request_id=f"rk-{i}"):
                        final = o
                    (t,) = await cap.collect([final], sampling={f"rk-{i}": sampling_summary(sps[i])})
                    await svc.submit(t)
                    return t

                traces = await asyncio.gather(*(one(i) for i in range(len(prompts))))
                svc.close()
                outcomes = {k: e async for k, e in svc.results()}
            return traces, outcomes, backend.reuse_stats
        finally:
            engine.shutdown()

    traces, outcomes, st = asyncio.run(run())
    want = sum(reusable_tokens(t.prompt_len, 32) for t in traces)
    assert want > 0
    assert st["cached_tokens"] == st["promised_tokens"] == 2 * want and st["misses"] == 0, dict(st)
    full = fp32["scorer"].with_config(VllmScorerConfig(prompt_reuse=False)).score_batch(traces)
    for t, f in zip(traces, full):
        e = outcomes[t.key]
        assert not isinstance(e, Exception), e
        # replicas equal full re-scoring (replica_var 0); the mean's exp/log round trip costs an ulp
        assert e.n == 2 and not e.replica_var_G.any() and np.abs(e.logprob_G - f).max() <= 1e-12
