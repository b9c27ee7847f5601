"""Megatron-LM's router-replay test assertions, ported to this project's gate rules and Megatron replay.

Source: NVIDIA/Megatron-LM, tests/unit_tests/transformer/moe/test_router_replay.py. Each test names
the Megatron test function whose assertion it ports. Megatron's tests drive `RouterReplay` through
`topk_routing_with_score_function`; here the same calls are the reference, and the project's
`replay/gates.py` rules (which the HF replay and the vLLM forced scoring compute with) and
`moe_replay.integrations.megatron.replay` (which drives Megatron's RouterReplay on real
TopKRouters) must agree with them. The CPU shims for megatron-core are the fixture of
tests/test_megatron_replay.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction  # noqa: E402

from moe_replay.geometry import ModelGeometry  # noqa: E402
from moe_replay.integrations.megatron import replay  # noqa: E402
from moe_replay.replay import build_plan  # noqa: E402
from moe_replay.replay.gates import GateSpec, gate_weights, select_experts  # noqa: E402

from .test_megatron_replay import GEOM, H, ROUTERS, make_plan, make_routers, megatron_cpu  # noqa: E402,F401
from .trace_factory import random_trace  # noqa: E402

PRE = GateSpec(rule="softmax_topk", top_k=2, renormalize=False)  # softmax over E, gathered (Qwen2-MoE style)
POST = GateSpec(rule="topk_softmax", top_k=2)  # top-k of logits, softmax over the K (GPT-OSS style)


def setup_function():
    RouterReplay.global_router_replay_instances.clear()


def teardown_function():
    RouterReplay.global_router_replay_instances.clear()


def _megatron(logits, rr, *, pre: bool):
    return topk_routing_with_score_function(logits=logits, topk=2, use_pre_softmax=pre, router_replay=rr,
                                            score_function="softmax")


def test_record_mode_topk_matches_the_projects_selection_and_weights():
    """Megatron test_record_mode_with_topk_routing_softmax_post: RECORD stores torch.topk's
    indices, probs and routing map are [T, E] with 2 experts per token. Ported: the project's
    post-softmax rule selects exactly the recorded experts, and its weights at them are Megatron's
    probabilities bit for bit."""
    torch.manual_seed(0)
    rr = RouterReplay()
    rr.set_router_replay_action(RouterReplayAction.RECORD)
    logits = torch.randn(4, 6)
    probs, routing_map = _megatron(logits, rr, pre=False)
    recorded = rr.get_recorded_indices()
    assert recorded is not None
    assert torch.equal(recorded, torch.topk(logits, k=2, dim=1).indices)
    assert probs.shape == (4, 6) and routing_map.shape == (4, 6)
    assert routing_map.sum(dim=1).eq(2).all()
    assert torch.equal(select_experts(logits, POST), recorded)
    assert torch.equal(gate_weights(logits, recorded, POST), probs.gather(1, recorded))


def test_replay_forward_softmax_pre_scores_are_the_full_softmax_at_forced_ids():
    """Megatron test_replay_forward_with_topk_routing_softmax_pre: REPLAY_FORWARD with forced ids
    gives routing-map rows of 2 and probs equal to softmax(logits) gathered at the ids. The
    project's pre-softmax rule gives the same numbers, bit for bit."""
    torch.manual_seed(1)
    rr = RouterReplay()
    rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    logits = torch.randn(3, 5)
    target = torch.tensor([[1, 2], [0, 3], [2, 4]], dtype=torch.long)
    rr.set_target_indices(target)
    probs, routing_map = _megatron(logits, rr, pre=True)
    assert routing_map.sum(dim=1).eq(2).all()
    scores = torch.softmax(logits, dim=-1)
    assert torch.equal(probs.gather(1, target), scores.gather(1, target))
    ours = gate_weights(logits, target, PRE)
    assert torch.equal(ours, scores.gather(1, target))
    assert torch.equal(ours, probs.gather(1, target))


