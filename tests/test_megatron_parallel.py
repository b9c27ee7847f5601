"""Megatron-core replay across processes (gloo, CPU). Tensor + sequence parallelism (TP=2): each TP
rank's routers see their slice of every sequence ([S / 2, B, H]), replay hands each rank the same
slice of the plan's routes, and every rank's routing and gate weights equal a one-process replay
of the whole sequence, sliced. Expert parallelism (EP=2) on GPTModels with the allgather dispatcher
and with the all-to-all one (tests/megatron_ep_worker.py), and pipeline parallelism (PP=2 through
Megatron's own schedule, tests/megatron_pp_worker.py). Context parallelism (CP=2, real TopKRouters
in a CP group) is refused by name before any forward. Under TP + SP the native path
(`trainer_path: megatron_native`) gives each rank's routers the same slices as the project's path.

Real `TopKRouter`s in a real TP group (Megatron's parallel_state on gloo). A whole GPTModel does not
build with sequence parallelism on CPU: Megatron-core 0.16's non-TE norm asserts
`not config.sequence_parallel`, and Transformer Engine needs a GPU. The workers apply the CPU shims
tests/test_megatron_replay.py's fixture sets, in their own processes.
Legend: B batch rows, S padded length, M positions, K top-k, E experts, H hidden.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from . import megatron_gloo as gloo

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

H, LAYERS = 16, (1, 3)


def _routers(tp: int) -> list[torch.nn.Module]:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=4, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=8,
                            moe_router_topk=2, moe_enable_routing_replay=True, use_cpu_initialization=True,
                            moe_router_dtype="fp32", add_bias_linear=False, moe_token_dispatcher_type="allgather",
                            moe_router_score_function="softmax", moe_router_pre_softmax=True,
                            tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    torch.manual_seed(0)
    routers = []
    for lid in LAYERS:
        r = TopKRouter(cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        r.set_layer_number(lid + 1)
        with torch.no_grad():
            r.weight.normal_(0, 0.5)  # the same weights on every rank and in the reference
        routers.append(r)
    return routers


class _Stack(torch.nn.Module):
    """Routers as the layers of one model chunk (a whole GPTModel does not build with SP on CPU)."""

    def __init__(self, routers) -> None:
        super().__init__()
        self.routers = torch.nn.ModuleList(routers)

    def forward(self, x_SBH: torch.Tensor) -> list:
        return [r(x_SBH) for r in self.routers]


def _worker(rank: int, world: int, init: str, plan, x_SBH: torch.Tensor, out: dict, odd=None) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from moe_replay.integrations.megatron import open_replay, replay

    gloo.cpu_shims()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(world, 1)
    try:
        routers = _routers(world)
        rows = x_SBH.shape[0] // world
        mine_SBH = x_SBH[rank * rows:(rank + 1) * rows]  # what sequence parallelism hands this rank
        with torch.no_grad(), replay(routers, plan) as session:
            results = [r(mine_SBH) for r in routers]
        out[rank] = {lid: (probs.clone(), routing_map.clone(), session.ids_MK[0][lid].clone())
                     for lid, (probs, routing_map) in zip(LAYERS, results)}
        stack = _Stack(routers)  # the native path hooks a model's forward: the routers as one chunk
        with torch.no_grad(), open_replay(stack, plan, path="megatron_native") as native:
            native_results = stack(mine_SBH)
        out[f"native{rank}"] = (native.layout.layer_at, all(
            torch.equal(p, q) and torch.equal(m, n) for (p, m), (q, n) in zip(native_results, results)))
        if odd is not None:  # a length the TP size does not divide: refused before any forward
            try:
                replay(routers, odd)
            except Exception as e:
                out[f"odd{rank}"] = f"{type(e).__name__}: {e}"
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_sequence_parallel_replay_equals_one_process_sliced(tmp_path):
    import torch.multiprocessing as mp

    from moe_replay.geometry import ModelGeometry
    from moe_replay.replay import PlanConfig, build_plan

    from .trace_factory import random_trace

    geometry = ModelGeometry(num_layers=4, moe_layer_ids=LAYERS, num_experts=8, top_k=2, vocab_size=512, family="megatron")
    rng = np.random.default_rng(0)
    traces = [random_trace(f"q{i}", rng, geometry=geometry, num_tokens=n, prompt_len=2) for i, n in enumerate((11, 6, 9))]
    plan = build_plan(traces, geometry, config=PlanConfig(pad_to_multiple_of=2))
    S, B = plan.seq_len, plan.batch_size
    x_SBH = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    ref, out = mp.Manager().dict(), mp.Manager().dict()
    mp.spawn(_worker, args=(1, f"file://{tmp_path}/init1", plan, x_SBH, ref), nprocs=1, join=True)
    odd = build_plan(traces[:2], geometry)  # 11 positions
    assert odd.seq_len % 2 == 1
    mp.spawn(_worker, args=(2, f"file://{tmp_path}/init2", plan, x_SBH, out, odd), nprocs=2, join=True)
    for rank in (0, 1):
        assert out[f"odd{rank}"].startswith("RouteConsumptionError") and "multiple of 2" in out[f"odd{rank}"]
        # Megatron's global RouterReplay API (set_replay_data over this rank's list) routes and weighs alike
        assert out[f"native{rank}"] == ({0: 1, 1: 3}, True)
    half = S // 2 * B
    for rank in (0, 1):
        for lid in LAYERS:
            probs, map_ME, ids_MK = out[rank][lid]
            want_probs, want_map, want_ids = (t[rank * half:(rank + 1) * half] for t in ref[0][lid])
            assert torch.equal(ids_MK, want_ids)  # this rank's half of the plan's routes
            assert torch.equal(map_ME, want_map)  # routed exactly as the one-process replay, flips 0
            assert torch.equal(map_ME, torch.zeros_like(map_ME).scatter(1, ids_MK, True))
            assert (probs - want_probs).abs().max().item() <= 2e-5



def _ep_worker(rank: int, world: int, init: str, plans, out: dict) -> None:
    """One rank of a GPTModel with its experts split over `world` expert-parallel ranks (allgather
    dispatcher), replaying its own micro-batch, given as the model and as Megatron-LM's chunk list
    ([model], what `get_model` returns; several chunks under virtual pipeline). The group is
    "cpu:gloo": its only backend serves CPU, as NCCL's serves CUDA only, so the shape check's
    all_gather runs on the group's own device (`collective_device`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_replay.integrations.megatron import find_routers, megatron_inputs, replay

    gloo.cpu_shims()
    dist.init_process_group("cpu:gloo", init_method=init, rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    mrandom.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
    try:
        cfg = TransformerConfig(num_layers=4, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, moe_ffn_hidden_size=32,
                                num_moe_experts=8, moe_router_topk=2, moe_enable_routing_replay=True,
                                moe_layer_freq=[0, 1, 0, 1], use_cpu_initialization=True, moe_router_dtype="fp32",
                                add_bias_linear=False, moe_token_dispatcher_type="allgather", expert_model_parallel_size=world)
        torch.manual_seed(0)
        model = GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False), vocab_size=512,
                         max_sequence_length=64).eval()
        maps = {}

        def keep(lid):
            def hook(module, args, output) -> None:
                maps.setdefault(lid, output[1].clone())
            return hook

        handles = [site.module.register_forward_hook(keep(lid)) for lid, site in find_routers(model).items()]
        plan = plans[rank]
        for form, target in (("model", model), ("chunks", [model])):
            maps.clear()
            try:
                with torch.no_grad(), replay(target, plan) as session:
                    logits = model(**megatron_inputs(plan))
                out[f"{form}{rank}"] = ("ok", bool(torch.isfinite(logits).all()),
                                        all(torch.equal(maps[lid], torch.zeros_like(maps[lid]).scatter(1, session.ids_MK[0][lid], True))
                                            for lid in maps))
            except Exception as e:  # noqa: BLE001  (the refusal is the result under test)
                out[f"{form}{rank}"] = ("error", f"{type(e).__name__}: {e}", bool(maps))
        for h in handles:
            h.remove()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_allgather_expert_parallel_unequal_shapes_refused_equal_shapes_replayed(tmp_path):
    """Megatron's allgather dispatcher gathers the EP ranks' tokens as equal shapes; ranks with
    different micro-batch shapes abort the process inside gloo. Replay compares the shapes before
    any forward and refuses by name on every rank, for a model and for a chunk list alike; equal
    shapes replay with flips 0."""
    import torch.multiprocessing as mp

    from moe_replay.geometry import ModelGeometry
    from moe_replay.replay import build_plan

    from .trace_factory import random_trace

    geometry = ModelGeometry(num_layers=4, moe_layer_ids=LAYERS, num_experts=8, top_k=2, vocab_size=512, family="megatron")
    rng = np.random.default_rng(0)
    t = [random_trace(f"q{i}", rng, geometry=geometry, num_tokens=n, prompt_len=2) for i, n in enumerate((11, 6, 9, 7, 11, 5))]
    unequal = [build_plan(t[0:2], geometry), build_plan(t[2:4], geometry)]  # [11, 2] and [9, 2]
    equal = [build_plan(t[0:2], geometry), build_plan(t[4:6], geometry)]  # both [11, 2]
    out = mp.Manager().dict()
    mp.spawn(_ep_worker, args=(2, f"file://{tmp_path}/ep1", unequal, out), nprocs=2, join=True)
    for key in ("model0", "model1", "chunks0", "chunks1"):
        status, message, forwarded = out[key]
        assert status == "error" and message.startswith("UnsupportedRouterError") and not forwarded, (key, out[key])
        assert "expected every rank's micro-batches to have one [S, B] shape" in message and "[[11, 2]]" in message
    out = mp.Manager().dict()
    mp.spawn(_ep_worker, args=(2, f"file://{tmp_path}/ep2", equal, out), nprocs=2, join=True)
    for key in ("model0", "model1", "chunks0", "chunks1"):
        assert out[key] == ("ok", True, True), (key, out[key])  # finite logits; every router routed exactly its plan's ids


