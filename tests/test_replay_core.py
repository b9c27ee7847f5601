"""Replay core (pure torch): gate rules, route plans, exactly-once ledger, support scoring."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_replay.errors import ExpertIdOutOfRangeError, GeometryMismatchError, TraceFormatError
from moe_replay.geometry import ModelGeometry
from moe_replay.replay import (
    GATE_RULES,
    BatchLayoutError,
    GateSpec,
    PlanConfig,
    RouteConsumptionError,
    RouteLedger,
    build_plan,
    gate_weights,
    ScoringInputError,
    SupportCSR,
    WeightsVersionError,
    score_logits,
    score_tokens,
    select_experts,
)
from moe_replay.trace import RolloutTrace, Sampling, SamplingSupport

GEOM = ModelGeometry(num_layers=4, moe_layer_ids=(1, 3), num_experts=8, top_k=2, vocab_size=64, family="test")


def make_trace(key: str, s: int, prompt: int = 3, seed: int = 0, support: bool = True, geometry=GEOM) -> RolloutTrace:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, geometry.vocab_size, s)
    routes = np.argsort(rng.random((s - 1, geometry.num_moe_layers, geometry.num_experts)), -1)[..., : geometry.top_k]
    sup = None
    if support:
        rows = []
        for tok in tokens[prompt:]:
            rows.append(np.union1d(rng.choice(geometry.vocab_size, 5, replace=False), [tok]))
        sup = SamplingSupport.from_rows(rows)
    return RolloutTrace(key, tokens, prompt, geometry, routes_TLK=routes, support=sup)


# -- gate rules ----------------------------------------------------------------------------------
SPECS = {
    "softmax_topk": GateSpec("softmax_topk", top_k=3, renormalize=True),
    "softmax_topk_norenorm": GateSpec("softmax_topk", top_k=3, renormalize=False),
    "softmax_topk_renorm": GateSpec("softmax_topk_renorm", top_k=3, renormalize=False),  # always renormalises
    "topk_softmax": GateSpec("topk_softmax", top_k=3),
    "sigmoid_bias_group": GateSpec("sigmoid_bias_group", top_k=3, routed_scaling_factor=2.5, num_groups=4, topk_group=2),
}


def reference_weights(name: str, logits: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Each family's formula written out independently of the rule implementations."""
    out = torch.empty(ids.shape, dtype=torch.float64)
    x = logits.double()
    for t in range(ids.shape[0]):
        sel = ids[t]
        if name.startswith("softmax_topk"):
            p = torch.exp(x[t]) / torch.exp(x[t]).sum()
            w = p[sel]
            if name != "softmax_topk_norenorm":
                w = w / w.sum()
        elif name == "topk_softmax":
            w = torch.exp(x[t, sel]) / torch.exp(x[t, sel]).sum()
        else:
            s = 1 / (1 + torch.exp(-x[t]))
            w = s[sel] / s[sel].sum() * 2.5  # the bias never weighs
        out[t] = w
    return out


@pytest.mark.parametrize("name", list(SPECS))
def test_gate_rule_matches_formula_keeps_order_and_gradient(name):
    torch.manual_seed(0)
    spec = SPECS[name]
    logits = torch.randn(6, 8, requires_grad=True)
    bias = torch.randn(8)
    ids = torch.stack([torch.randperm(8)[:3] for _ in range(6)])
    w = gate_weights(logits, ids, spec, bias)
    assert w.dtype == torch.float32 and w.shape == (6, 3)
    torch.testing.assert_close(w.double(), reference_weights(name, logits.detach(), ids, bias), atol=1e-6, rtol=1e-6)
    # column order is preserved: permuting ids permutes the weights
    perm = torch.tensor([2, 0, 1])
    torch.testing.assert_close(gate_weights(logits, ids[:, perm], spec, bias), w[:, perm])
    # every replayed expert's logit gets gradient (even one the router would not pick)
    w[:, 0].sum().backward()
    picked = logits.grad.gather(1, ids)
    assert (picked[:, 0].abs() > 0).all()


