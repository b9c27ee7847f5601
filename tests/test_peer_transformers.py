"""transformers' MoE routing capture/replay test assertions, ported to this project's HF replay.

Source: huggingface/transformers, tests/models/qwen2_moe/test_modeling_qwen2_moe.py (the
`output_moe_routing` / `moe_routing` tests of Qwen2MoeModelTest). transformers records the selected
experts of every MoE layer with `output_moe_routing=True` and forces them with `moe_routing=...`;
here the same roles are `capture_routes` (the model's own top-k per layer) and `replay` (the
recorded ids forced, gate weights recomputed from the model's own router). The model is the
project's tiny Qwen2-MoE checkpoint (built locally by the `tiny_model` fixture, loaded with
`from_pretrained`), fed transformers' input ids `[[1, 2, 3, 4], [4, 3, 2, 1]]`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from moe_replay.errors import GeometryMismatchError, TraceFormatError
from moe_replay.geometry import ModelGeometry
from moe_replay.integrations.hf import capture_routes, find_routers, model_geometry, replay, self_routed_trace
from moe_replay.replay import build_plan

pytestmark = pytest.mark.hf

INPUT_IDS = [[1, 2, 3, 4], [4, 3, 2, 1]]


@pytest.fixture(scope="module")
def qwen2_moe(tiny_model):
    """A fresh fp32 instance of the tiny Qwen2-MoE (this module negates its routers: not shared)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model("qwen2_moe"), dtype=torch.float32).eval()


def _recorded_traces(model) -> list:
    """One trace per row of INPUT_IDS whose routes are the model's own (recorded) top-k."""
    return [self_routed_trace(model, np.asarray(row), 1, f"row-{i}") for i, row in enumerate(INPUT_IDS)]


def test_moe_routing_is_exposed_per_layer(qwen2_moe):
    """transformers test_moe_routing_is_exposed_via_output_capture: one selected-experts tensor per
    MoE layer, each of shape (batch * seq_len, num_experts_per_tok)."""
    model, geom = qwen2_moe, model_geometry(qwen2_moe)
    ids = torch.tensor(INPUT_IDS)
    with torch.no_grad(), capture_routes(model) as routes:
        model(input_ids=ids)
    assert sorted(routes) == list(geom.moe_layer_ids)
    assert len(routes) == sum(1 for _ in find_routers(model))
    for lid in geom.moe_layer_ids:
        assert tuple(routes[lid].shape) == (ids.numel(), model.config.num_experts_per_tok)
        assert int(routes[lid].min()) >= 0 and int(routes[lid].max()) < model.config.num_experts


def test_replay_forces_recorded_experts_after_gates_are_negated(qwen2_moe):
    """transformers test_moe_routing_replays_selected_experts: record routes, negate every
    router's gate weight; natural routing now differs from the recording on some layer, and a
    replayed forward uses exactly the recorded experts on every layer (as tensors, column order
    included). Here the replayed ids are read from what the experts received
    (`record_routes=True`); the model's weights are restored afterwards."""
    model = qwen2_moe
    geom = model_geometry(model)
    traces = _recorded_traces(model)
    with torch.no_grad(), capture_routes(model) as recorded:
        model(input_ids=torch.tensor(INPUT_IDS))
    routers = find_routers(model)
    with torch.no_grad():
        for site in routers.values():
            site.module.weight.mul_(-1.0)
    try:
        with torch.no_grad(), capture_routes(model) as natural:
            model(input_ids=torch.tensor(INPUT_IDS))
        assert any(not torch.equal(natural[lid], recorded[lid]) for lid in geom.moe_layer_ids)
        plan = build_plan(traces, geom)
        with torch.no_grad(), replay(model, plan, record_routes=True, track_flips=True) as session:
            model(**session.model_inputs())
        routed_N = plan.routed_N  # every position but each row's last (never forwarded by an engine)
        S = len(INPUT_IDS[0])
        assert routed_N.view(len(INPUT_IDS), S)[:, :-1].all() and not routed_N.view(len(INPUT_IDS), S)[:, -1].any()
        for lid in geom.moe_layer_ids:
            used = session.routes.used_ids[lid]
            assert torch.equal(used[routed_N], recorded[lid][routed_N].to(used.dtype))
        assert session.flips.rate > 0  # the negated routers would have picked other experts
    finally:
        with torch.no_grad():
            for site in routers.values():
                site.module.weight.mul_(-1.0)


def test_route_shape_mismatch_fails_closed_before_any_forward(qwen2_moe):
    """transformers test_moe_routing_validation_fails_closed_on_shape_mismatch: routes with
    num_experts_per_tok + 1 columns raise ValueError ("Forced Qwen2Moe routing must match").
    Ported: a trace whose routes have K + 1 columns is refused as a TraceFormatError naming
    routes_TLK, and routes recorded for a top-(K + 1) geometry are refused by the plan as a
    GeometryMismatchError naming top_k; both are ValueErrors and no forward runs."""
    model = qwen2_moe
    geom = model_geometry(model)
    good = _recorded_traces(model)[0]
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        wide = np.zeros((good.num_route_rows, geom.num_moe_layers, geom.top_k + 1), dtype=geom.route_dtype)
        wide[..., :] = np.arange(geom.top_k + 1, dtype=geom.route_dtype)
        with pytest.raises(ValueError, match="routes_TLK") as err:
            dataclasses.replace(good, routes_TLK=wide).validate()
        assert isinstance(err.value, TraceFormatError)
        g_wide = ModelGeometry(num_layers=geom.num_layers, moe_layer_ids=geom.moe_layer_ids, num_experts=geom.num_experts,
                               top_k=geom.top_k + 1, vocab_size=geom.vocab_size, family=geom.family)
        other = dataclasses.replace(good, geometry=g_wide, routes_TLK=wide).validate()
        with pytest.raises(ValueError, match="top_k") as err:
            build_plan([other], geom)
        assert isinstance(err.value, GeometryMismatchError)
        assert not calls
    finally:
        handle.remove()
