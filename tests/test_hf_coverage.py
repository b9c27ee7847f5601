"""HF replay beyond the registered families: rules inferred and verified, the coverage table's claims re-run.

Every family docs/hf_coverage.md marks replayed is rebuilt from its config class (tiny, random, no
download) and must again pass self-replay bit for bit, change under other routes, and train its
routers. Refusals are checked on real families whose routers cannot be replayed.
"""

from __future__ import annotations

import os

import pytest
import torch

from moe_replay.integrations.hf import coverage, find_routers, model_geometry, replay
from moe_replay.replay import UnsupportedRouterError

TABLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "hf_coverage.md")
CLAIMED = coverage.claimed(TABLE) if os.path.exists(TABLE) else {}
_FAMILY = {
    "phimoe": ("PhimoeConfig", "transformers.models.phimoe.configuration_phimoe"),
    "llama4_text": ("Llama4TextConfig", "transformers.models.llama4.configuration_llama4"),
    "qwen3_moe": ("Qwen3MoeConfig", "transformers.models.qwen3_moe.configuration_qwen3_moe"),
    "mellum": ("MellumConfig", "transformers.models.mellum.configuration_mellum"),
    "minimax_m2": ("MiniMaxM2Config", "transformers.models.minimax_m2.configuration_minimax_m2"),
}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls on a shared CPU run 10-20x faster on one thread than fighting over several."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SLOW = {"kimi_linear", "afmoe", "granitemoehybrid"}
"""Families whose tiny model runs torch reference kernels (linear attention, mamba): 45-130 s each on a loaded 2-core CPU."""


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in sorted(CLAIMED)])
def test_claimed_family_replays(family):
    result = coverage.check_family(family, CLAIMED)
    assert result.status == "replayed", result.reason
    assert result.rule and result.layers


def test_inferred_rule_is_verified_not_guessed():
    """Mellum has no registered adapter: its rule comes from probing, and names what it found."""
    model = coverage.build_tiny("mellum", _FAMILY)
    sites = find_routers(model)
    adapters = {type(s.adapter).__name__ for s in sites.values()}
    assert adapters == {"InferredAdapter"}
    site = next(iter(sites.values()))
    assert site.adapter.describe() == "softmax_topk renorm"
    assert site.adapter.top_k(site.module) == 2 and site.adapter.num_experts(site.module) == 8


def test_selection_bias_on_the_parent_block_is_read_live():
    """MiniMax-M2 passes its bias from the MoE block: selection uses it, and a later change is seen."""
    model = coverage.build_tiny("minimax_m2", _FAMILY)
    site = next(iter(find_routers(model).values()))
    assert site.adapter.describe() == "sigmoid_bias_group renorm bias"
    bias = site.adapter.selection_bias(site.module)
    owner = dict(model.named_modules())[site.name.rsplit(".", 1)[0]]
    assert bias is owner.e_score_correction_bias
    owner.e_score_correction_bias = torch.zeros_like(bias)  # e.g. a checkpoint load replacing the buffer
    assert site.adapter.selection_bias(site.module) is owner.e_score_correction_bias


def test_router_no_rule_reproduces_is_refused_by_name_before_forward():
    """PhiMoE's sparsemixer is not in the rule table: refused with family, router, layer and what did not match."""
    model = coverage.build_tiny("phimoe", _FAMILY)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(UnsupportedRouterError, match=r"phimoe: router 'model\.layers\.0\.mlp\.router \(layer 0\)'.*no rule .*bit for bit"):
        model_geometry(model)
    assert not calls


def test_router_with_another_output_structure_is_refused():
    model = coverage.build_tiny("llama4_text", _FAMILY)
    with pytest.raises(UnsupportedRouterError, match=r"llama4_text: .*Llama4Router.*returns 2 tensors"):
        find_routers(model)


def test_uninitialised_router_is_refused():
    """All-zero router weights make every rule agree: nothing can be verified, so nothing is claimed."""
    from moe_replay.integrations.hf.infer import looks_like_router

    fresh = coverage.build_tiny("mellum", _FAMILY)  # a new instance: no verified adapter cached
    with torch.no_grad():
        for module in fresh.modules():
            if looks_like_router(module):
                module.weight.zero_()
    with pytest.raises(UnsupportedRouterError, match="uninitialised"):
        find_routers(fresh)


def test_mtp_layers_never_take_decoder_layer_ids():
    """transformers' MtpModel numbers its own layers from 0: its routers are refused, not mapped onto decoder layers."""
    from transformers.modeling_layers import MtpModel

    main = coverage.build_tiny("qwen3_moe", _FAMILY)
    main.config.num_mtp_layers = 1
    mtp = MtpModel(main, 1)
    assert any(".mtp_block." in n for n, _ in mtp.named_modules())
    with pytest.raises(UnsupportedRouterError, match="outside the decoder stack"):
        find_routers(mtp)
    main.mtp = mtp  # draft layers attached to the trainer's model: still refused by name
    with pytest.raises(UnsupportedRouterError, match=r"router 'mtp\.layers\.0\..*outside the decoder stack"):
        model_geometry(main)
    del main.mtp
    assert tuple(find_routers(main)) == (0, 1, 2)


def test_bf16_inferred_replay_is_bit_identical():
    """The verified dtype handling holds in bf16 too: self-replay reproduces HF's bf16 outputs exactly."""
    from moe_replay.replay import build_plan

    from dataclasses import replace as with_routes

    from moe_replay.integrations.hf import capture_routes

    model = coverage.build_tiny("mellum", _FAMILY).to(torch.bfloat16)
    geometry = model_geometry(model)
    (trace,) = coverage._traces(model, geometry)[:1]
    plan = build_plan([trace], geometry)
    # HF's own bf16 routes on exactly the inputs the plan feeds (a mask changes bf16 rounding vs a bare call)
    with torch.no_grad(), capture_routes(model) as cap:
        ref = model(**plan.model_inputs()).logits
    routes_TLK = torch.stack([cap[lid] for lid in geometry.moe_layer_ids], 1)[:-1].numpy()
    plan = build_plan([with_routes(trace, routes_TLK=routes_TLK)], geometry)
    with torch.no_grad(), replay(model, plan) as session:
        out = model(**session.model_inputs()).logits
    assert find_routers(model)[geometry.moe_layer_ids[0]].adapter.weights_in_logits_dtype
    mask = plan.attention_mask_BS.bool()
    assert torch.equal(out[mask], ref[mask])