def test_sigmoid_selection_uses_bias_and_groups_only_to_choose():
    spec = SPECS["sigmoid_bias_group"]
    logits = torch.zeros(1, 8)
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 5.0, 4.0])  # group 3 = experts 6, 7
    ids = select_experts(logits, spec, bias)
    assert set(ids[0].tolist()) >= {6, 7}
    # weights ignore the bias: equal sigmoid scores -> equal weights
    torch.testing.assert_close(gate_weights(logits, ids, spec, bias), torch.full((1, 3), 2.5 / 3))


def test_unknown_rule_lists_known():
    with pytest.raises(KeyError, match="softmax_topk"):
        GATE_RULES.get("nope")
    with pytest.raises(ValueError, match="topk_group"):
        GateSpec("sigmoid_bias_group", top_k=2, num_groups=2, topk_group=3)


# -- plan ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["left", "right"])
def test_plan_layout_final_position_and_pads(side):
    traces = [make_trace("a", 9, seed=1), make_trace("b", 6, seed=2)]
    plan = build_plan(traces, GEOM, config=PlanConfig(padding_side=side))
    assert plan.input_ids_BS.shape == (2, 9)
    for b, t in enumerate(traces):
        off = int(plan.offsets_B[b])
        assert off == (9 - t.num_tokens if side == "left" else 0)
        assert plan.input_ids_BS[b, off : off + t.num_tokens].tolist() == t.token_ids_S.tolist()
        assert plan.position_ids_BS[b, off : off + t.num_tokens].tolist() == list(range(t.num_tokens))
        flat = b * 9 + off + np.arange(t.num_tokens - 1)
        for j, lid in enumerate(GEOM.moe_layer_ids):
            assert plan.layer_ids(lid)[flat].numpy().tolist() == t.routes_TLK[:, j].tolist()
        assert plan.routed_N[flat].all()
        assert not plan.routed_N[b * 9 + off + t.num_tokens - 1]  # final token: no route
    assert int(plan.routed_N.sum()) == 8 + 5  # pads are unrouted too
    # scored positions: the logits one before each generated token
    g = plan.gen_offsets_B1
    assert g.tolist() == [0, 6, 9]
    assert plan.target_G[:6].tolist() == traces[0].token_ids_S[3:].tolist()


def test_plan_without_routes_lays_out_the_batch_for_free_routing():
    import dataclasses

    traces = [dataclasses.replace(make_trace("a", 9, seed=1), routes_TLK=None), make_trace("b", 6, seed=2)]
    with pytest.raises(TraceFormatError, match="routes_TLK"):
        build_plan(traces, GEOM)
    plan = build_plan(traces, GEOM, routes=False)
    assert not plan.routed_N.any() and (plan.ids_LNK == -1).all()
    assert plan.gen_offsets_B1.tolist() == [0, 6, 9]
    assert plan.target_G[:6].tolist() == traces[0].token_ids_S[3:].tolist()


def test_plan_accepts_trainer_batch_and_refuses_bad_ones():
    traces = [make_trace("a", 7, seed=1), make_trace("b", 5, seed=2)]
    ref = build_plan(traces, GEOM, config=PlanConfig(padding_side="left"))
    again = build_plan(traces, GEOM, input_ids_BS=ref.input_ids_BS, attention_mask_BS=ref.attention_mask_BS)
    assert torch.equal(again.ids_LNK, ref.ids_LNK)
    # batch order differs from the traces
    with pytest.raises(BatchLayoutError, match="batch order differs"):
        build_plan(traces[::-1], GEOM, input_ids_BS=ref.input_ids_BS, attention_mask_BS=ref.attention_mask_BS)
    # a row one token shorter than its trace
    mask = ref.attention_mask_BS.clone()
    mask[0, -1] = 0
    with pytest.raises(BatchLayoutError, match="7 real tokens"):
        build_plan(traces, GEOM, input_ids_BS=ref.input_ids_BS, attention_mask_BS=mask)
    with pytest.raises(BatchLayoutError, match="one per trace"):
        build_plan(traces, GEOM, input_ids_BS=ref.input_ids_BS[:1])
    with pytest.raises(BatchLayoutError, match="distinct trace keys"):
        build_plan([traces[0], traces[0]], GEOM)