def test_replay_forward_softmax_post_scores_are_the_softmax_of_forced_logits():
    """Megatron test_replay_forward_with_topk_routing_softmax_post: probs at the forced ids are
    softmax(logits.gather(ids)). The project's post-softmax rule gives the same numbers, bit for bit,
    also where the forced experts are not the router's own top-2."""
    torch.manual_seed(2)
    rr = RouterReplay()
    rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    logits = torch.randn(3, 6)
    target = torch.tensor([[1, 2], [0, 5], [3, 4]], dtype=torch.long)
    rr.set_target_indices(target)
    probs, routing_map = _megatron(logits, rr, pre=False)
    selected = torch.softmax(logits.gather(1, target), dim=-1)
    assert torch.equal(probs.gather(1, target), selected)
    assert routing_map.sum(dim=1).eq(2).all()
    assert torch.equal(gate_weights(logits, target, POST), selected)
    assert not torch.equal(select_experts(logits, POST).sort(-1).values, target.sort(-1).values)


def test_replay_session_sets_each_routers_indices_by_layer_and_clears_them(megatron_cpu):  # noqa: F811
    """Megatron test_global_set_get_clear_indices: set_replay_data hands each RouterReplay its own
    indices, clear_global_indices resets every target to None. Ported to the project's session:
    inside it each real TopKRouter holds the plan's ids of its own global layer (routers created in
    reverse layer order), after it every target is None again."""
    routers = make_routers(**ROUTERS["softmax_after_topk"])
    plan = make_plan()
    with replay(routers, plan) as session:
        for r in routers:
            lid = r.layer_number - 1
            target = r.router_replay.target_topk_idx
            assert target is session.ids_MK[0][lid]
            routed_M = plan.routed_N.view(plan.batch_size, plan.seq_len).t().reshape(-1)
            want = plan.layer_ids(lid).view(plan.batch_size, plan.seq_len, -1).transpose(0, 1).reshape(-1, GEOM.top_k)
            assert torch.equal(target[routed_M], want[routed_M].to(target.dtype))
        for r in routers:
            r(torch.randn(plan.seq_len, plan.batch_size, H))
    assert all(r.router_replay.target_topk_idx is None for r in routers)
    assert all(r.router_replay.get_recorded_indices() is None for r in routers)


def test_replay_session_sets_and_clears_the_action_of_every_router(megatron_cpu):  # noqa: F811
    """Megatron test_global_action_set_and_clear: every RouterReplay gets REPLAY_FORWARD, then None
    after clearing. Ported: inside the session every router is in REPLAY_FORWARD, after it None."""
    routers = make_routers(**ROUTERS["softmax_before_topk"])
    plan = make_plan()
    with replay(routers, plan):
        assert all(r.router_replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD for r in routers)
        for r in routers:
            r(torch.randn(plan.seq_len, plan.batch_size, H))
    assert all(r.router_replay.router_replay_action is None for r in routers)


def test_replay_data_for_another_number_of_routers_is_a_value_error(megatron_cpu):  # noqa: F811
    """Megatron test_set_replay_data_length_mismatch: replay data for 2 layers on 1 router raises
    ValueError. Ported: a plan whose MoE layer count differs from the routers' (fewer or more
    routers than recorded layers) raises a ValueError before any forward, and no router is left
    in a replay state."""
    routers = make_routers(**ROUTERS["softmax_after_topk"])
    with pytest.raises(ValueError):
        replay(routers[:2], make_plan())
    two = ModelGeometry(num_layers=5, moe_layer_ids=(1, 3), num_experts=8, top_k=2, vocab_size=512, family="megatron")
    rng = np.random.default_rng(0)
    plan2 = build_plan([random_trace("q0", rng, geometry=two, num_tokens=6, prompt_len=2)], two)
    with pytest.raises(ValueError):
        replay(routers, plan2)
    assert all(r.router_replay.router_replay_action is None for r in routers)
