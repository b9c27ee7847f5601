"""HF routers whose output is not (logits, weights, ids): each output convention (outputs.py) on a real tiny model.

Llama 4 (a dense score matrix), DBRX (routing in its parent block's method, patched on the instance and undone)
and ZAYA1 (a skip class, its router state passed through) replay: HF's own routes give HF's output bit for bit,
other routes reach the experts in the router's own convention and change the output, and the router trains
(coverage.check_family). JetMoE routes every token twice per decoder layer (its attention's mixture of heads and its
MLP, each a router with expert-sorted slots): two route layers per decoder layer, both replayed and both really forced;
its slots are checked on its real MoE block. Inkling v1 is refused by name (weights from shared logits it does not
return).

Legend: T tokens, E experts (router classes), K top-k, N flattened positions, H hidden size.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moe_replay.integrations.hf import capture_routes, coverage, find_routers, model_geometry, replay
from moe_replay.integrations.hf.outputs import differs, layout_for
from moe_replay.integrations.hf.replay import output_tensor, self_replay_gap, with_own_routes
from moe_replay.replay import UnsupportedRouterError, build_plan
from moe_replay.replay.gates import GATE_RULES, GateSpec, gate_weights, select_experts

_FAMILY = {
    "llama4_text": ("Llama4TextConfig", "transformers.models.llama4.configuration_llama4"),
    "dbrx": ("DbrxConfig", "transformers.models.dbrx.configuration_dbrx"),
    "zaya": ("ZayaConfig", "transformers.models.zaya.configuration_zaya"),
    "jetmoe": ("JetMoeConfig", "transformers.models.jetmoe.configuration_jetmoe"),
    "inkling_text": ("InklingTextConfig", "transformers.models.inkling.configuration_inkling"),
    "ernie4_5_vl_moe_text": ("Ernie4_5_VLMoeTextConfig", "transformers.models.ernie4_5_vl_moe.configuration_ernie4_5_vl_moe"),
}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls on a shared CPU run 10-20x faster on one thread than fighting over several."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("family, precision, convention", [
    ("llama4_text", "fp32", "dense scores"),
    ("llama4_text", "bf16", "dense scores"),
    ("llama4_text", "autocast_bf16", "dense scores"),
    ("dbrx", "fp32", "route_tokens_to_experts"),
    ("dbrx", "bf16", "route_tokens_to_experts"),
    ("zaya", "fp32", "skip class"),
    ("zaya", "autocast_bf16", "skip class"),
    ("jetmoe", "fp32", "expert-sorted slots"),
    ("jetmoe", "bf16", "expert-sorted slots"),
    ("jetmoe", "autocast_bf16", "expert-sorted slots"),
])
def test_convention_replays(family, precision, convention):
    """Verified at attach and on the first forward in the mode; self-replay bit-identical; shifted routes change the
    output; backward reaches every router."""
    result = coverage.check_family(family, _FAMILY, precision)
    assert result.status == "replayed", result.reason
    assert convention in result.rule


def _shifted_plan(model):
    geometry = model_geometry(model)
    traces = coverage._traces(model, geometry)
    return build_plan(coverage._shifted(traces, geometry), geometry), traces


def _after_replay(router, seen: list):
    """A forward hook added after replay's: sees what the MoE block receives."""
    return router.register_forward_hook(lambda m, a, out: seen.append(out))


def test_llama4_experts_receive_the_plan_ids_as_dense_scores():
    """The block weighs every expert's input by the scores: nonzero exactly at the plan's ids, sigmoid of those logits,
    even where the router would pick others; top-k of the logits, never of saturated sigmoids, is its own choice."""
    model = coverage.build_tiny("llama4_text", _FAMILY)
    plan, _ = _shifted_plan(model)
    seen: list = []
    with torch.no_grad(), replay(model, plan, track_flips=True) as session:
        site = session.sites[0]
        handle = _after_replay(site.module, seen)
        model(**session.model_inputs())
        handle.remove()
    assert session.flips.rate > 0.5  # the shifted routes are mostly not the router's own
    scores_NE, logits_NE = seen[0]
    ids_NK = plan.layer_ids(0).clamp(min=0)  # -1 at positions without a route (pads, last tokens)
    want_NK = logits_NE.float().sigmoid().gather(1, ids_NK).to(scores_NE.dtype)  # on [N, E]: HF's SIMD lanes
    routed = plan.routed_N
    nonzero_NK = torch.stack([row.nonzero().flatten() for row in scores_NE[routed]])
    assert torch.equal(nonzero_NK.sort(-1).values, ids_NK[routed].sort(-1).values)
    assert torch.equal(scores_NE.gather(1, ids_NK)[routed], want_NK[routed])
    assert not site.module._forward_hooks  # replay's hook removed on exit


