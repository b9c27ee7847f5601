"""HF replay on FSDP2-sharded models, as verl's FSDP2 actor shards them before moe_replay attaches.

`fully_shard` on each decoder layer and the root over 2 gloo ranks (each rank holds half of each router
matrix), then attach, self-replay bit for bit, other routes change the output, backward: the coverage
table's fsdp2 rows re-run (coverage.run_fsdp2, one spawn for all families). Around them: attach verifies the
rule in the dtype the forward gathers the parameters in and leaves them sharded; a rule that holds at attach
but not in the forward's autocast is refused on the first forward before any output; DTensor parameters no
FSDP2 module gathers are refused by name; `fsdp2_replay_check` (the GPU entry point) answers on gloo.
"""

from __future__ import annotations

import os

import pytest
import torch

from moe_replay.integrations.hf import coverage

from .test_hf_coverage import PRECISION_SENSITIVE, mode_dependent, table_row

pytestmark = [pytest.mark.hf, pytest.mark.slow]  # each spawns 2 ranks: 1-5 min on 2 shared cores

FSDP_MODES = [p for p, m in coverage.PRECISIONS.items() if m.layout == "fsdp2"]
QUICK = ("glm4_moe_lite", "mellum", "solar_open", "deepseek_v3")
"""Inferred rules refused on FSDP2 at world size 1 and 2 before attach gathered the shards, and a registered
rule: the first fsdp2 rows re-run."""


def _check(families):
    """Every family in every FSDP2 mode gets the status the table gives it there (replayed, or HF's own forward
    failing in that mode), and a replayed one the rule the table names for it there."""
    rows = {(m, f): table_row(f, m) for m in FSDP_MODES for f in families}
    results = coverage.run_fsdp2({f: rows[(FSDP_MODES[0], f)].config for f in families}, FSDP_MODES)
    got = {(m, r.family): r for m, rs in results.items() for r in rs}
    assert set(got) == set(rows), sorted(set(rows) ^ set(got))
    differ = {k: (r.status, r.reason, rows[k].status) for k, r in got.items() if r.status != rows[k].status}
    assert not differ, differ
    rules = {k: (r.rule, rows[k].rule) for k, r in got.items() if r.status == "replayed" and r.rule != rows[k].rule}
    assert not rules, rules


def test_inferred_and_registered_rules_replay_on_fsdp2_world_size_2():
    _check(QUICK)


def test_every_mode_dependent_family_replays_on_fsdp2():
    """The families whose rule or arithmetic changes with the precision (test_hf_coverage's set), in both FSDP2
    modes: ~5 s a family and mode on 2 ranks."""
    _check(sorted((set(mode_dependent()) | set(PRECISION_SENSITIVE)) - set(QUICK)))


