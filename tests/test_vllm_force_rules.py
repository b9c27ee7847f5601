"""The router table of forced scoring (router_rules.ROUTER_GATES) against vLLM's own router code.

Each case builds a real vLLM router object and asks it to route random logits; the weights the
table's GateSpec gives (through the trainer's GATE_RULES) at the router's own ids must equal the
router's weights, in the router's column order and under a permutation of it. Only code that
runs on CPU is exercised: CPURouter in every mode, and the torch-native grouped top-k of the GPU
GroupedTopKRouter. The GPU kernels (topk_softmax, topk_sigmoid, fused grouped / biased top-k)
are NOT run here; for those kinds only the settings -> GateSpec mapping is checked.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from moe_replay.integrations.vllm.errors import ForceRouteError  # noqa: E402
from moe_replay.integrations.vllm.router_rules import forced_gate_weights, router_gate  # noqa: E402

E, K, T = 32, 4, 64


def _logits(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, E, generator=g) * 2).to(dtype), torch.randn(T, 8, generator=g)


def _check(router, logits, hidden, exact=False):
    w, ids = router._compute_routing(hidden, logits, None)
    gate = router_gate(router, 0)
    got = forced_gate_weights(gate, logits, ids)
    assert got.dtype == torch.float32 and got.shape == (T, K)
    if exact:
        assert torch.equal(got, w.float()), (gate, (got - w.float()).abs().max())
    else:
        torch.testing.assert_close(got, w.float(), rtol=2e-6, atol=2e-7)
    perm = torch.tensor([2, 0, 3, 1])
    torch.testing.assert_close(forced_gate_weights(gate, logits, ids[:, perm]), got[:, perm], rtol=2e-6, atol=2e-7)  # sums reorder: 1 ulp
    return gate.spec


def cpu_router(**kw):
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    return CPURouter(top_k=K, global_num_experts=E, **kw)


@pytest.mark.parametrize("renormalize", [True, False])
def test_cpu_router_plain_softmax(renormalize):
    """Qwen3/OLMoE/Mixtral on vLLM-CPU: bit for bit in fp32 when renormalised (the same ops)."""
    x, h = _logits()
    spec = _check(cpu_router(renormalize=renormalize), x, h, exact=renormalize)
    assert spec.rule == ("topk_softmax" if renormalize else "softmax_topk")


def test_cpu_router_bf16_logits_round_like_the_router():
    """bf16 logits: CPURouter's softmax runs in bf16, so its weights carry bf16 rounding (0.04 nats
    of logprob on the tiny model when ignored); the rule rounds the same way: bit for bit."""
    x, h = _logits(torch.bfloat16, seed=3)
    _check(cpu_router(renormalize=True), x, h, exact=True)


@pytest.mark.parametrize("scoring,bias,scale", [("softmax", False, 1.0), ("sigmoid", True, 2.5), ("sigmoid", False, 1.0)])
def test_cpu_router_grouped(scoring, bias, scale):
    """DeepSeek-V2/V3 on vLLM-CPU: groups and the correction bias choose, the scores weigh."""
    x, h = _logits(seed=1)
    b = torch.randn(E, generator=torch.Generator().manual_seed(5)) if bias else None
    r = cpu_router(use_grouped_topk=True, num_expert_group=4, topk_group=2, scoring_func=scoring,
                   routed_scaling_factor=scale, e_score_correction_bias=b)
    spec = _check(r, x, h)
    assert (spec.num_groups, spec.topk_group, spec.routed_scaling_factor) == (4, 2, scale)


def test_gpu_grouped_router_native_path():
    """GroupedTopKRouter's torch-native grouped_topk (softmax, no bias) runs on CPU: same weights."""
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopKRouter, grouped_topk

    x, h = _logits(seed=2)
    r = GroupedTopKRouter(K, E, num_expert_group=4, topk_group=2, scoring_func="softmax", routed_scaling_factor=1.5)
    w, ids = grouped_topk(h, x, K, True, 4, 2, scoring_func="softmax", routed_scaling_factor=1.5)
    torch.testing.assert_close(forced_gate_weights(router_gate(r, 0), x, ids), w, rtol=2e-6, atol=2e-7)


def test_gpu_router_kinds_map_to_rules():
    """Settings -> GateSpec for the GPU kinds (their kernels are untested here)."""
    from vllm.model_executor.layers.fused_moe.router.fused_topk_bias_router import FusedTopKBiasRouter
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter

    assert router_gate(FusedTopKRouter(K, E, renormalize=False), 0).spec.rule == "softmax_topk"
    assert not router_gate(FusedTopKRouter(K, E, renormalize=False), 0).spec.renormalize
    assert router_gate(FusedTopKRouter(K, E, scoring_func="sigmoid"), 0).spec.rule == "sigmoid_bias_group"
    s = router_gate(FusedTopKBiasRouter(K, E, e_score_correction_bias=torch.zeros(E), routed_scaling_factor=2.5), 0).spec
    assert (s.rule, s.routed_scaling_factor) == ("sigmoid_bias_group", 2.5)


def test_unreproducible_routers_are_refused_by_name():
    """A custom routing function, DeepSeek-V4's sqrtsoftplus, an unknown router class: refused, naming it."""
    from vllm.model_executor.layers.fused_moe.router.routing_simulator_router import RoutingSimulatorRouter

    def my_route(**kw):
        raise AssertionError

    with pytest.raises(ForceRouteError, match="CPURouter.*custom_routing_function 'my_route'"):
        router_gate(cpu_router(custom_routing_function=my_route), 2)
    with pytest.raises(ForceRouteError, match="sqrtsoftplus"):
        router_gate(cpu_router(scoring_func="sqrtsoftplus", e_score_correction_bias=torch.zeros(E)), 0)
    with pytest.raises(ForceRouteError, match="MoE layer 5: router kind RoutingSimulatorRouter has no gate rule"):
        router_gate(RoutingSimulatorRouter(K, E), 5)