def test_plan_accepts_a_trainer_batch_with_identical_sequences():
    """GRPO groups of short completions hold identical sequences under distinct keys (other routes,
    other logprobs): each row is trace b's, so the batch check must not look rows up by tokens."""
    import dataclasses

    a = make_trace("a", 6, seed=1)
    twin = dataclasses.replace(a, key="a-twin", routes_TLK=(a.routes_TLK + 1) % GEOM.num_experts)
    traces = [a, make_trace("b", 5, seed=2), twin]
    ref = build_plan(traces, GEOM, config=PlanConfig(padding_side="left"))
    again = build_plan(traces, GEOM, input_ids_BS=ref.input_ids_BS, attention_mask_BS=ref.attention_mask_BS)
    assert torch.equal(again.ids_LNK, ref.ids_LNK)
    rows_N = lambda b: slice(b * ref.input_ids_BS.shape[1], (b + 1) * ref.input_ids_BS.shape[1])  # noqa: E731
    assert not torch.equal(again.ids_LNK[:, rows_N(0)], again.ids_LNK[:, rows_N(2)])  # each twin keeps its own routes
    with pytest.raises(BatchLayoutError, match="batch order differs"):  # a row holding another trace's tokens
        build_plan([traces[1], traces[0], traces[2]], GEOM, input_ids_BS=ref.input_ids_BS, attention_mask_BS=ref.attention_mask_BS)


def test_plan_refuses_bad_traces_naming_them():
    other = ModelGeometry(4, (1, 3), 16, 2, 64)
    with pytest.raises(GeometryMismatchError, match="num_experts"):
        build_plan([make_trace("x", 6, geometry=other)], GEOM)
    missing_layer = ModelGeometry(4, (3,), 8, 2, 64)
    with pytest.raises(GeometryMismatchError, match="moe_layer_ids"):
        build_plan([make_trace("x", 6, geometry=missing_layer)], GEOM)
    t = make_trace("short", 6)
    t.routes_TLK = t.routes_TLK[:-1]  # wrong sequence length
    with pytest.raises(TraceFormatError, match="'short'.*S-1-route_start"):
        build_plan([t], GEOM)
    t = make_trace("oob", 6)
    t.routes_TLK = t.routes_TLK.copy()
    t.routes_TLK[2, 1, 0] = 8  # expert id out of range
    with pytest.raises(ExpertIdOutOfRangeError, match="'oob'"):
        build_plan([t], GEOM)
    t = make_trace("nos", 6, support=False)
    t.support = SamplingSupport.from_rows([[0]] * 3)
    t.token_ids_S[3:] = 5
    with pytest.raises(TraceFormatError, match="sampled token 5"):
        build_plan([t], GEOM)
    t = make_trace("late", 6)
    t.route_start, t.routes_TLK = 2, t.routes_TLK[2:]
    with pytest.raises(BatchLayoutError, match="route_start"):
        build_plan([t], GEOM)
    plan = build_plan([t], GEOM, config=PlanConfig(unrouted_prefix="free"))
    assert plan.routed_N.tolist() == [False, False, True, True, True, False]


# -- ledger ----------------------------------------------------------------------------------------
def test_ledger_exactly_once_and_recompute():
    plan = build_plan([make_trace("r1", 6), make_trace("r2", 4, seed=3)], GEOM)
    ledger = RouteLedger(plan)
    ledger.take(1, plan.num_positions)
    with pytest.raises(RouteConsumptionError, match=r"layers \[3\].*'r1', 'r2'"):
        ledger.finish()
    with pytest.raises(RouteConsumptionError, match="layer 1.*second forward"):
        ledger.take(1, plan.num_positions)
    with pytest.raises(RouteConsumptionError, match="layer 2"):
        ledger.take(2, plan.num_positions)
    with pytest.raises(RouteConsumptionError, match="layer 3: router saw 5 tokens"):
        ledger.take(3, 5)
    # a take inside backward counts as activation recompute and returns the very same ids
    x = torch.ones(1, requires_grad=True)
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v):
            return v.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(ledger.take(1, plan.num_positions))
            return g

    Probe.apply(x).sum().backward()
    assert seen[0].data_ptr() == plan.layer_ids(1).data_ptr() and ledger.recompute_takes[1] == 1
    ledger.take(3, plan.num_positions)
    ledger.finish(expect_recompute=True)


