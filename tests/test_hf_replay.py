"""HF transformers replay on tiny real models, one table row per router family.

Before the vLLM capture path is involved, HF's own routing is the reference: replaying the routes
HF chose must reproduce HF's logits bit for bit (so the gate rules equal HF's), and replaying other
routes must change them and still give the router gradient at the replayed experts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from moe_replay.errors import GeometryMismatchError
from moe_replay.integrations.hf import capture_routes, find_routers, model_geometry, replay, self_routed_trace
from moe_replay.replay import BatchLayoutError, PlanConfig, RouteConsumptionError, UnsupportedRouterError, build_plan, score_tokens

_ATTN = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
FAMILIES = {
    # name: (config class, causal LM class, config kwargs, router weight/bias suffixes)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_ATTN, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       intermediate_size=64, norm_topk_prob=True)),
    "qwen3_moe_sparse": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                         dict(_ATTN, num_hidden_layers=4, mlp_only_layers=[0, 2], num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, intermediate_size=64, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(_ATTN, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(_ATTN, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, intermediate_size=32, rms_norm_eps=1e-5)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_ATTN, num_hidden_layers=2, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, intermediate_size=64, norm_topk_prob=False)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict({k: v for k, v in _ATTN.items() if k != "head_dim"}, num_hidden_layers=3, num_key_value_heads=4,
                         n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                         intermediate_size=64, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                         norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                         v_head_dim=16)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(_ATTN, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                     layer_types=["sliding_attention", "full_attention"], sliding_window=8)),
}
EXPECTED_LAYERS = {"qwen3_moe_sparse": (1, 3), "deepseek_v3": (1, 2)}

_CACHE: dict[str, torch.nn.Module] = {}


def tiny_hf_model(family: str) -> torch.nn.Module:
    """A random-init fp32 model; router weights (and choosing biases) spread wide to avoid ties."""
    if family not in _CACHE:
        import transformers

        cfg_cls, lm_cls, kwargs = FAMILIES[family]
        torch.manual_seed(0)
        model = getattr(transformers, lm_cls)(getattr(transformers, cfg_cls)(**kwargs)).float()
        with torch.no_grad():
            for site in find_routers(model).values():
                site.module.weight.normal_(0, 0.5)
                for buf in ("bias", "e_score_correction_bias"):
                    b = getattr(site.module, buf, None)
                    if b is not None:
                        b.copy_(torch.randn_like(b) * 0.3)
        _CACHE[family] = model.eval()
    return _CACHE[family]


def hf_traces(model, lengths, prompt_len=3, seed=0, routes="free"):
    """Traces whose routes are HF's own free routing of each sequence (run alone), or shifted ids."""
    geom = model_geometry(model)
    rng = np.random.default_rng(seed)
    out = [self_routed_trace(model, rng.integers(3, geom.vocab_size, s), prompt_len, f"req-{i}")
           for i, s in enumerate(lengths)]
    if routes == "shifted":  # the same set shifted by one expert: mostly experts HF would not pick
        out = [dataclasses.replace(t, routes_TLK=(t.routes_TLK + 1) % geom.num_experts) for t in out]
    return out


def plain_logits(model, plan):
    with torch.no_grad():
        return model(**plan.model_inputs()).logits


