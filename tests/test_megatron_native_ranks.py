"""megatron_native side by side with the project's path across two gloo ranks (one spawn serves every
case; tests/megatron_native_worker.py): EP = 2 with the all-to-all dispatcher (fp32 and bf16, activation
recompute on and off), PP = 2 with two virtual stages per rank, and verl 0.9.1's own Megatron R3
helpers (its router patch, its route packing, its positional and model-scoped router lookup) fed the
project's traces. Each figure here is what benchmarks/megatron_native.py reports for world size 2.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from .megatron_native_worker import run

    return run(tmp_path_factory.mktemp("native_ranks"))


def test_ep2_native_and_project_are_bit_identical(ranks):
    """Each EP rank replays its own micro-batches ([9, 3] / [11, 2] shapes, two each) forward and
    backward: logits and every gradient, routers' included, equal bit for bit on both paths, in fp32
    and bf16, with and without recompute; the routes were forced (free routing moves the logits)."""
    for rank in ranks:
        assert set(rank["ep2"]) == {"fp32_no_recompute", "fp32_recompute", "bf16_no_recompute", "bf16_recompute"}
        for name, r in rank["ep2"].items():
            assert r["native_vs_project_max_abs_diff"] == 0.0, (name, r)
            assert r["native_grad_max_abs_diff"] == 0.0 and r["all_grads_equal"] and r["router_grads"] == 2, (name, r)
            assert r["native_forces"], (name, r)
    assert ranks[0]["ep2"]["fp32_no_recompute"]["shapes"] != ranks[1]["ep2"]["fp32_no_recompute"]["shapes"]


def test_vpp_chunks_map_to_their_global_layers_on_both_paths(ranks):
    """PP = 2 x VPP = 2: each chunk's routers carry their global layer ids (Megatron's offsets), the
    native path addresses Megatron's one list across both chunks per chunk forward, and its outputs
    equal the project's bit for bit in Megatron's interleaved order (each router checked to route
    exactly its micro-batch's ids)."""
    assert [r["vpp"]["chunk_layers"] for r in ranks] == [[[0], [5]], [[2, 3], [7]]]
    for r in ranks:
        assert r["vpp"]["native_vs_project_max_abs_diff"] == 0.0


def test_verl_r3_helpers_take_the_projects_traces(ranks):
    """After verl's `apply_router_replay_patch` (its RouterReplay class and routing on every TopKRouter):
    verl's `set_router_replay_data` given the project's routes hands every router its own layer's ids
    in verl's packed order, through its model-scoped and its positional lookup (whose list per VPP
    chunk is that chunk's routers); verl's R3 alignment and mask take `routed_experts(traces)` and
    replay every routed row; and the native path over verl's registry gives the vpp outputs bit for bit."""
    for r in ranks:
        v = r["verl"]
        assert v["routing_owner"] == "verl.utils.megatron.router_replay_patch"
        assert v["registry"] == len([lid for chunk in r["vpp"]["chunk_layers"] for lid in chunk])
        for lookup in ("model", "positional"):
            assert v["lookups"][lookup] == {"mismatched_layers": [], "positional_list_is_chunk_routers": True}, lookup
        assert v["r3_nested"]["mismatched_layers"] == [] and v["r3_nested"]["replayed_rows"] == v["r3_nested"]["routed_rows"]
        assert v["native_vs_vpp_native_max_abs_diff"] == 0.0