def test_dbrx_routing_method_is_patched_on_the_instance_only_while_hooked():
    """Replay patches `route_tokens_to_experts` on each DbrxFFN instance (never the class), hands the experts the plan's
    ids, and restores the instance on exit, also when the forward raises; capture sees the block's own routes."""
    from transformers.models.dbrx import modeling_dbrx

    model = coverage.build_tiny("dbrx", _FAMILY)
    original = modeling_dbrx.DbrxFFN.route_tokens_to_experts
    ffns = [b.ffn for b in model.transformer.blocks]
    plan, traces = _shifted_plan(model)
    received: dict[int, torch.Tensor] = {}
    handles = [f.experts.register_forward_pre_hook(lambda m, a, i=i: received.__setitem__(i, a[1].clone()))
               for i, f in enumerate(ffns)]
    with torch.no_grad(), replay(model, plan) as session:
        assert all("route_tokens_to_experts" in f.__dict__ for f in ffns)
        assert modeling_dbrx.DbrxFFN.route_tokens_to_experts is original
        model(**session.model_inputs())
    for lid in plan.geometry.moe_layer_ids:
        assert torch.equal(received[lid][plan.routed_N], plan.layer_ids(lid)[plan.routed_N])
    assert not any("route_tokens_to_experts" in f.__dict__ for f in ffns)
    with pytest.raises(RuntimeError, match="boom"), replay(model, plan):
        raise RuntimeError("boom")
    assert not any("route_tokens_to_experts" in f.__dict__ for f in ffns)
    assert not any(m._forward_pre_hooks for f in ffns for m in (f.router,))
    with torch.no_grad(), capture_routes(model) as own:
        model(**plan.model_inputs())
    assert all(torch.equal(own[lid], received[lid]) for lid in own)  # the block's own top-k this time
    assert not any("route_tokens_to_experts" in f.__dict__ for f in ffns)
    for h in handles:
        h.remove()


def test_dbrx_p_norm_renormalisation_is_read_and_verified():
    """moe_normalize_expert_weights is DBRX's p in `w / ||w||_p`: p=2 is verified as such and self-replays bit for bit;
    None is no renormalisation."""
    for p, want in ((2.0, "renorm p-norm=2"), (None, "no-renorm")):
        model = coverage.build_tiny("dbrx", _FAMILY)
        for block in model.transformer.blocks:
            block.ffn.moe_normalize_expert_weights = p
        sites = find_routers(model)
        assert all(want in s.adapter.describe() for s in sites.values())
        traces = coverage._traces(model, model_geometry(model, sites))
        assert self_replay_gap(model, traces) == 0.0


def test_topk_sigmoid_and_p_norm_rules_match_their_formulas():
    logits_TE = torch.tensor([[20.0, 30.0, 0.5, -1.0], [0.1, -0.2, 0.3, 0.0]], requires_grad=True)
    spec = GateSpec("topk_sigmoid", top_k=1, renormalize=False)
    assert select_experts(logits_TE, spec).flatten().tolist() == [1, 2]  # sigmoid(20) == sigmoid(30) == 1.0 in fp32
    ids_TK = torch.tensor([[2], [0]])
    w_TK = gate_weights(logits_TE, ids_TK, spec)
    assert torch.equal(w_TK, logits_TE.detach().gather(1, ids_TK).sigmoid())
    w_TK.sum().backward()
    assert logits_TE.grad[0, 2] > 0 and logits_TE.grad[1, 0] > 0
    p2 = GateSpec("softmax_topk", top_k=2, renorm_p=2.0)
    ids_TK = torch.tensor([[0, 1], [2, 3]])
    probs_TK = torch.softmax(logits_TE.detach(), -1).gather(1, ids_TK)
    torch.testing.assert_close(gate_weights(logits_TE, ids_TK, p2), probs_TK / probs_TK.pow(2).sum(-1, keepdim=True).sqrt())
    with pytest.raises(ValueError, match="renorm_p"):
        GateSpec("softmax_topk", top_k=2, renorm_p=2.0, renorm_eps=1e-6)


