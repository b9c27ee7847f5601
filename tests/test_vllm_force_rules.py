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
from moe_replay.integrations.vllm.scoring.router_rules import forced_gate_weights, router_gate  # noqa: E402

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


@pytest.mark.parametrize("kind", ["softmax", "softmax_plain", "grouped_sigmoid_bias", "bf16", "softmax_device_path"])
def test_forcing_step_traces_whole_and_forces_only_masked_rows(kind):
    """The forcing step of force_step.py around a real router: torch.compile traces it as one graph
    (fullgraph, dynamic row count: no Python branch on tensor values, no data-dependent shape); the
    compiled call equals the eager one; masked rows get the forced ids and the rule's weights at
    them, every other row the router's own ids and weights exactly; every forced row is
    acknowledged; after clear() the same compiled call routes freely (the buffers are read live).
    `softmax_device_path` runs the fills and reads device runners use (torch ops, no numpy views)."""
    from types import SimpleNamespace

    import numpy as np

    from moe_replay.integrations.vllm.scoring.force_step import ForceStep, forced_routing

    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    if kind == "grouped_sigmoid_bias":
        r = cpu_router(use_grouped_topk=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid",
                       routed_scaling_factor=2.5, e_score_correction_bias=torch.randn(E, generator=torch.Generator().manual_seed(5)))
    else:
        r = cpu_router(renormalize=kind != "softmax_plain")
    step = ForceStep([(0, SimpleNamespace(router=r))], rows=T + 8, device=torch.device("cpu"))
    if kind == "softmax_device_path":  # the torch fills device runners use (no host views)
        step._np = None
    step.bind(forced_routing)
    try:
        rng = np.random.default_rng(0)
        rows_R = np.arange(1, T, 3)
        ids_RLK = np.stack([rng.permutation(E)[:K] for _ in rows_R])[:, None, :].astype(np.int32)
        step.fill(rows_R, ids_RLK)
        compiled = torch.compile(r._compute_routing, fullgraph=True, backend="eager", dynamic=True)
        for n in (T, T // 2 + 3):  # two row counts: one trace serves both
            x, h = _logits(dtype, seed=n)
            x, h = x[:n], h[:n]
            own_w, own_ids = type(r)._compute_routing(r, h, x, None)
            w, ids = compiled(h, x, None)
            ew, eids = r._compute_routing(h, x, None)
            assert torch.equal(w, ew) and torch.equal(ids, eids)
            m = torch.zeros(n, dtype=torch.bool)
            rows = torch.from_numpy(rows_R[rows_R < n])
            m[rows] = True
            assert torch.equal(ids[~m], own_ids[~m]) and torch.equal(w[~m], own_w[~m])
            forced = torch.from_numpy(ids_RLK[rows_R < n, 0]).to(ids.dtype)
            assert torch.equal(ids[rows], forced)
            assert torch.equal(w[rows], forced_gate_weights(step.gates[0], x[rows], forced))
            assert step.unforced(rows_R[rows_R < n]) == []
        step.clear()
        w, ids = compiled(h, x, None)
        assert torch.equal(ids, own_ids) and torch.equal(w, own_w)
    finally:
        step.unbind()
