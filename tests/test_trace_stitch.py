"""Multi-turn records (schema v3 `generated_spans`): `stitch` keeps every turn's kept sets and
logprobs, the plan scores every generated span over its own kept set, and readers that lay out one
contiguous completion refuse such a record by name.

Turns are built the way capture hands them over: turn 1 is prompt + its sampled tokens; turn 2's
prompt is turn 1's tokens + tool text, and it records only its new routes (route_start > 0).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_replay.codec import decode_trace, encode_trace
from moe_replay.errors import MultiSpanTraceError, TraceAlignmentError, TraceFormatError
from moe_replay.replay import build_plan, score_tokens
from moe_replay.trace import RolloutTrace, Sampling, SamplingSupport, stitch

from .trace_factory import TINY_GEOMETRY, random_routes, random_support

P1, G1, TOOL, G2 = 5, 4, 3, 6  # prompt, turn 1 sampled, tool text, turn 2 sampled: 18 tokens
S1, S2 = P1 + G1, P1 + G1 + TOOL + G2


def _turns(seed: int = 0, *, sampling2: Sampling | None = None, weights2=1) -> tuple[RolloutTrace, RolloutTrace]:
    rng = np.random.default_rng(seed)
    g = TINY_GEOMETRY
    tokens = rng.integers(0, g.vocab_size, S2)
    sup1, sup2 = random_support(rng, G1, g.vocab_size), random_support(rng, G2, g.vocab_size)
    tokens[P1:S1] = [r[0] for r in (sup1.row(i) for i in range(G1))]  # each sampled token in its kept set
    tokens[S1 + TOOL:] = [r[-1] for r in (sup2.row(i) for i in range(G2))]
    sampling = Sampling(temperature=0.8, top_p=0.9, seed=1)
    t1 = RolloutTrace("turn-1", tokens[:S1], P1, g, routes_TLK=random_routes(rng, S1 - 1, g), support=sup1,
                      logprobs_G=-rng.random(G1).astype(np.float32), sampling=sampling, weights_version=1)
    t2 = RolloutTrace("turn-2", tokens, S1 + TOOL, g, routes_TLK=random_routes(rng, S2 - S1, g), route_start=S1 - 1,
                      support=sup2, logprobs_G=-rng.random(G2).astype(np.float32),
                      sampling=sampling2 or Sampling(temperature=0.8, top_p=0.9, seed=2), weights_version=weights2)
    return t1.validate(), t2.validate()


def test_stitch_keeps_every_turns_rows():
    t1, t2 = _turns()
    multi = stitch(t1, t2)
    assert multi.prompt_len == P1 and multi.spans == ((P1, S1), (S1 + TOOL, S2)) and multi.multi_span
    assert multi.num_generated == G1 + G2 and multi.generated_positions().tolist() == [*range(P1, S1), *range(S1 + TOOL, S2)]
    assert [multi.support.row(g).tolist() for g in range(G1 + G2)] == \
        [t1.support.row(g).tolist() for g in range(G1)] + [t2.support.row(g).tolist() for g in range(G2)]
    np.testing.assert_array_equal(multi.logprobs_G, np.concatenate([t1.logprobs_G, t2.logprobs_G]))
    assert multi.route_start == 0 and multi.num_route_rows == S2 - 1 and multi.extra["turns"] == ["turn-1"]
    np.testing.assert_array_equal(multi.routes_TLK[: S1 - 1], t1.routes_TLK)  # turn 1's own routes, then turn 2's
    np.testing.assert_array_equal(multi.routes_TLK[S1 - 1:], t2.routes_TLK)
    back = decode_trace(encode_trace(multi))
    assert back.equals(multi) and back.spans == multi.spans


def test_a_resumed_generation_is_one_span():
    """No text between the turns (verl's fully-async client resuming an aborted request): one span."""
    t1, t2 = _turns()
    resumed = RolloutTrace("turn-2", t2.token_ids_S[: S1 + G2], S1, t2.geometry, routes_TLK=t2.routes_TLK[: G2],
                           route_start=S1 - 1, support=t2.support, logprobs_G=t2.logprobs_G, sampling=t2.sampling,
                           weights_version=1)
    resumed.token_ids_S[S1:] = t2.token_ids_S[S1 + TOOL:]
    multi = stitch(t1, resumed.validate())
    assert multi.generated_spans is None and multi.prompt_len == P1 and multi.num_generated == G1 + G2
    assert not multi.multi_span and multi.support.num_rows == G1 + G2


def test_turns_that_differ_are_refused_by_name():
    t1, t2 = _turns()
    with pytest.raises(TraceAlignmentError, match=r"field 'sampling'.*top_p"):
        stitch(t1, _turns(sampling2=Sampling(temperature=0.8, top_p=0.5))[1])
    with pytest.raises(TraceAlignmentError, match="weights_version"):
        stitch(t1, _turns(weights2=2)[1])
    t2.logprobs_G = None
    with pytest.raises(TraceAlignmentError, match=r"field 'logprobs_G'.*in every turn or in none"):
        stitch(t1, t2)
    t1b, t2b = _turns()
    t2b.support = None
    with pytest.raises(TraceAlignmentError, match=r"field 'support'.*support_omitted"):
        stitch(t1b, t2b)
    t2b.extra["support_omitted"] = {"row": 0, "size": 600, "max_support": 512}  # capture's 'omit' policy
    multi = stitch(t1b, t2b)
    assert multi.support is None and multi.extra["support_omitted"]["row"] == 0
    t1c, t2c = _turns()
    t2c.prompt_len = S1 - 1  # turn 2 claims turn 1's last token
    with pytest.raises(TraceAlignmentError, match=r"field 'prompt_len'.*>= 9"):
        stitch(t1c, t2c)


def test_plan_scores_every_span_over_its_kept_set_by_hand():
    """build_plan + score_tokens (the scoring HF, TRL, Megatron and verl's actor share): row g of a
    two-span record is the token at its span position, scored over its kept set at the trace's
    temperature; tool text is not a scored row."""
    multi = stitch(*_turns(3))
    plan = build_plan([multi], TINY_GEOMETRY, routes=False)
    torch.manual_seed(0)
    logits_BSV = torch.randn(1, S2, TINY_GEOMETRY.vocab_size, dtype=torch.float64)
    got = score_tokens(logits_BSV, plan).logprobs_G
    pos = multi.generated_positions()
    assert plan.score_pos_G.tolist() == (pos - 1).tolist()
    for g, p in enumerate(pos):
        z = logits_BSV[0, p - 1] / 0.8
        kept = torch.from_numpy(multi.support.row(g)).long()
        want = z[int(multi.token_ids_S[p])] - torch.logsumexp(z[kept], 0)
        assert abs(float(got[g]) - float(want)) < 1e-6, (g, p)
    np.testing.assert_array_equal(plan.engine_logprobs_G.numpy(), multi.logprobs_G)


def test_plan_refuses_a_sampled_token_outside_its_kept_set_at_its_position():
    multi = stitch(*_turns(4))
    bad = multi.generated_positions()[G1 + 1]  # turn 2's second sampled token
    kept = set(multi.support.row(G1 + 1).tolist())
    multi.token_ids_S[bad] = next(v for v in range(TINY_GEOMETRY.vocab_size) if v not in kept)
    with pytest.raises(TraceFormatError, match=rf"support\[row {G1 + 1}, position {bad}\]"):
        build_plan([multi], TINY_GEOMETRY, routes=False)


def test_single_span_readers_refuse_by_name():
    """TRL's completion layout (and the vLLM scorer, same call) score prompt_len..S-1 only."""
    from moe_replay.integrations.trl.scoring import check_rows

    multi = stitch(*_turns(5))
    ids = torch.from_numpy(multi.token_ids_S)[None]
    with pytest.raises(MultiSpanTraceError, match=r"record 'turn-2'.*2 spans.*TRL's prompt/completion layout"):
        check_rows([multi], ids, torch.ones_like(ids), S2 - P1)
    with pytest.raises(MultiSpanTraceError, match="the vLLM scorer"):
        multi.require_single_span("the vLLM scorer (it scores positions prompt_len..S-1)")


@pytest.mark.hf
def test_hf_scorer_scores_every_span_over_its_kept_set(tiny_model):
    """The HF scorer (the π_old estimator's HF backend) through build_plan: a two-span record under
    its routes, each sampled token over its own kept set, by hand from the model's logits."""
    from transformers import AutoModelForCausalLM

    from moe_replay.integrations.hf import model_geometry
    from moe_replay.integrations.hf.replay import self_routed_trace
    from moe_replay.integrations.hf.scorer import HFScorer, HFScorerConfig

    model_dir = tiny_model("qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    geometry = model_geometry(model)
    rng = np.random.default_rng(6)
    tokens = rng.integers(0, geometry.vocab_size, S2)
    routed = self_routed_trace(model, tokens, P1, request_id="conv")  # the model's own routes: replay = free
    spans = ((P1, S1), (S1 + TOOL, S2))
    pos = np.concatenate([np.arange(a, b) for a, b in spans])
    rows = [np.unique(np.concatenate([[tokens[p]], rng.integers(0, geometry.vocab_size, 7)])) for p in pos]
    multi = RolloutTrace("conv", tokens, P1, geometry, routes_TLK=routed.routes_TLK, support=SamplingSupport.from_rows(rows),
                         generated_spans=spans).validate()
    got = HFScorer(HFScorerConfig(str(model_dir), force_routes=True, use_support=True)).score_batch([multi])[0]
    with torch.no_grad():
        logits_SV = model(torch.from_numpy(tokens)[None]).logits[0].double()
    want = [float(logits_SV[p - 1, tokens[p]] - torch.logsumexp(logits_SV[p - 1, torch.from_numpy(r).long()], 0))
            for p, r in zip(pos, rows)]
    assert got.shape == (G1 + G2,)
    np.testing.assert_allclose(got, want, atol=2e-5)
