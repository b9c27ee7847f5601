"""Gate rules of routers the softmax / sigmoid rules do not reproduce: Gemma 4's probabilities times a per-expert
scale (probs_topk + GateSpec.expert_scale), Phi-MoE's sparsemixer, Kolibri1's bias on the raw logits (bias_on).

Each rule is held against the HF router's own code (its module or function, random weights and inputs) bit for
bit in fp32 and bf16, then through HF replay on the family's tiny model: self-replay bit-identical, the live
per-expert scale, Phi-MoE in training mode. Legend: T tokens, E experts, K top-k, H hidden.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch

from moe_replay.integrations.hf import coverage, find_routers, model_geometry, replay
from moe_replay.integrations.hf.replay import self_replay_gap, self_routed_trace
from moe_replay.replay import GateSpec, build_plan, gate_weights, select_experts

_FAMILY = {
    "gemma4_text": ("Gemma4TextConfig", "transformers.models.gemma4.configuration_gemma4"),
    "diffusion_gemma_text": ("DiffusionGemmaTextConfig", "transformers.models.diffusion_gemma.configuration_diffusion_gemma"),
    "phimoe": ("PhimoeConfig", "transformers.models.phimoe.configuration_phimoe"),
    "kolibri1": ("Kolibri1Config", "transformers.models.kolibri1.configuration_kolibri1"),
}
_ROUTER = {
    "gemma4_text": ("transformers.models.gemma4.modeling_gemma4", "Gemma4TextRouter"),
    "diffusion_gemma_text": ("transformers.models.diffusion_gemma.modeling_diffusion_gemma", "DiffusionGemmaTextRouter"),
    "kolibri1": ("transformers.models.kolibri1.modeling_kolibri1", "Kolibri1TopKRouter"),
}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _router(family: str, dtype: torch.dtype = torch.float32):
    """The family's HF router module on its tiny config, every parameter random (scales in [0.5, 2])."""
    cls_name, module = _FAMILY[family]
    config = coverage.tiny_config(family, getattr(importlib.import_module(module), cls_name))
    mod, name = _ROUTER[family]
    router = getattr(importlib.import_module(mod), name)(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, p in list(router.named_parameters()) + list(router.named_buffers()):
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "bias" in pname:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.5 + 1.5 * torch.rand(p.shape, generator=gen))
    return router.to(dtype), config