def _zaya_with_unsaturated_routers(dtype: torch.dtype):
    """The tiny ZAYA1 with its router MLPs at 1.5 / sqrt(fan in): the builder's N(0, 0.5) on all four of its router
    matrices gives logits of spread ~180, whose softmax saturates (HF's own bf16 backward then reaches no router)."""
    model = coverage.build_tiny("zaya", _FAMILY)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            r = layer.mlp.gate
            for linear in (r.down_proj, r.router_mlp.fc1, r.router_mlp.fc2, r.router_mlp.out_proj):
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * 1.5 / math.sqrt(linear.weight.shape[1]))
    return coverage.cast_as_loaded(model, dtype)


def test_zaya_skip_class_reaches_the_experts_as_expert_0_weighted_0():
    """ZAYA1's class E is a skip expert: geometry counts E+1 classes, a planned skip reaches the experts as id 0 with
    weight 0 (as HF hands its own skips), and HF's own skips read back as class E."""
    model = _zaya_with_unsaturated_routers(torch.bfloat16)
    geometry = model_geometry(model)
    skip = model.config.num_experts
    assert geometry.num_experts == skip + 1
    traces = coverage._traces(model, geometry)
    assert self_replay_gap(model, traces) == 0.0
    plan = build_plan(traces, geometry)
    plan.ids_LNK[:, ::2] = skip  # every other position skips
    seen: list = []
    with torch.no_grad(), replay(model, plan) as session:
        handle = _after_replay(session.sites[1].module, seen)
        out = output_tensor(model(**session.model_inputs()))
        handle.remove()
    _, weights_NK, ids_NK = seen[0][:3]
    skipped_N = plan.routed_N.clone()
    skipped_N[1::2] = False
    assert skipped_N.any() and torch.equal(ids_NK[skipped_N], torch.zeros_like(ids_NK[skipped_N]))
    assert (weights_NK[skipped_N] == 0).all() and (weights_NK[plan.routed_N & ~skipped_N] != 0).any()
    layout = layout_for(session.sites[1].module, None)
    assert (layout.unpack(seen[0])[2][skipped_N] == skip).all()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("precision", ["bf16", "autocast_bf16"])
def test_zaya_replays_in_bf16_with_unsaturated_routers(precision):
    mode = coverage.PRECISIONS[precision]
    model = _zaya_with_unsaturated_routers(mode.weights)
    geometry = model_geometry(model)
    traces = coverage._traces(model, geometry)
    assert self_replay_gap(model, traces, mode.forward) == 0.0
    plan = build_plan(coverage._shifted(traces, geometry), geometry)
    with torch.no_grad(), mode.forward():
        ref = output_tensor(model(**plan.model_inputs()))
    with replay(model, plan) as session:
        with mode.forward():
            out = output_tensor(model(**session.model_inputs()))
        out.float().pow(2).mean().backward()
    assert not torch.equal(out.detach(), ref)
    assert all(layer.mlp.gate.down_proj.weight.grad.abs().sum() > 0 for layer in model.model.layers)