# -- support scoring ---------------------------------------------------------------------------------
def test_score_logits_renormalise_over_support():
    torch.manual_seed(0)
    logits = torch.randn(3, 10, requires_grad=True)
    support = SupportCSR(torch.tensor([0, 2, 2, 3]), torch.tensor([1, 4, 7]), whole_G=torch.tensor([False, True, False]))
    target = torch.tensor([4, 2, 7])
    s = score_logits(logits, target, support=support, temperature=0.7)
    x = logits.detach() / 0.7
    ref0 = x[0, 4] - torch.logsumexp(x[0, [1, 4]], 0)
    torch.testing.assert_close(s.logprobs_G[0], ref0)
    torch.testing.assert_close(s.logprobs_G[1], torch.log_softmax(x[1], 0)[2])
    assert s.logprobs_G[2] == 0 and s.entropy_G[2] == 0
    p = torch.softmax(x[0, [1, 4]], 0)
    torch.testing.assert_close(s.entropy_G[0], -(p * p.log()).sum())
    (s.logprobs_G.sum() + s.entropy_G.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    kept0 = torch.zeros(10, dtype=torch.bool)
    kept0[[1, 4]] = True
    assert (logits.grad[0][~kept0] == 0).all() and (logits.grad[0][kept0] != 0).all()


def test_score_tokens_uses_plan_positions():
    traces = [make_trace("a", 8, seed=1), make_trace("b", 5, seed=2, support=False)]
    plan = build_plan(traces, GEOM, config=PlanConfig(padding_side="left"))
    torch.manual_seed(0)
    logits = torch.randn(2, 8, GEOM.vocab_size)
    scores = score_tokens(logits, plan)
    per_row = scores.split(plan)
    t = traces[0]
    for g in range(t.num_generated):
        row = torch.from_numpy(t.support.kept(g, t.geometry.vocab_size).astype(np.int64))
        x = logits[0, t.prompt_len + g - 1]
        ref = x[t.token_ids_S[t.prompt_len + g]] - torch.logsumexp(x[row], 0)
        torch.testing.assert_close(per_row[0][g], ref)
    t = traces[1]  # no support recorded: full vocabulary; left padded by 3
    ref = torch.log_softmax(logits[1, 3 + t.prompt_len - 1 : 3 + t.num_tokens - 1], -1)
    torch.testing.assert_close(per_row[1], ref.gather(1, torch.from_numpy(t.token_ids_S[t.prompt_len :]).view(-1, 1)).squeeze(1))


def test_score_tokens_uses_each_traces_recorded_temperature():
    traces = [make_trace("a", 8, seed=1), make_trace("b", 6, seed=2, support=False)]
    traces[0].sampling, traces[1].sampling = Sampling(temperature=0.7, top_p=0.9), Sampling(temperature=1.3)
    plan = build_plan(traces, GEOM)
    torch.manual_seed(0)
    logits = torch.randn(2, 8, GEOM.vocab_size)
    recorded = score_tokens(logits, plan).logprobs_G
    explicit = score_tokens(logits, plan, temperature=plan.per_token([0.7, 1.3])).logprobs_G
    at_one = score_tokens(logits, plan, temperature=1.0).logprobs_G
    torch.testing.assert_close(recorded, explicit)
    assert (recorded - at_one).abs().max() > 1e-2
    t = traces[1]
    x = logits[1, t.prompt_len - 1 : t.num_tokens - 1] / 1.3
    ref = torch.log_softmax(x, -1).gather(1, torch.from_numpy(t.token_ids_S[t.prompt_len :]).view(-1, 1)).squeeze(1)
    torch.testing.assert_close(recorded[plan.gen_offsets_B1[1] :], ref)


def test_score_tokens_errors_name_the_trace_and_token():
    plan = build_plan([make_trace("a", 8, seed=1), make_trace("b", 7, seed=2)], GEOM)
    logits = torch.randn(2, 8, GEOM.vocab_size)
    tok = int(plan.target_G[plan.gen_offsets_B1[1] + 2])
    logits[1, 3 + 2 - 1, tok] = float("nan")  # trace b (prompt of 3): the logits of its generated token 2
    with pytest.raises(ScoringInputError, match=r"record 'b'.*generated token 2 of the trace.*nan"):
        score_tokens(logits, plan)


def test_weights_version_is_checked_unless_off_policy_on_purpose():
    a, b = make_trace("a", 8, seed=1), make_trace("b", 7, seed=2)
    a.weights_version, b.weights_version = 5, 4
    assert build_plan([a, b], GEOM).off_policy_fraction == 0.0  # no version stated: nothing to check
    with pytest.raises(WeightsVersionError, match=r"record 'b', field 'weights_version': expected 5, found 4.*off_policy=True"):
        build_plan([a, b], GEOM, weights_version=5)
    plan = build_plan([a, b], GEOM, weights_version=5, off_policy=True)
    assert plan.off_policy_B.tolist() == [False, True] and plan.off_policy_fraction == 0.5
    b.weights_version = None  # not recorded (a v1 trace): not the version trained either
    with pytest.raises(WeightsVersionError, match="found None"):
        build_plan([a, b], GEOM, weights_version=5)


def test_replay_refuses_a_trace_of_another_family():
    other = ModelGeometry(**{**GEOM.to_dict(), "family": "mixtral"})
    with pytest.raises(GeometryMismatchError, match=r"geometry.family.*expected 'test', found 'mixtral'.*another model family"):
        build_plan([make_trace("a", 8, geometry=other)], GEOM)
    unknown = ModelGeometry(**{**GEOM.to_dict(), "family": ""})
    build_plan([make_trace("a", 8, geometry=unknown)], GEOM)  # a hand-built geometry names no family
    # a model geometry naming no family: the plan names its traces' family, and refuses a second one
    plan = build_plan([make_trace("a", 8), make_trace("b", 6, geometry=unknown)], unknown)
    assert plan.geometry == GEOM
    with pytest.raises(GeometryMismatchError, match=r"record 'b'.*expected 'test', found 'mixtral'.*earlier traces"):
        build_plan([make_trace("a", 8), make_trace("b", 6, geometry=other)], unknown)


def test_plan_refuses_sampling_that_shifted_the_logits_unless_asked():
    import dataclasses

    from moe_replay.replay.plan import adjusted_sampling_problem

    a = make_trace("a", 8, seed=1)
    pen = dataclasses.replace(make_trace("pen", 7, seed=2), sampling=Sampling(temperature=0.7, adjusted=("repetition_penalty",)))
    with pytest.raises(ScoringInputError, match=r"record 'pen', field 'sampling.adjusted': expected .*"
                                                r"allow_adjusted_sampling.*found \['repetition_penalty'\] "
                                                r"\(the sampler's logits were shifted by repetition_penalty: .*2.3 nats"):
        build_plan([a, pen], GEOM)
    with pytest.raises(ScoringInputError, match="'pen'"):
        build_plan([a, pen], GEOM, routes=False)  # free-routing scoring gets the same wrong logprobs
    plan = build_plan([a, pen], GEOM, config=PlanConfig(allow_adjusted_sampling=True))  # opted in: the model's own logits
    logits = torch.randn(2, plan.seq_len, GEOM.vocab_size)
    assert torch.isfinite(score_tokens(logits, plan).logprobs_G).all()
    # masks only remove tokens: the recorded kept set holds what they left, so scoring over it is exact
    masked = dataclasses.replace(make_trace("masked", 7, seed=3), sampling=Sampling(adjusted=("bad_words", "min_tokens")))
    assert adjusted_sampling_problem(masked) is None
    build_plan([a, masked], GEOM)
    # ... unless the trace holds no kept set to say which tokens were left
    bare = dataclasses.replace(masked, key="bare", support=None)
    with pytest.raises(ScoringInputError, match=r"record 'bare'.*masked by bad_words, min_tokens and the trace holds no kept set"):
        build_plan([a, bare], GEOM)
    # an option this reader does not know is taken to shift logits
    odd = dataclasses.replace(masked, key="odd", sampling=Sampling(adjusted=("min_tokens", "some_new_option")))
    with pytest.raises(ScoringInputError, match="shifted by some_new_option:"):
        build_plan([odd], GEOM)