# -- rules against HF's own router code ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["gemma4_text", "diffusion_gemma_text"])
def test_probs_topk_with_per_expert_scale_is_the_gemma4_router(family, dtype):
    router, config = _router(family, dtype)
    hidden_TH = torch.randn(2048, config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    probs_TE, w_TK, ids_TK = router(hidden_TH)
    spec = GateSpec("probs_topk", top_k=ids_TK.shape[1], expert_scale=True)
    scale_E = router.per_expert_scale
    mine_TK = gate_weights(probs_TE, ids_TK, spec, scale_E=scale_E)
    assert mine_TK.dtype == w_TK.dtype and torch.equal(mine_TK, w_TK)
    assert torch.equal(select_experts(probs_TE, spec), ids_TK)
    # softmax of the probabilities (what softmax_topk would do), or no scale, is another rule
    assert not torch.equal(gate_weights(probs_TE, ids_TK, GateSpec("probs_topk", ids_TK.shape[1])), w_TK)
    assert not torch.equal(gate_weights(probs_TE, ids_TK, GateSpec("softmax_topk", ids_TK.shape[1], expert_scale=True),
                                        scale_E=scale_E), w_TK)
    # the scale is a trained parameter: replayed weights give it its gradient, and the router's projection too
    router.zero_grad()
    gate_weights(probs_TE, (ids_TK + 1) % probs_TE.shape[1], spec, scale_E=scale_E).sum().backward()
    assert (scale_E.grad != 0).sum() == scale_E.numel() and router.proj.weight.grad.abs().sum() > 0


def test_expert_scale_is_given_exactly_where_the_spec_weighs_by_it():
    logits_TE, ids_TK = torch.randn(4, 8).softmax(-1), torch.tensor([[0, 1]] * 4)
    with pytest.raises(ValueError, match="expert_scale=True"):
        gate_weights(logits_TE, ids_TK, GateSpec("probs_topk", 2, expert_scale=True))
    with pytest.raises(ValueError, match="expert_scale=False"):
        gate_weights(logits_TE, ids_TK, GateSpec("softmax_topk", 2), scale_E=torch.ones(8))


def _sparsemixer():
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    return sparsemixer


SPARSEMIXER = GateSpec("sparsemixer", 2, jitter_eps=0.01, upcast=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparsemixer_is_hf_eval_mode_bit_for_bit(dtype):
    """Logit spreads from 0.05 (many experts inside the 2% window) to 20 (one): weights and ids in column order."""
    gen = torch.Generator().manual_seed(0)
    for spread in (0.05, 0.5, 2.0, 20.0):
        x_TE = (torch.randn(20000, 16, generator=gen) * spread).to(dtype)
        w_TK, ids_TK = _sparsemixer()(x_TE, jitter_eps=0.01, training=False)
        mine_TK = gate_weights(x_TE, ids_TK, SPARSEMIXER)
        assert mine_TK.dtype == dtype and torch.equal(mine_TK, w_TK), spread
        assert torch.equal(select_experts(x_TE, SPARSEMIXER), ids_TK), spread
    if dtype == torch.bfloat16:  # fp32 scores round the window otherwise in bf16: the spec's upcast is not a no-op
        x_TE = (torch.randn(200000, 16, generator=gen) * 0.5).to(dtype)
        w_TK, ids_TK = _sparsemixer()(x_TE, jitter_eps=0.01, training=False)
        upcast = GateSpec("sparsemixer", 2, jitter_eps=0.01, upcast=True)
        assert not torch.equal(gate_weights(x_TE, ids_TK, upcast).to(dtype), w_TK)


def test_sparsemixer_at_other_ids_centres_each_window_on_the_given_expert():
    """Written out: expert 1 (logit 1.0) first keeps expert 0 (above it) and expert 2 (1% below); stage 2 without
    expert 1, centred on expert 2 (0.99), keeps expert 0 and itself. Every replayed expert weighs > 0."""
    x_TE = torch.tensor([[2.0, 1.0, 0.99, 0.5, -1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    exact = GateSpec("sparsemixer", 2, jitter_eps=0.01, upcast=False)  # in float64, as given
    w_TK = gate_weights(x_TE, torch.tensor([[1, 2]]), exact)
    e = math.exp
    want = [e(1.0) / (e(2.0) + e(1.0) + e(0.99)), e(0.99) / (e(2.0) + e(0.99))]
    torch.testing.assert_close(w_TK[0], torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    # not symmetric in its columns: column 0 is stage 1's expert
    swapped = gate_weights(x_TE, torch.tensor([[2, 1]]), exact)
    assert not torch.allclose(swapped.flip(-1), w_TK)
    # experts the router would never pick still weigh and pass gradient to their logits
    gen = torch.Generator().manual_seed(3)
    x_TE = torch.randn(512, 16, generator=gen).requires_grad_()
    own_TK = select_experts(x_TE.detach(), SPARSEMIXER)
    other_TK = (own_TK + 5) % 16
    w_TK = gate_weights(x_TE, other_TK, SPARSEMIXER)
    assert (w_TK > 0).all()
    w_TK.sum().backward()
    assert (x_TE.grad.gather(1, other_TK) != 0).all()


def test_sparsemixer_training_mode_forward_and_gradient_where_the_sample_is_the_max():
    """HF's training mode samples; in the rows where its sample is the eval choice, its forward is the rule's
    bit for bit and its custom backward (PhimoeMultiplier) the rule's autograd up to summation order."""
    torch.manual_seed(0)
    x_TE = (torch.randn(4000, 16) * 0.02 + torch.randn(16) * 0.01).requires_grad_()  # many experts in the window
    w_eval_TK, ids_TK = _sparsemixer()(x_TE, jitter_eps=0.01, training=False)
    w_train_TK, sampled_TK = _sparsemixer()(x_TE, jitter_eps=0.01, training=True)
    same_T = (sampled_TK == ids_TK).all(-1)
    assert 100 < int(same_T.sum()) < len(same_T)  # both kinds of rows occur
    mine_TK = gate_weights(x_TE, ids_TK, SPARSEMIXER)
    assert torch.equal(mine_TK[same_T], w_train_TK[same_T])
    g_TK = torch.randn_like(mine_TK)
    hf_TE, = torch.autograd.grad((w_train_TK * g_TK).sum(), x_TE)
    ours_TE, = torch.autograd.grad((mine_TK * g_TK).sum(), x_TE)
    torch.testing.assert_close(ours_TE[same_T], hf_TE[same_T], rtol=0, atol=1e-7)


def test_sparsemixer_spec_needs_two_stages_and_an_epsilon():
    with pytest.raises(ValueError, match="top_k=2"):
        GateSpec("sparsemixer", 3, jitter_eps=0.01)
    with pytest.raises(ValueError, match="jitter_eps"):
        GateSpec("sparsemixer", 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kolibri1_chooses_by_logits_plus_bias(dtype):
    router, config = _router("kolibri1", dtype)
    hidden_TH = torch.randn(4096, config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits_TE, w_TK, ids_TK = router(hidden_TH)
    bias_E = router.e_score_correction_bias
    spec = GateSpec("sigmoid_bias_group", ids_TK.shape[1], renormalize=bool(router.norm_topk_prob), bias_on="logits")
    assert torch.equal(gate_weights(logits_TE, ids_TK, spec, bias_E), w_TK)
    assert torch.equal(select_experts(logits_TE, spec, bias_E).sort(-1).values, ids_TK.sort(-1).values)
    on_scores = select_experts(logits_TE, GateSpec("sigmoid_bias_group", ids_TK.shape[1]), bias_E)
    assert (on_scores.sort(-1).values != ids_TK.sort(-1).values).any(-1).sum() > 100
    with pytest.raises(ValueError, match="bias_on"):
        GateSpec("softmax_topk", 2, bias_on="logits")


# -- through HF replay on the tiny models ----------------------------------------------------------
def _traces(model, n: int = 2) -> list:
    rng = np.random.default_rng(0)
    vocab = model_geometry(model).vocab_size
    return [self_routed_trace(model, rng.integers(3, vocab, s), 2, f"req-{i}") for i, s in enumerate((7, 5)[:n])]


def test_gemma4_replay_reads_its_trained_per_expert_scale_live():
    """Loaded scales are ones; trained ones are not: self-replay is bit-identical with scales changed after attach,
    and replayed routes give the scale its gradient."""
    model = coverage.build_tiny("gemma4_text", _FAMILY)
    sites = find_routers(model)
    assert {s.adapter.describe() for s in sites.values()} == {"probs_topk renorm per-expert-scale"}
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for s in sites.values():
            s.module.per_expert_scale.copy_(0.5 + 1.5 * torch.rand(s.module.per_expert_scale.shape, generator=gen))
    traces = _traces(model)
    assert self_replay_gap(model, traces) == 0.0
    plan = build_plan(traces, model_geometry(model, sites))
    model.zero_grad()
    with replay(model, plan) as session:
        model(**session.model_inputs()).logits.float().pow(2).mean().backward()
    for s in sites.values():
        assert s.module.per_expert_scale.grad is not None and s.module.per_expert_scale.grad.abs().sum() > 0


def test_a_scale_the_router_does_not_weigh_by_is_not_inferred():
    """With ones as scales both forms reproduce the probe; the probe with the scale changed tells them apart."""
    model = coverage.build_tiny("gemma4_text", _FAMILY)
    for m in model.modules():
        if type(m).__name__ == "Gemma4TextRouter":
            def unscaled(h, r=m):  # Gemma4TextRouter.forward without its last line
                probs = torch.softmax(r.proj(r.norm(h) * r.scale * r.scalar_root_size), dim=-1, dtype=torch.float32)
                w, ids = torch.topk(probs, k=r.config.top_k_experts, dim=-1)
                return probs, w / w.sum(dim=-1, keepdim=True), ids
            m.forward = unscaled
    assert {s.adapter.describe() for s in find_routers(model).values()} == {"probs_topk renorm"}


def test_phimoe_bf16_is_verified_in_the_logits_dtype():
    """HF's sparsemixer runs on bf16 logits; fp32 scores differ in ~1 of 8000 rows, fewer than 4096 probe rows show."""
    model = coverage.build_tiny("phimoe", _FAMILY, torch.bfloat16)
    assert {s.adapter.describe() for s in find_routers(model).values()} == {"sparsemixer jitter=0.01 logits-dtype"}


def _phimoe(jitter_eps: float):
    """The tiny Phi-MoE with a sparsemixer window of 2 * jitter_eps (0.01 keeps one expert in most of its rows)."""
    model = coverage.build_tiny("phimoe", _FAMILY)
    for m in model.modules():
        if type(m).__name__ == "PhimoeTopKRouter":
            m.router_jitter_noise = jitter_eps
    return model


def test_phimoe_in_training_mode_replays_recorded_ids_with_eval_weights():
    """Training mode samples experts in HF (a window of 100% keeps several experts per row, so two forwards differ);
    attached and run in training mode, replay uses the recorded ids and the eval weights: the logits are HF's
    eval-mode forward's, attach leaves the training flags as they were, and the routers get gradient."""
    reference = _phimoe(0.5)
    traces = _traces(reference, 1)  # one sequence, no padding: the batch HF's eval forward sees too
    plan = build_plan(traces, model_geometry(reference))
    with torch.no_grad():
        ref = reference(**plan.model_inputs()).logits
    model = _phimoe(0.5).train()  # the same weights, never attached in eval mode
    torch.manual_seed(0)
    with torch.no_grad():
        assert not torch.equal(model(**plan.model_inputs()).logits, model(**plan.model_inputs()).logits)
    sites = find_routers(model)
    assert {s.adapter.describe() for s in sites.values()} == {"sparsemixer jitter=0.5"}
    assert model.training and all(m.training for s in sites.values() for m in s.module.modules())
    model.zero_grad()
    with replay(model, plan) as session:
        out = model(**session.model_inputs()).logits
        out.float().pow(2).mean().backward()
    # The last token has no recorded route: the router's own sample routes it, which changes the token sets the
    # experts' matmuls run on and so the rounding of other rows (4e-8 measured); HF's training weights (x 1/3 at
    # random, other samples) would move the logits by > 1e-3.
    routed = plan.routed_N.view(out.shape[:2])
    assert routed.sum() == traces[0].num_tokens - 1
    torch.testing.assert_close(out.detach()[routed], ref[routed], rtol=0, atol=1e-6)
    for s in sites.values():
        assert s.module.weight.grad.abs().sum() > 0