FAMILY_NAMES = list(FAMILIES)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_geometry_and_dispatch(family):
    model = tiny_hf_model(family)
    geom = model_geometry(model)
    assert geom.moe_layer_ids == EXPECTED_LAYERS.get(family, (0, 1))
    assert {s.adapter.family for s in find_routers(model).values()} == {family.removesuffix("_sparse")}


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("side", ["right", "left"])
def test_replaying_hf_routes_reproduces_hf_exactly(family, side):
    model = tiny_hf_model(family)
    traces = hf_traces(model, [9, 6, 7])
    plan = build_plan(traces, model_geometry(model), config=PlanConfig(padding_side=side))
    ref = plain_logits(model, plan)
    with torch.no_grad(), replay(model, plan, track_flips=True) as session:
        out = model(**session.model_inputs()).logits
    mask = plan.attention_mask_BS.bool()
    # same positions, same ids -> same weights bit for bit, so the logits agree exactly
    assert torch.equal(out[mask], ref[mask]), (out[mask] - ref[mask]).abs().max()
    assert session.flips.rate == 0.0
    # restored: no hooks left, and the next plain forward is unaffected
    assert all(not s.module._forward_hooks for s in find_routers(model).values())
    assert torch.equal(plain_logits(model, plan), ref)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_replaying_other_routes_changes_logits_and_trains_router(family):
    model = tiny_hf_model(family)
    traces = hf_traces(model, [8, 6], routes="shifted")
    geom = model_geometry(model)
    plan = build_plan(traces, geom)
    free = score_tokens(plain_logits(model, plan), plan).logprobs_G
    model.zero_grad()
    with replay(model, plan, track_flips=True) as session:
        scores = score_tokens(model(**session.model_inputs()).logits, plan)
        scores.logprobs_G.sum().backward()
    assert session.flips.rate > 0.9  # the replayed sets are not what the trainer would pick
    assert (scores.logprobs_G.detach() - free).abs().max() > 1e-3
    # gradient reaches router rows of replayed experts the trainer would not have chosen
    with torch.no_grad(), capture_routes(model) as cap:
        model(**plan.model_inputs())
    for j, lid in enumerate(geom.moe_layer_ids):
        site = find_routers(model)[lid]
        t = 0  # first token of row 0 (routed, in the causal past of every scored token)
        forced = set(traces[0].routes_TLK[t, j].tolist()) - set(cap[lid][t].tolist())
        assert forced, "shifted routes should contain at least one unchosen expert"
        grad = site.module.weight.grad
        assert all(grad[e].abs().sum() > 0 for e in forced), (lid, forced)
    model.zero_grad()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_activation_checkpointing_and_micro_batches_agree(family):
    model = tiny_hf_model(family)
    traces = hf_traces(model, [9, 5, 7, 6], seed=1, routes="shifted")
    geom = model_geometry(model)
    params = [p for p in model.parameters() if p.requires_grad]

    def run(plans, checkpoint: bool):
        model.train()
        if checkpoint:
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()  # 5.24 renamed it; 5.19 has the old name only
        model.zero_grad()
        lps, recomputes = [], []
        try:
            for plan in plans:
                with replay(model, plan) as session:
                    scores = score_tokens(model(**session.model_inputs()).logits, plan)
                    scores.logprobs_G.sum().backward()
                lps.append(scores.logprobs_G.detach())
                recomputes.append(dict(session.ledger.recompute_takes))
        finally:
            getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()  # 5.24 renamed it; 5.19 has the old name only
            model.eval()
        grads = [p.grad.clone() for p in params]
        model.zero_grad()
        return torch.cat(lps), grads, recomputes

    one = [build_plan(traces, geom)]
    lp_ref, g_ref, rc = run(one, checkpoint=False)
    assert all(n == 0 for n in rc[0].values())
    lp_ckpt, g_ckpt, rc = run(one, checkpoint=True)
    assert rc[0] == {lid: 1 for lid in geom.moe_layer_ids}  # every router recomputed once, same ids
    assert torch.equal(lp_ckpt, lp_ref)
    for a, b in zip(g_ckpt, g_ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # two micro-batches (different padding) accumulate the same gradient as one batch
    micro = [build_plan(traces[:2], geom), build_plan(traces[2:], geom, config=PlanConfig(padding_side="left"))]
    lp_mb, g_mb, _ = run(micro, checkpoint=True)
    torch.testing.assert_close(lp_mb, lp_ref, atol=1e-5, rtol=0)
    for a, b in zip(g_mb, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_bad_input_fails_before_any_forward():
    model = tiny_hf_model("qwen3_moe")
    geom = model_geometry(model)
    good = hf_traces(model, [7, 5])
    gapped = hf_traces(tiny_hf_model("qwen3_moe_sparse"), [6])  # MoE layers (1, 3), not (0, 1)
    wider = hf_traces(tiny_hf_model("qwen2_moe"), [6])  # 16 experts top-4
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(GeometryMismatchError, match="moe_layer_ids"):
            replay(model, build_plan(gapped, model_geometry(tiny_hf_model("qwen3_moe_sparse"))))
        with pytest.raises(GeometryMismatchError, match="num_experts"):
            build_plan(wider, geom)
        plan = build_plan(good, geom)
        with pytest.raises(BatchLayoutError, match="batch order differs"):
            build_plan(good[::-1], geom, input_ids_BS=plan.input_ids_BS, attention_mask_BS=plan.attention_mask_BS)
        assert not calls
        # a forward over a batch other than the plan's is refused at the first router, naming the layer
        with pytest.raises(RouteConsumptionError, match="layer 0: router saw 5 tokens"):
            with replay(model, plan):
                model(input_ids=torch.zeros(1, 5, dtype=torch.long))
        # a second forward under one plan, and a forward that never happened
        with pytest.raises(RouteConsumptionError, match="second forward"):
            with torch.no_grad(), replay(model, plan):
                model(**plan.model_inputs())
                model(**plan.model_inputs())
        with pytest.raises(RouteConsumptionError, match=r"layers \[0, 1\].*'req-0', 'req-1'"):
            with replay(model, plan):
                pass
        assert all(not s.module._forward_hooks for s in find_routers(model).values())
    finally:
        handle.remove()


def test_contexts_do_not_nest_and_checkpointing_needs_backward_inside():
    model = tiny_hf_model("olmoe")
    plan = build_plan(hf_traces(model, [6]), model_geometry(model))
    with torch.no_grad(), replay(model, plan):
        with pytest.raises(RouteConsumptionError, match="do not nest"):
            replay(model, plan).__enter__()
        model(**plan.model_inputs())
    model.train()
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()  # 5.24 renamed it; 5.19 has the old name only
    try:
        with pytest.raises(RouteConsumptionError, match="backward"):
            with replay(model, plan):
                loss = model(**plan.model_inputs()).logits.sum()
        del loss  # a backward out here would recompute with free routes; the context already said so
    finally:
        getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()  # 5.24 renamed it; 5.19 has the old name only
        model.eval()
        model.zero_grad()


def test_unknown_router_family_is_a_clear_error():
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(UnsupportedRouterError, match="supported router classes: qwen3_moe .*gpt_oss"):
        model_geometry(dense)