# -- attach, refusal and the GPU entry point, in one spawn of 2 ranks --------------------------------------
def _ranks(rank: int, world: int, init: str, out: dict) -> None:
    import warnings
    from dataclasses import replace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from moe_replay.integrations.hf import find_routers, infer, model_geometry, replay, routers
    from moe_replay.integrations.hf.fsdp import is_sharded
    from moe_replay.replay import UnsupportedRouterError, build_plan

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    fams = {f: coverage.moe_families()[f] for f in ("glm4_moe", "deepseek_v3", "mellum")}
    res: dict = {}
    try:
        # attach verifies in the forward's context (bf16 params gathered by FSDP2), and leaves the shards sharded
        model = coverage.fsdp2_shard(coverage.build_tiny("glm4_moe", fams), torch.bfloat16)
        sites = find_routers(model)
        res["keys"] = sorted({k for s in sites.values() for k in infer._VERIFIED[s.module]}, key=str)
        res["sharded_after_attach"] = all(is_sharded(s.module.weight) for s in sites.values())
        res["inferred"] = {type(s.adapter).__name__ for s in sites.values()}
        probes = []
        real = infer._probe
        infer._probe = lambda *a, **k: probes.append(a[1]) or real(*a, **k)
        try:
            geometry = model_geometry(model, sites)
            plan = build_plan(coverage._traces(model, geometry), geometry)
            with torch.no_grad(), replay(model, plan) as session:
                model(**session.model_inputs())
        finally:
            infer._probe = real
        res["probes_in_forward"] = len(probes)

        # a registered rule that holds at attach (fp32) but not under the forward's bf16 autocast
        registered = routers.ROUTER_ADAPTERS.get("deepseek_v3")
        saved = routers._DISPATCH_ORDER
        routers._DISPATCH_ORDER = [replace(registered, upcast=True) if a is registered else a for a in saved]
        try:
            model = coverage.fsdp2_shard(coverage.build_tiny("deepseek_v3", fams))
            geometry = model_geometry(model)
            plan = build_plan(coverage._traces(model, geometry), geometry)
            outputs = []
            model.register_forward_hook(lambda *a: outputs.append(1))
            session = replay(model, plan)
            try:
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), session:
                    model(**session.model_inputs())
                res["autocast_refusal"] = None
            except UnsupportedRouterError as e:
                res["autocast_refusal"] = str(e)
            res["outputs_before_refusal"] = len(outputs)
        finally:
            routers._DISPATCH_ORDER = saved

        # DTensor router weights that no FSDP2 module gathers (a tensor-parallel layout): refused by name
        model = coverage.build_tiny("mellum", fams)
        mesh = init_device_mesh("cpu", (world,))
        router = next(m for m in model.modules() if infer.looks_like_router(m))
        router.weight = torch.nn.Parameter(distribute_tensor(router.weight.data, mesh, [Shard(0)]))
        try:
            find_routers(model)
            res["tp_refusal"] = None
        except UnsupportedRouterError as e:
            res["tp_refusal"] = str(e)

        res["check"] = {m: coverage.fsdp2_replay_check("glm4_moe", "cpu", m, fams) for m in FSDP_MODES}
    finally:
        out[rank] = res
        dist.destroy_process_group()
    coverage.leave_dtensor_rank()


def spawn_ranks(target, work, world: int = 2) -> dict:
    """`target(rank, world, init, out)` on `world` gloo ranks rendezvousing in the folder `work`; `out[rank]`
    of each."""
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    mp.spawn(target, args=(world, f"file://{work}/init", out), nprocs=world, join=True)
    return dict(out)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_ranks, tmp_path_factory.mktemp("fsdp"))


def test_attach_verifies_in_the_forwards_gathered_dtype_and_leaves_shards_sharded(ranks):
    """glm4_moe (an inferred rule) under a bf16 param policy: attach gathers the fp32 shards as the forward does
    (bf16) and verifies there, so the first forward probes nothing more; the shards are sharded again after."""
    for res in ranks.values():
        assert res["inferred"] == {"InferredAdapter"}
        assert res["keys"] == [(torch.bfloat16, torch.bfloat16, "cpu", None)]
        assert res["sharded_after_attach"] and res["probes_in_forward"] == 0


def test_rule_refused_on_the_first_sharded_forward_before_any_output(ranks):
    for res in ranks.values():
        assert res["autocast_refusal"] and "bfloat16 autocast" in res["autocast_refusal"], res["autocast_refusal"]
        assert "registered rule" in res["autocast_refusal"] and res["outputs_before_refusal"] == 0


def test_dtensors_no_fsdp2_module_gathers_are_refused_by_name(ranks):
    for res in ranks.values():
        assert res["tp_refusal"] and "mellum: router 'model.layers.0.mlp.gate" in res["tp_refusal"]
        assert "no FSDP2 module" in res["tp_refusal"], res["tp_refusal"]


def test_fsdp2_replay_check_answers_on_gloo(ranks):
    """The GPU entry point on CPU: bit-identical self-replay, every route where it belongs, on both ranks."""
    for res in ranks.values():
        for mode, check in res["check"].items():
            assert check["refused"] is None and check["world_size"] == 2, check
            assert check["bit_identical"] and check["max_abs_logit_diff"] == 0.0 and check["flips"] == 0, check
            assert check["routed_positions"] > 0 and "sigmoid_bias_group" in check["rule"], check
    assert ranks[0]["check"] == ranks[1]["check"]