def _jetmoe_reference(moe, x_TH: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """JetMoeMoE's output token by token from ids and weights: sum_k w_k * W_out[e] act(W_in[e] x) + bias."""
    out_TH = torch.zeros_like(x_TH)
    for t in range(x_TH.shape[0]):
        for k in range(ids_TK.shape[1]):
            e = int(ids_TK[t, k])
            gate, up = torch.nn.functional.linear(x_TH[t], moe.input_linear.weight[e]).chunk(2, dim=-1)
            out_TH[t] += w_TK[t, k] * torch.nn.functional.linear(moe.activation(gate) * up, moe.output_linear.weight[e])
    return out_TH + moe.bias


def test_jetmoe_sorted_slots_carry_the_replayed_ids():
    """JetMoE's router hands its experts slots sorted by expert: unpack then repack of HF's own output is HF's output bit
    for bit; ids it would not pick, repacked, drive its MoE block as the per-token reference does."""
    model = coverage.build_tiny("jetmoe", _FAMILY)
    moe = model.model.layers[0].mlp
    layout = layout_for(moe.router, moe)
    x_BSH = torch.randn(1, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = moe.router(x_BSH.view(-1, x_BSH.shape[-1]))
        logits_TE, w_TK, ids_TK = layout.unpack(out)
        assert torch.equal(ids_TK, logits_TE.topk(layout.top_k, dim=1).indices)
        assert differs(layout, out, layout.repack(out, logits_TE, w_TK, ids_TK)) is None
        other_TK = (ids_TK + 1) % layout.experts
        spec = GateSpec("topk_softmax", top_k=layout.top_k)
        other_w_TK = GATE_RULES.get("topk_softmax").weights(logits_TE, other_TK, spec)
        handle = layout.register_hook(moe.router, lambda m, a, o: layout.repack(o, logits_TE, other_w_TK, other_TK))
        got_BSH = moe(x_BSH)
        handle.remove()
        own_BSH = moe(x_BSH)
    want_TH = _jetmoe_reference(moe, x_BSH.view(-1, x_BSH.shape[-1]), other_TK, other_w_TK)
    torch.testing.assert_close(got_BSH.view(-1, x_BSH.shape[-1]), want_TH, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(own_BSH, got_BSH)


def test_jetmoe_numbers_its_two_routers_per_layer_as_route_layers():
    """Each decoder layer i holds two routers, each routing every token: route layers 2i + slot, slots in named_modules()
    order (JetMoE registers its MLP before its attention: MLP 0, attention's mixture of heads 1), 2L route layers."""
    model = coverage.build_tiny("jetmoe", _FAMILY)
    sites = find_routers(model)
    n = model.config.num_hidden_layers
    assert list(sites) == list(range(2 * n))
    for i, layer in enumerate(model.model.layers):
        mlp, attention = sites[2 * i], sites[2 * i + 1]
        assert mlp.module is layer.mlp.router and attention.module is layer.self_attention.experts.router
        assert (mlp.decoder_layer, mlp.slot, attention.decoder_layer, attention.slot) == (i, 0, i, 1)
    geometry = model_geometry(model, sites)
    assert (geometry.num_layers, geometry.moe_layer_ids) == (2 * n, tuple(range(2 * n)))


def _outputs_of(modules: dict, run) -> dict:
    """{name: first output tensor} of each module in one call of `run`."""
    seen: dict = {}
    handles = [m.register_forward_hook(lambda mod, a, out, k=k: seen.__setitem__(k, (out[0] if isinstance(out, tuple)
                                                                                       else out).detach().clone()))
               for k, m in modules.items()]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


def test_jetmoe_attention_site_is_forced_not_only_the_mlp():
    """Routes that differ from HF's own in layer 0's attention route layer only reach its mixture of heads (its output
    changes; its experts receive the plan's ids) while the MLP route layer of the same layer, shifted alone, leaves the
    attention's output bit for bit as under HF's own routes: each route layer forces its own router."""
    model = coverage.build_tiny("jetmoe", _FAMILY)
    geometry = model_geometry(model)
    layer0 = model.model.layers[0]
    watched = {"attention": layer0.self_attention, "mlp": layer0.mlp}
    plan = build_plan(coverage._traces(model, geometry), geometry)
    with torch.no_grad(), capture_routes(model) as own:
        model(**plan.model_inputs())
    plan = with_own_routes(plan, own)
    routed = plan.routed_N

    def shifted(route_layer: int):
        ids_LNK = plan.ids_LNK.clone()
        ids_LNK[route_layer] = torch.where(routed.unsqueeze(-1), (ids_LNK[route_layer] + 1) % geometry.num_experts,
                                           ids_LNK[route_layer])
        return dataclasses.replace(plan, ids_LNK=ids_LNK)

    def forward(p, seen=None):
        with torch.no_grad(), replay(model, p, record_routes=True) as session:
            handle = None if seen is None else _after_replay(session.sites[1].module, seen)
            outs = _outputs_of(watched, lambda: model(**session.model_inputs()))
            if handle is not None:
                handle.remove()
        return outs, session.routes

    base, _ = forward(plan)
    seen: list = []
    attention_moved, routes = forward(shifted(1), seen)  # route layer 1: layer 0's attention
    want_NK = shifted(1).layer_ids(1)[routed]
    assert torch.equal(routes.used_ids[1][routed], want_NK)
    layout = layout_for(layer0.self_attention.experts.router, layer0.self_attention.experts)
    assert torch.equal(layout.unpack(seen[0])[2][routed], want_NK)  # what the mixture of heads received
    attention_changed_BS = (attention_moved["attention"] != base["attention"]).any(-1).flatten()
    assert attention_changed_BS[routed].all()  # every forced position's attention output moves, only the routes did
    mlp_moved, _ = forward(shifted(0))  # route layer 0: layer 0's MLP
    assert torch.equal(mlp_moved["attention"], base["attention"])
    assert not torch.equal(mlp_moved["mlp"], base["mlp"])


def test_decoder_layers_holding_different_numbers_of_routers_are_refused_by_name():
    """Route layers are decoder_layer * R + slot for one R: a JetMoE whose layer 1 lost its attention router (1 router
    there, 2 elsewhere) has no such numbering, and is refused naming both layers, before any forward."""
    model = coverage.build_tiny("jetmoe", _FAMILY)
    model.model.layers[1].self_attention.experts.router = torch.nn.Identity()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(UnsupportedRouterError, match=r"jetmoe: decoder layers hold different numbers of routers, layer 1 holds 1 "
                                                     r"\('model.layers.1.mlp.router'\) and layer 0 2 .*decoder_layer \* R \+ slot"):
        find_routers(model)
    assert not calls


def test_ernie_vl_expert_sets_chosen_by_token_type_are_refused_in_their_own_words():
    """ERNIE-4.5-VL's two routers per layer are alternatives (text or vision experts, by token type), not two routes of
    every token: refused naming the block, both routers and the token type, not numbered as two route layers."""
    model = coverage.build_tiny("ernie4_5_vl_moe_text", _FAMILY)
    with pytest.raises(UnsupportedRouterError, match=r"^ernie4_5_vl_moe_text: MoE block 'layers.0.mlp' \(Ernie4_5_VLMoeMoeBlock\) "
                                                     r"holds expert sets a token takes one of \(routers 'layers.0.mlp.text_moe.gate', "
                                                     r"'layers.0.mlp.vision_moe.gate'\).*moe_mm_token_type_ids"):
        find_routers(model)


def test_inkling_is_refused_by_name_before_any_forward():
    model = coverage.build_tiny("inkling_text", _FAMILY)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(UnsupportedRouterError, match=r"inkling_text: router .*InklingTopkRouter.*shared experts.*does not return"):
        find_routers(model)
    assert not calls


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("family", ["llama4_text", "dbrx", "zaya"])
def test_conventions_leave_no_hook_or_patch_after_exit(family):
    """Every hook and patch a convention installs goes on exit of replay and of capture, so the model runs as HF's
    again and can be replayed again."""
    model = coverage.build_tiny(family, _FAMILY)
    plan, _ = _shifted_plan(model)
    before = _hook_count(model)
    with torch.no_grad():
        own = output_tensor(model(**plan.model_inputs()))
        for context in (lambda: replay(model, plan), lambda: capture_routes(model)):
            with context():
                assert _hook_count(model) > before
                model(**plan.model_inputs())
            assert _hook_count(model) == before
            assert not [m for m in model.modules() if "route_tokens_to_experts" in m.__dict__]
        assert torch.equal(output_tensor(model(**plan.model_inputs())), own)


@pytest.mark.parametrize("family", ["llama4_text", "dbrx", "zaya"])
def test_first_forward_under_activation_checkpointing(family):
    """The first forward's verification runs inside the checkpointed forward and must save nothing the recompute (which
    skips it) does not: else torch's checkpoint refuses the backward (Llama 4's unpack saved 3 tensors more)."""
    model = _zaya_with_unsaturated_routers(torch.float32) if family == "zaya" else coverage.build_tiny(family, _FAMILY)
    plan, _ = _shifted_plan(model)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()  # 5.24 renamed it; 5.19 has the old name only
    model.train()
    with replay(model, plan) as session:
        output_tensor(model(**session.model_inputs())).float().pow(2).mean().backward()
    assert session.expect_recompute
    for site in session.sites.values():
        grad = next(p.grad for p in site.module.parameters() if p.dim() == 2)
        assert grad is not None and grad.abs().sum() > 0, site.name