def test_pipeline_parallel_stages_replay_their_layers_and_match_one_process(tmp_path):
    """PP=2 through Megatron's own schedule (`get_forward_backward_func`, forward_only, 2 micro-batches,
    P2PCommunicator over gloo): each stage builds its half of a GPTModel from the reference weights and
    replays with `partial=True`. Each stage routes exactly the recorded experts for its own MoE layer
    (flips 0, ids equal to the one-process replay's) and accounts for that layer alone; the last
    stage's logits equal a one-process replay of the whole model (fp32, max |diff| <= 2e-5; measured
    0.0 on CPU), while free routing moves them by 4e-2, so routes that were not replayed would fail
    this. Each stage reads its traces from a store with its own layer's routes only and plans that
    layer alone (#48). Set-up and CPU shims: tests/megatron_pp_worker.py."""
    from .megatron_pp_worker import run_pp2

    r = run_pp2(tmp_path)
    ref, (first, last) = r["reference"], r["stages"]
    assert first["layers"] == (1,) and last["layers"] == (3,)  # one MoE layer per stage, global ids
    for stage in (first, last):
        (lid,) = stage["layers"]
        assert stage["calls"] == {lid: 2}  # one router call per micro-batch
        assert stage["forward_takes"] == [{lid: 1}, {lid: 1}]  # each stage accounts for its own layer only
        assert stage["flips"] == 0
        for m in (0, 1):
            assert torch.equal(stage["ids"][m][lid], ref["ids"][m][lid])
    assert ref["flips"] == 0 and r["replay_vs_free_logit_diff"] > 1e-3
    assert first["logits"] == [] and len(last["logits"]) == 2
    # each stage read its own layer's routes from the store (of each route chunk, that layer's bytes: the two
    # stages' reads partition what a reader of both layers reads) and planned that layer alone
    assert first["plan_layers"] == [(1,)] * 2 and last["plan_layers"] == [(3,)] * 2
    assert 0 < first["route_bytes"] < r["store_route_bytes"] and first["route_bytes"] + last["route_bytes"] == r["store_route_bytes"]
    for got, want in zip(last["logits"], ref["logits"]):
        assert got.shape == want.shape == (3, 12, 512)
    assert r["max_abs_logit_diff"] <= 2e-5, r["max_abs_logit_diff"]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_alltoall_expert_parallel_unequal_shapes_replay_and_match_one_process(tmp_path, bf16):
    """EP=2 with Megatron's all-to-all dispatcher (`moe_token_dispatcher_type="alltoall"`, gloo's
    `all_to_all_single` with split sizes), the two ranks replaying micro-batches of different shapes
    ([11, 2] and [9, 2]): each rank holds 4 of the 8 experts, every router routes exactly its plan's
    ids (flips 0), and each rank's logits equal a one-process replay of its own micro-batch with the
    same weights (fp32, max |diff| <= 2e-5; measured 0.0 on CPU), while free routing moves them by
    3.8e-2, so routes that were not replayed, or experts that ran on the wrong rank's weights, would
    fail this. With bf16 parameters (Float16Module) the EP ranks' logits equal the one-process replay
    bit for bit. Set-up and CPU shims: tests/megatron_ep_worker.py."""
    from .megatron_ep_worker import run_ep2_alltoall

    r = run_ep2_alltoall(tmp_path, bf16)
    assert {x["param_dtype"] for x in r["ranks"]} == {"torch.bfloat16" if bf16 else "torch.float32"}
    assert r["shapes"] == [[11, 2], [9, 2]]
    ranks = r["ranks"]
    assert [x["local_experts"] for x in ranks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for rank, x in enumerate(ranks):
        assert x["dispatcher"] == "MoEAlltoAllTokenDispatcher"
        assert x["layers"] == LAYERS and x["calls"] == {lid: 1 for lid in LAYERS}
        assert x["flips"] == 0
        for lid in LAYERS:
            assert torch.equal(x["ids"][lid], r["reference"]["ids"][rank][lid])
        assert x["logits"].shape == (2, r["shapes"][rank][0], 512)
    assert r["reference_flips"] == 0 and r["replay_vs_free_logit_diff"] > 1e-3
    assert r["max_abs_logit_diff"] <= 2e-5, r["max_abs_logit_diff"]
    if bf16:
        assert r["max_abs_logit_diff"] == 0.0, r["max_abs_logit_diff"]


def test_allgather_expert_parallel_equal_shapes_match_one_process(tmp_path):
    """EP=2 with the allgather dispatcher on equal micro-batch shapes ([11, 2] on both ranks): every
    router routes exactly its plan's ids (flips 0) and each rank's logits equal a one-process replay of
    its own micro-batch with the same weights (fp32, <= 2e-5), while free routing moves them, so
    routes not replayed or experts run on the wrong rank's weights would fail this."""
    from .megatron_ep_worker import run_ep2_alltoall

    r = run_ep2_alltoall(tmp_path, dispatcher="allgather")
    assert r["shapes"] == [[11, 2], [11, 2]]
    for x in r["ranks"]:
        assert x["dispatcher"] == "MoEAllGatherTokenDispatcher"
        assert x["layers"] == LAYERS and x["calls"] == {lid: 1 for lid in LAYERS}
        assert x["flips"] == 0
    assert r["reference_flips"] == 0 and r["replay_vs_free_logit_diff"] > 1e-3
    assert r["max_abs_logit_diff"] <= 2e-5, r["max_abs_logit_diff"]


def _cp_worker(rank: int, world: int, init: str, plan, out: dict) -> None:
    """One rank of a context-parallel group of `world`: real TopKRouters in it, then replay."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_replay.integrations.megatron import replay

    gloo.init(rank, world, init, cp=world)
    try:
        cfg = TransformerConfig(num_layers=4, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=8,
                                moe_router_topk=2, moe_enable_routing_replay=True, use_cpu_initialization=True,
                                moe_router_dtype="fp32", add_bias_linear=False, moe_layer_freq=[0, 1, 0, 1],
                                context_parallel_size=world)
        try:  # a whole GPTModel first: on CPU, Megatron-core 0.16 refuses CP without Transformer Engine
            GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False), vocab_size=512, max_sequence_length=64)
            out[f"gpt{rank}"] = "built"
        except AssertionError as e:
            out[f"gpt{rank}"] = str(e)
        routers = []
        for lid in LAYERS:
            r = TopKRouter(cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
            r.set_layer_number(lid + 1)
            routers.append(r)
        calls = []
        for r in routers:
            r.register_forward_pre_hook(lambda m, a: calls.append(m.layer_number))
        try:
            with replay(routers, plan):
                for r in routers:
                    r(torch.zeros(plan.seq_len // world, plan.batch_size, H))
            out[rank] = ("replayed", routers[0].cp_group.size(), len(calls))
        except Exception as e:  # noqa: BLE001  (the refusal is the result under test)
            rr = routers[0].router_replay
            out[rank] = (f"{type(e).__name__}: {e}", routers[0].cp_group.size(), len(calls),
                         rr.router_replay_action, rr.target_topk_idx, len(rr.replay_backward_list))
    finally:
        gloo.close()


def test_context_parallel_refused_by_name_before_any_forward(tmp_path):
    """context_parallel_size=2 over 2 gloo processes, real TopKRouters in Megatron's CP group: replay
    refuses on every rank before any router runs (UnsupportedRouterError naming
    context_parallel_size=2; no router call, RouterReplay left untouched). Under CP each rank holds
    2 of the sequence's 4 chunks, reordered for load balance, which the plan's [S, B] routes are not
    laid out for. A whole GPTModel does not build with CP on CPU: Megatron-core 0.16's non-TE
    DotProductAttention asserts context_parallel_size == 1, and Transformer Engine needs a GPU."""
    import torch.multiprocessing as mp

    from moe_replay.geometry import ModelGeometry
    from moe_replay.replay import build_plan

    from .trace_factory import random_trace

    geometry = ModelGeometry(num_layers=4, moe_layer_ids=LAYERS, num_experts=8, top_k=2, vocab_size=512, family="megatron")
    rng = np.random.default_rng(0)
    plan = build_plan([random_trace(f"q{i}", rng, geometry=geometry, num_tokens=n, prompt_len=2) for i, n in enumerate((12, 7))],
                      geometry)
    out = mp.Manager().dict()
    mp.spawn(_cp_worker, args=(2, f"file://{tmp_path}/cp2", plan, out), nprocs=2, join=True)
    for rank in (0, 1):
        message, cp, calls, *state = out[rank]
        assert cp == 2  # the routers really sit in a 2-rank CP group
        assert message.startswith("UnsupportedRouterError") and "context_parallel_size=2 " in message, message
        assert calls == 0 and state == [None, None, 0]  # before any forward, RouterReplay untouched
        gpt = out[f"gpt{rank}"]
        assert gpt == "built" or "only supported by TEDotProductAttention" in gpt, gpt
