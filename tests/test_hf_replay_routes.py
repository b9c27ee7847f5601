"""The ids the experts actually received under HF replay, as a public result of the session."""

from __future__ import annotations

import pytest
import torch

from moe_replay.integrations.hf import capture_routes, model_geometry, replay
from moe_replay.replay import PlanConfig, build_plan

from .test_hf_replay import hf_traces, tiny_hf_model


def plan_ids_NK(plan, layer_id: int) -> torch.Tensor:
    return plan.ids_LNK[plan.layer_index[layer_id]]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_sparse"])
def test_used_ids_are_the_plans_and_flips_are_counted_against_the_models_own_choice(family):
    model = tiny_hf_model(family)
    geom = model_geometry(model)
    traces = hf_traces(model, [7, 5, 9], routes="shifted")  # mostly experts the model would not pick
    plan = build_plan(traces, geom, config=PlanConfig(padding_side="left"))
    with torch.no_grad(), capture_routes(model) as free:  # the model's own routing of the same batch
        model(**plan.model_inputs())
    with torch.no_grad(), replay(model, plan, track_flips=True, record_routes=True) as session:
        model(**session.model_inputs())
    routes, routed_N = session.routes, plan.routed_N
    assert sorted(routes.used_ids) == list(geom.moe_layer_ids) and routed_N.any() and not routed_N.all()
    for lid in geom.moe_layer_ids:
        used, want = routes.used_ids[lid], plan_ids_NK(plan, lid)
        assert torch.equal(used[routed_N], want[routed_N].to(used.dtype))  # forced where recorded ...
        assert torch.equal(used[~routed_N], routes.own_ids[lid][~routed_N])  # ... the model's own elsewhere
        differ_N = torch.tensor([set(a.tolist()) != set(b.tolist()) for a, b in zip(used, routes.own_ids[lid])])
        assert torch.equal(routes.flipped_N(lid), differ_N & routed_N)
    first = geom.moe_layer_ids[0]  # before any replayed layer the model's own choice is free routing's
    assert torch.equal(routes.own_ids[first], free[first])
    flips = routes.flips()
    assert flips == session.flips.flips and flips[first] > 0.5 * int(routed_N.sum())


def test_replaying_the_models_own_routes_flips_nothing():
    model = tiny_hf_model("qwen3_moe")
    plan = build_plan(hf_traces(model, [6, 8]), model_geometry(model))
    with torch.no_grad(), replay(model, plan, record_routes=True) as session:
        model(**session.model_inputs())
    assert all(n == 0 for n in session.routes.flips().values())
    for lid, used in session.routes.used_ids.items():
        routed_N = plan.routed_N
        assert torch.equal(used[routed_N], plan_ids_NK(plan, lid)[routed_N].to(used.dtype))


def test_routes_are_not_recorded_unless_asked():
    model = tiny_hf_model("qwen3_moe")
    plan = build_plan(hf_traces(model, [6]), model_geometry(model))
    with torch.no_grad(), replay(model, plan) as session:
        model(**session.model_inputs())
    assert session.routes is None
