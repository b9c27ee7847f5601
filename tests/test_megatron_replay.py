"""Megatron-core replay on CPU with the real megatron-core: TopKRouters and a whole tiny GPTModel.

megatron-core assumes CUDA in a few places that have nothing to do with routing. Test-only shims,
set for this module and undone after it (library code has none):
  * `torch.cuda.current_device` -> "cpu": TopKRouter.gating moves its weight there, and the
    expert-bias buffers are created there;
  * `moe_utils.te_general_gemm = None`: megatron-core 0.16.1 reads this name without defining it
    when Transformer Engine is absent (NameError in RouterGatingLinearFunction);
  * Megatron's CUDA RNG state get/set -> CPU state, and the inference RNG tracker (a null fork), so
    attention and `tensor_parallel.checkpoint` (activation recompute) run on CPU.
Everything else is Megatron's own code: gating linear, topk_routing_with_score_function,
RouterReplay, MoELayer with the allgather dispatcher and SequentialMLP experts, CheckpointFunction.

Legend: B batch rows, S padded length, M = S * B sequence-first positions, K top-k, E experts, H hidden.
"""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from moe_replay.errors import GeometryMismatchError  # noqa: E402
from moe_replay.geometry import ModelGeometry  # noqa: E402
from moe_replay.integrations.megatron import find_routers, megatron_inputs, model_geometry, replay, sequence_first_ids  # noqa: E402
from moe_replay.replay import PlanConfig, RouteConsumptionError, UnsupportedRouterError, build_plan  # noqa: E402
from moe_replay.replay.ledger import in_backward  # noqa: E402

from .trace_factory import random_trace  # noqa: E402

H = 16
GEOM = ModelGeometry(num_layers=5, moe_layer_ids=(1, 3, 4), num_experts=8, top_k=2, vocab_size=512, family="megatron")
ROUTERS = {
    # name: TransformerConfig routing settings
    "softmax_after_topk": dict(moe_router_score_function="softmax", moe_router_pre_softmax=False),
    "softmax_before_topk": dict(moe_router_score_function="softmax", moe_router_pre_softmax=True, moe_router_topk_scaling_factor=1.5),
    "sigmoid_expert_bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5),
    "group_limited": dict(moe_router_score_function="softmax", moe_router_pre_softmax=True, moe_router_num_groups=4, moe_router_group_topk=2),
    # DeepSeek-V3 style: sigmoid scores, a selection-only bias and expert groups together, scaled
    "sigmoid_bias_group": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=4,
                               moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5),
}


@pytest.fixture(scope="module")
def megatron_cpu():
    """A single-process gloo group, Megatron's parallel state, and the CPU shims above."""
    import torch.distributed as dist
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import parallel_state

    if dist.is_initialized() and dist.get_world_size() != 1:
        pytest.skip("torch.distributed already runs with more than one rank")
    own_group = not dist.is_initialized()
    mp = pytest.MonkeyPatch()
    try:  # whatever fails in set-up, the shims, the group and Megatron's state are undone for later tests
        mp.setattr(torch.cuda, "current_device", lambda: "cpu")
        mp.setattr(moe_utils, "te_general_gemm", None, raising=False)
        mp.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
        mp.setattr(mrandom, "_set_cuda_rng_state", lambda *a, **k: None)
        if own_group:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        mrandom.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
        yield
    finally:
        try:
            parallel_state.destroy_model_parallel()
            if own_group and dist.is_initialized():
                dist.destroy_process_group()
        finally:
            mp.undo()


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=GEOM.num_layers, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, moe_ffn_hidden_size=32,
                num_moe_experts=GEOM.num_experts, moe_router_topk=GEOM.top_k, moe_enable_routing_replay=True,
                use_cpu_initialization=True, moe_router_dtype="fp32", add_bias_linear=False, moe_token_dispatcher_type="allgather")
    return TransformerConfig(**{**base, **kw})


def make_routers(layer_ids=GEOM.moe_layer_ids, **kw) -> list[torch.nn.Module]:
    """Real TopKRouters, created in reverse layer order (so creation order != layer order)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    torch.manual_seed(0)
    cfg, pgs = _config(**kw), ProcessGroupCollection.use_mpu_process_groups()
    routers = []
    for lid in reversed(layer_ids):
        r = TopKRouter(cfg, pg_collection=pgs)
        r.set_layer_number(lid + 1)
        with torch.no_grad():
            r.weight.normal_(0, 0.5)
            if r.expert_bias is not None:  # large selection-only bias: the free choice is mostly these experts
                r.expert_bias.copy_(torch.tensor([2.0, 1.5, 0, 0, 0, 0, 0, 0]))
        routers.append(r)
    return routers


def make_plan(geometry=GEOM, lengths=(9, 5, 7), side="right", seed=0):
    rng = np.random.default_rng(seed)
    traces = [random_trace(f"q{i}", rng, geometry=geometry, num_tokens=n, prompt_len=2) for i, n in enumerate(lengths)]
    return build_plan(traces, geometry, config=PlanConfig(padding_side=side))


def expected_probs_MK(router, x_SBH: torch.Tensor, ids_MK: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The gate weights each routing setting must give at the replayed ids, from the router's own logits."""
    logits_ME = x_SBH.reshape(-1, H).float() @ router.weight.float().t()
    scale = cfg.get("moe_router_topk_scaling_factor") or 1.0
    if cfg["moe_router_score_function"] == "sigmoid":  # bias chooses, never weighs
        s_MK = torch.sigmoid(logits_ME).gather(1, ids_MK)
        return s_MK / (s_MK.sum(-1, keepdim=True) + 1e-20) * scale
    if cfg.get("moe_router_pre_softmax"):
        return torch.softmax(logits_ME, -1).gather(1, ids_MK) * scale
    return torch.softmax(logits_ME.gather(1, ids_MK), -1) * scale


def test_import_does_not_import_megatron():
    code = "import sys, moe_replay.integrations.megatron; sys.exit(any(m.startswith('megatron') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_sequence_first_conversion():
    """[B*S] batch-major -> [S*B] sequence-first, unrouted rows get distinct valid rotating ids."""
    b, s, k, e = 2, 3, 2, 5
    ids_NK = torch.arange(b * s * k).view(b * s, k) % e
    routed_N = torch.tensor([1, 1, 0, 1, 0, 0], dtype=torch.bool)
    ids_MK = sequence_first_ids(ids_NK, routed_N, b, s, e)
    for bi in range(b):
        for si in range(s):
            n, m = bi * s + si, si * b + bi
            if routed_N[n]:
                assert torch.equal(ids_MK[m], ids_NK[n])
            else:
                assert torch.equal(ids_MK[m], (m * k + torch.arange(k)) % e)
    assert ids_MK.dtype == torch.int64 and int(ids_MK.min()) >= 0


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", list(ROUTERS))
def test_routers_replay_plan_ids(megatron_cpu, name, side):
    cfg = ROUTERS[name]
    routers = make_routers(**cfg)
    by_layer = {r.layer_number - 1: r for r in routers}
    plan = make_plan(side=side)
    b, s = plan.batch_size, plan.seq_len
    x_SBH = torch.randn(s, b, H)
    free = {}
    with torch.no_grad():  # the routers' own choice, for the flip count
        for lid, r in by_layer.items():
            free[lid] = r(x_SBH)[1]
    with replay(routers, plan) as session:
        outs = {lid: by_layer[lid](x_SBH) for lid in (4, 1, 3)}  # any call order: routes are keyed by layer id
        loss = sum((probs_ME * torch.linspace(-1, 1, GEOM.num_experts)).sum() for probs_ME, _ in outs.values())
        loss.backward()
    flips = 0
    for lid, (probs_ME, map_ME) in outs.items():
        ids_MK = session.ids_MK[0][lid]
        # the routing map is exactly the plan's ids, token by token in [S, B] order
        want_ME = torch.zeros_like(map_ME).scatter(1, ids_MK, True)
        assert torch.equal(map_ME, want_ME)
        routed_BS = plan.routed_N.view(b, s)
        for bi in range(b):
            for si in routed_BS[bi].nonzero().flatten().tolist():
                got = map_ME[si * b + bi].nonzero().flatten().tolist()
                assert got == sorted(plan.layer_ids(lid)[bi * s + si].tolist())
        # probs recomputed from Megatron's own scores at the replayed ids
        torch.testing.assert_close(probs_ME.gather(1, ids_MK), expected_probs_MK(by_layer[lid], x_SBH, ids_MK, cfg), rtol=1e-5, atol=1e-6)
        assert int((probs_ME != 0).sum()) <= int(map_ME.sum())
        flips += int((map_ME != free[lid]).any(-1).sum())
    assert flips > 0, "random traces should route differently from the routers' own choice"
    # gradient reaches every router's weight, exactly as the formula says (also at experts the router would not pick)
    for lid, r in by_layer.items():
        w = r.weight.detach().clone().requires_grad_(True)
        probs_ME = outs[lid][0]
        ids_MK = session.ids_MK[0][lid]
        proxy = type("R", (), {"weight": w})
        ref = (expected_probs_MK(proxy, x_SBH, ids_MK, cfg) * torch.linspace(-1, 1, GEOM.num_experts)[ids_MK]).sum()
        (g_ref,) = torch.autograd.grad(ref, w)
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
        torch.testing.assert_close(r.weight.grad, g_ref, rtol=1e-4, atol=1e-6)
        unpicked_E = torch.ones(GEOM.num_experts, dtype=torch.bool)
        unpicked_E[free[lid].any(0).nonzero().flatten()] = False
        replayed_unpicked = (unpicked_E & outs[lid][1].any(0)).nonzero().flatten()
        if name in ("sigmoid_expert_bias", "sigmoid_bias_group"):  # the bias keeps the free choice on experts 0, 1: others are replayed-only
            assert len(replayed_unpicked) > 0
        if len(replayed_unpicked):
            assert (r.weight.grad[replayed_unpicked].abs().sum(-1) > 0).all()
    # RouterReplay state is back to what it was (nothing set before the session)
    for r in routers:
        rr = r.router_replay
        assert rr.router_replay_action is None and rr.target_topk_idx is None and rr.replay_backward_list == []


def test_expert_bias_routes_freely_outside_replay(megatron_cpu):
    """Sanity of the fixture: the biased router prefers experts 0 and 1 on its own."""
    r = make_routers(layer_ids=(1,), **ROUTERS["sigmoid_expert_bias"])[0]
    with torch.no_grad():
        _, map_ME = r(torch.randn(6, 2, H))
    assert map_ME[:, :2].all()


def _gpt(recompute: str):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    kw = {"full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
          "moe": dict(recompute_granularity="selective", recompute_modules=["moe"]), "none": {}}[recompute]
    torch.manual_seed(0)
    cfg = _config(num_layers=4, moe_layer_freq=[0, 1, 0, 1], **kw)
    model = GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False), vocab_size=512, max_sequence_length=64)
    with torch.no_grad():
        for site in find_routers(model).values():
            site.module.weight.normal_(0, 0.5)
    return model.train()


def _watch(model):
    """Test-side forward hooks: every router call's (in backward?, routing map)."""
    calls = {lid: [] for lid in find_routers(model)}
    handles = [
        site.module.register_forward_hook(lambda m, a, out, lid=lid: calls[lid].append((in_backward(), out[1].detach().clone())))
        for lid, site in find_routers(model).items()
    ]
    return calls, handles


@pytest.mark.parametrize("recompute", ["none", "full", "moe"])
def test_gpt_model_replay_with_recompute(megatron_cpu, recompute):
    """A whole GPTModel (dense layers 0, 2; MoE layers 1, 3): forward, then backward with Megatron's
    activation recompute, both route with the plan's ids; routers get gradient."""
    model = _gpt(recompute)
    geom = model_geometry(model)
    assert geom.moe_layer_ids == (1, 3) and geom.num_layers == 4 and geom.vocab_size == 512
    plan = make_plan(geom, lengths=(11, 6, 8), side="left")
    calls, handles = _watch(model)
    try:
        with replay(model, plan) as session:
            logits_BSV = model(**megatron_inputs(plan))
            assert logits_BSV.shape == (plan.batch_size, plan.seq_len, 512)
            logits_BSV.float().logsumexp(-1).mean().backward()
    finally:
        for h in handles:
            h.remove()
    for lid, seen in calls.items():
        want_ME = torch.zeros(plan.num_positions, 8, dtype=torch.bool).scatter(1, session.ids_MK[0][lid], True)
        assert [bw for bw, _ in seen] == ([False] if recompute == "none" else [False, True])
        for _, map_ME in seen:
            assert torch.equal(map_ME, want_ME)
        assert session.ledgers[0].forward_takes[lid] == 1
        assert session.ledgers[0].recompute_takes[lid] == (0 if recompute == "none" else 1)
        r = find_routers(model)[lid].module
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
        assert r.router_replay.router_replay_action is None and r.router_replay.replay_backward_list == []


def test_gpt_model_micro_batches_fifo(megatron_cpu):
    """Two micro-batches (different shapes), forward both then backward in schedule order:
    each recompute pops its own micro-batch's ids from RouterReplay's queue."""
    model = _gpt("full")
    geom = model_geometry(model)
    plans = [make_plan(geom, lengths=(7, 4), seed=1), make_plan(geom, lengths=(5, 9, 6), side="left", seed=2)]
    calls, handles = _watch(model)
    try:
        with replay(model, plans) as session:
            losses = [model(**megatron_inputs(p)).float().logsumexp(-1).mean() for p in plans]
            for loss in losses:
                loss.backward()
    finally:
        for h in handles:
            h.remove()
    for lid, seen in calls.items():
        assert [bw for bw, _ in seen] == [False, False, True, True]
        for (_, map_ME), m in zip(seen, [0, 1, 0, 1]):
            assert torch.equal(map_ME, torch.zeros_like(map_ME).scatter(1, session.ids_MK[m][lid], True))


def test_recompute_outside_session_is_refused(megatron_cpu):
    model = _gpt("full")
    plan = make_plan(model_geometry(model))
    with pytest.raises(RouteConsumptionError, match="no recompute ran"):
        with replay(model, plan):
            model(**megatron_inputs(plan))


def test_geometry_checked_before_any_forward(megatron_cpu):
    routers = make_routers(**ROUTERS["softmax_after_topk"])
    for bad in (
        ModelGeometry(num_layers=5, moe_layer_ids=(0, 3, 4), num_experts=8, top_k=2, vocab_size=512),  # layer ids by position
        ModelGeometry(num_layers=5, moe_layer_ids=(1, 3, 4), num_experts=16, top_k=2, vocab_size=512),
        ModelGeometry(num_layers=5, moe_layer_ids=(1, 3, 4), num_experts=8, top_k=4, vocab_size=512),
        ModelGeometry(num_layers=6, moe_layer_ids=(1, 3, 4), num_experts=8, top_k=2, vocab_size=512),
    ):
        with pytest.raises(GeometryMismatchError):
            replay(routers, make_plan(bad))
    # micro-batch plans of one session: every field, family included (a Megatron model names none)
    qwen, glm = (ModelGeometry(**{**GEOM.to_dict(), "family": f}) for f in ("qwen3_moe", "glm4_moe"))
    with pytest.raises(GeometryMismatchError, match=r"geometry.family': expected 'qwen3_moe', found 'glm4_moe' "
                                                    r"\(micro-batch plans\[0\] vs plans\[1\]"):
        replay(routers, [make_plan(qwen), make_plan(glm, seed=1)])
    unknown = ModelGeometry(**{**GEOM.to_dict(), "family": ""})
    session = replay(routers, [make_plan(qwen), make_plan(unknown, seed=1)])  # created, never entered
    assert session.plans[1].geometry.family == ""  # unknown: accepted with every other field equal
    assert all(r.router_replay.router_replay_action is None for r in routers)
    # a pipeline stage holding layers 3 and 4 only
    stage = [r for r in routers if r.layer_number - 1 in (3, 4)]
    with pytest.raises(GeometryMismatchError, match="partial=True"):
        replay(stage, make_plan())
    plan = make_plan()
    with replay(stage, plan, partial=True) as session:
        for r in stage:
            r(torch.randn(plan.seq_len, plan.batch_size, H))
    assert set(session.ledgers[0].forward_takes) == {3, 4}


def test_exactly_once_errors(megatron_cpu):
    routers = make_routers(**ROUTERS["softmax_after_topk"])
    by_layer = {r.layer_number - 1: r for r in routers}
    plan = make_plan()
    x_SBH = torch.randn(plan.seq_len, plan.batch_size, H)
    with pytest.raises(RouteConsumptionError, match=r"layers \[3\].*never consumed"):  # a layer skipped
        with replay(routers, plan):
            by_layer[1](x_SBH)
            by_layer[4](x_SBH)
    with pytest.raises(RouteConsumptionError, match=r"expects \[S, B, H\]"):  # one token too many
        with replay(routers, plan):
            by_layer[1](torch.randn(plan.seq_len + 1, plan.batch_size, H))
    with pytest.raises(RouteConsumptionError, match=r"expects \[S, B, H\]"):  # batch-major hidden states
        with replay(routers, plan):
            by_layer[1](x_SBH.transpose(0, 1))
    with pytest.raises(RouteConsumptionError, match="2 of router"):  # a second forward on one plan
        with replay(routers, plan):
            by_layer[1](x_SBH)
            by_layer[1](x_SBH)
    # every failure left the routers as they were and free to use again
    for r in routers:
        assert r.router_replay.router_replay_action is None and r.router_replay.replay_backward_list == []
    with replay(routers, plan):
        with pytest.raises(RouteConsumptionError, match="do not nest"):
            with replay(routers, plan):
                pass
        for r in routers:
            r(x_SBH)


def test_previous_router_replay_state_restored(megatron_cpu):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = make_routers(**ROUTERS["softmax_after_topk"])
    plan = make_plan()
    before = torch.zeros(4, 2, dtype=torch.long)
    for r in routers:
        r.router_replay.set_target_indices(before)
        r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    with replay(routers, plan):
        for r in routers:
            assert r.router_replay.router_replay_action is RouterReplayAction.REPLAY_FORWARD
            r(torch.randn(plan.seq_len, plan.batch_size, H))
    for r in routers:
        rr = r.router_replay
        assert rr.router_replay_action is RouterReplayAction.RECORD
        assert rr.target_topk_idx is before and len(rr.replay_backward_list) == 1 and rr.replay_backward_list[0] is before


def test_unsupported_router_settings(megatron_cpu):
    plan = make_plan()
    replay(make_routers(moe_enable_routing_replay=False), plan)  # accepted: the session lends a RouterReplay (test_megatron_native.py)
    with pytest.raises(UnsupportedRouterError, match="moe_expert_capacity_factor"):
        replay(make_routers(moe_expert_capacity_factor=1.0), plan)
    # DeepEP / HybridEP fused dispatch: never run under replay here (GPU only), refused by name at attach
    flex = make_routers(moe_token_dispatcher_type="flex")
    with pytest.raises(UnsupportedRouterError, match=r"moe_token_dispatcher_type='flex' is not one replay was run and "
                                                     r"checked with \(expected one of \['allgather', 'alltoall'\]\)"):
        replay(flex, plan)
    assert all(not r._forward_pre_hooks and r.router_replay.router_replay_action is None for r in flex)
    replay(make_routers(moe_token_dispatcher_type="alltoall"), plan)  # accepted: the checks run on creation


def test_silent_skip_paths_are_refused_by_name(megatron_cpu):
    """Paths where Megatron would route without RouterReplay, or weigh replayed ids wrongly, fail before any forward."""
    from megatron.core.transformer.moe.router import TopKRouter

    plan = make_plan()
    routers = make_routers()
    routers[0].config.moe_router_fusion = True  # TE's fused top-k returns before RouterReplay is consulted
    with pytest.raises(UnsupportedRouterError, match="moe_router_fusion=True .*returns before RouterReplay"):
        replay(routers, plan)
    with pytest.raises(UnsupportedRouterError, match="moe_router_force_load_balancing=True .*random"):
        replay(make_routers(moe_router_force_load_balancing=True), plan)

    class OwnRouting(TopKRouter):
        def routing(self, logits, padding_mask=None):
            return super().routing(logits, padding_mask)

    routers = make_routers()
    routers[1].__class__ = OwnRouting
    with pytest.raises(UnsupportedRouterError, match="OwnRouting.routing='overridden'"):
        replay(routers, plan)
    assert all(not r._forward_pre_hooks for r in routers)  # refused before any hook went on


def test_mtp_router_never_takes_a_decoder_layer_id(megatron_cpu):
    """An MTP layer's router is numbered past the decoder stack (num_layers + k): refused by name, never re-keyed."""
    routers = make_routers()
    mtp = make_routers(layer_ids=(GEOM.num_layers,))[0]  # Megatron's first MTP layer: layer_number num_layers + 1
    with pytest.raises(UnsupportedRouterError, match="multi-token-prediction"):
        find_routers(routers + [mtp])
    with pytest.raises(UnsupportedRouterError, match="multi-token-prediction"):
        replay(routers + [mtp], make_plan())


# -- scoring Megatron logits (gathered, and vocab-parallel over two tensor-parallel ranks) ----------
def test_score_tokens_on_gpt_model_logits(megatron_cpu):
    from moe_replay.integrations.megatron import score_tokens
    from moe_replay.replay import score_tokens as score_core

    model = _gpt("none")
    plan = make_plan(model_geometry(model), lengths=(11, 6, 8))
    with replay(model, plan):
        logits_BSV = model(**megatron_inputs(plan))
        s = score_tokens(logits_BSV, plan, full=True)
        (s.logprobs_G.sum() + s.full_entropy_G.sum()).backward()
    ref = score_core(logits_BSV.detach(), plan, full=True)
    torch.testing.assert_close(s.logprobs_G, ref.logprobs_G, rtol=0, atol=0)
    torch.testing.assert_close(s.full_entropy_G, ref.full_entropy_G, rtol=0, atol=0)
    assert all(site.module.weight.grad is not None for site in find_routers(model).values())
    with pytest.raises(GeometryMismatchError, match=r"logits.shape\[-1\].*found 100"):
        score_tokens(logits_BSV.detach()[..., :100], plan)


def _tp_worker(rank: int, init: str, logits_BSV: torch.Tensor, out: dict) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from moe_replay.integrations.megatron import score_tokens

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(2, 1)
    try:
        plan = make_plan(lengths=(9, 5, 7))
        width = logits_BSV.shape[-1] // 2
        x = logits_BSV[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
        s = score_tokens(x, plan, full=True)
        (s.logprobs_G.sum() + s.entropy_G.sum() + s.full_logprobs_G.sum()).backward()
        out[rank] = (s.logprobs_G.detach(), s.full_entropy_G.detach(), x.grad)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_score_tokens_normalises_vocab_parallel_logits_across_tp_ranks(tmp_path):
    """Two TP ranks (Megatron's parallel_state on gloo), each with half of the vocabulary: both get
    the scores of the whole vocabulary; their gradients are the column halves of the gathered one."""
    import torch.multiprocessing as mp

    from moe_replay.replay import score_tokens as score_core

    plan = make_plan(lengths=(9, 5, 7))
    torch.manual_seed(0)
    logits_BSV = torch.randn(plan.batch_size, plan.seq_len, GEOM.vocab_size) * 3
    out = mp.Manager().dict()
    mp.spawn(_tp_worker, args=(f"file://{tmp_path}/init", logits_BSV, out), nprocs=2, join=True)
    x = logits_BSV.clone().requires_grad_(True)
    ref = score_core(x, plan, full=True)
    (ref.logprobs_G.sum() + ref.entropy_G.sum() + ref.full_logprobs_G.sum()).backward()
    for rank in (0, 1):
        torch.testing.assert_close(out[rank][0], ref.logprobs_G.detach(), rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(out[rank][1], ref.full_entropy_G.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(torch.cat([out[0][2], out[1][2]], -1), x.grad, rtol=1e-5, atol=1e-6)


def test_packed_sequences_refused_by_name_before_the_forward(megatron_cpu):
    """THD packed sequences (PackedSeqParams) do not line up with a plan's padded [S, B] routes.
    Replay refuses them by name with expected/found before any layer runs, on the model itself and
    on a wrapper around it (the TransformerBlock's hook); without it Megatron-core's non-TE attention
    fails on an assert first. The same session objects and model replay a padded batch afterwards."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from moe_replay.replay import BatchLayoutError

    class Wrapper(torch.nn.Module):  # takes the batch as one dict: its own hook sees no packed_seq_params
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, batch):
            return self.inner(**batch)

    model = _gpt("none").eval()
    plan = make_plan(model_geometry(model), lengths=(11, 6, 8))
    cu_seqlens = torch.tensor([0, 11, 17, 25], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=11, max_seqlen_kv=11)
    calls, handles = _watch(model)
    embedded = []
    handles.append(model.embedding.register_forward_hook(lambda *a: embedded.append(1)))
    try:
        batch = {**megatron_inputs(plan), "packed_seq_params": packed}
        for target, where in ((model, "GPTModel"), (Wrapper(model), "TransformerBlock")):
            with pytest.raises(BatchLayoutError, match=r"field 'packed_seq_params': expected None: a padded \[S, B\] batch.*"
                                                       rf"found PackedSeqParams\(qkv_format='thd', 3 sequences\) passed to {where}"):
                with torch.no_grad(), replay(target, plan):
                    target(**batch) if target is model else target(batch)
            assert all(seen == [] for seen in calls.values())  # no router ran
        assert embedded == [1]  # the model refused before its embedding; the wrapper at the decoder
        for site in find_routers(model).values():
            assert not site.module._forward_pre_hooks and site.module.router_replay.router_replay_action is None
        assert not model._forward_pre_hooks and not model.decoder._forward_pre_hooks
        with torch.no_grad(), replay(model, plan):
            model(**megatron_inputs(plan))
    finally:
        for h in handles:
            h.remove()
    assert all(len(seen) == 1 for seen in calls.values())


# -- bf16 parameters (Megatron's Float16Module, as Megatron-LM wraps a model trained with --bf16) ----
def _gpt_bf16(router: str, router_dtype: str | None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(0)
    cfg = _config(num_layers=4, moe_layer_freq=[0, 1, 0, 1], params_dtype=torch.bfloat16, bf16=True,
                  moe_router_dtype=router_dtype, **ROUTERS[router])
    model = GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False), vocab_size=512, max_sequence_length=64)
    with torch.no_grad():
        for site in find_routers(model).values():
            site.module.weight.normal_(0, 0.5)
            if site.module.expert_bias is not None:
                site.module.expert_bias.copy_(torch.tensor([2.0, 1.5, 0, 0, 0, 0, 0, 0]))
    return Float16Module(cfg, model).eval()  # bf16 parameters and activations, fp32 logits out


def _scored_pass(model, plan, session_plan=None):
    """Logits [B, S, V], scored logprobs [G] and every parameter's gradient of their sum; under replay
    of `session_plan` when given, else with the routers' own choice recorded by Megatron's RouterReplay
    (RECORD). Returns also the recorded ids {layer id: [S * B, K]} of a free pass."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from moe_replay.integrations.megatron import score_tokens

    model.zero_grad(set_to_none=True)
    sites = find_routers(model)
    if session_plan is None:
        for site in sites.values():
            site.module.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
        logits = model(**megatron_inputs(plan))
        score_tokens(logits.float(), plan).logprobs_G.sum().backward()
        own = {lid: site.module.router_replay.recorded_topk_idx.clone() for lid, site in sites.items()}
        for site in sites.values():
            site.module.router_replay.clear_router_replay_action()
            site.module.router_replay.clear_indices()
    else:
        with replay(model, session_plan):
            logits = model(**megatron_inputs(session_plan))
            score_tokens(logits.float(), session_plan).logprobs_G.sum().backward()
        own = {}
    from moe_replay.integrations.megatron import score_tokens as score

    logp_G = score(logits.detach().float(), plan).logprobs_G
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), logp_G, grads, own


def _plan_of_own_routes(traces, own, plan):
    """The traces again, each routed as the model routed it (Megatron's ids, in its own column order)."""
    s, b = plan.seq_len, plan.batch_size
    lids = plan.geometry.moe_layer_ids
    out = []
    for row, t in enumerate(traces):  # right padding: trace row `row` holds positions 0..len-1 of batch row `row`
        n = t.routes_TLK.shape[0]
        routes = np.stack([own[lid].view(s, b, -1)[:n, row].numpy() for lid in lids], 1).astype(t.routes_TLK.dtype)
        out.append(dataclasses.replace(t, routes_TLK=routes))
    return build_plan(out, plan.geometry)


@pytest.mark.parametrize("router_dtype", ["fp32", None])
@pytest.mark.parametrize("name", list(ROUTERS))
def test_bf16_params_replay_is_bit_identical_to_the_routers_own_choice(megatron_cpu, name, router_dtype):
    """A GPTModel with bf16 parameters (Float16Module), its router in fp32 (`moe_router_dtype="fp32"`)
    or in the model's bf16 (None). Replaying the routes the model chose itself gives, bit for bit, the
    free pass's scored logprobs, its logits at every routed position and every parameter's gradient
    (routers included): Megatron weighs the replayed ids with its own scores in the forward's own
    precision. The replay is live (the unrouted positions, given rotating fill ids, change), and a
    random plan is routed exactly (flips 0) and moves the scores, so a session that did nothing fails."""
    model = _gpt_bf16(name, router_dtype)
    assert next(model.parameters()).dtype == torch.bfloat16
    geom = model_geometry(model, vocab_size=512)
    rng = np.random.default_rng(0)
    traces = [random_trace(f"q{i}", rng, geometry=geom, num_tokens=n, prompt_len=2) for i, n in enumerate((11, 6, 8))]
    random_plan = build_plan(traces, geom)
    free_BSV, free_G, free_grads, own = _scored_pass(model, random_plan)
    own_plan = _plan_of_own_routes(traces, own, random_plan)
    rep_BSV, rep_G, rep_grads, _ = _scored_pass(model, own_plan, own_plan)
    routed_BS = own_plan.routed_N.view(own_plan.batch_size, own_plan.seq_len)
    assert torch.equal(rep_G, free_G)
    assert torch.equal(rep_BSV[routed_BS], free_BSV[routed_BS])
    assert not torch.equal(rep_BSV[~routed_BS], free_BSV[~routed_BS])  # fill ids at unrouted positions: replay ran
    assert free_grads.keys() == rep_grads.keys() and len(free_grads) > 0
    assert [n for n in free_grads if not torch.equal(free_grads[n], rep_grads[n])] == []
    # a random plan: every router routes exactly its ids, and the scores move
    maps, handles = _watch(model)
    try:
        with torch.no_grad(), replay(model, random_plan) as session:
            forced_BSV = model(**megatron_inputs(random_plan))
    finally:
        for h in handles:
            h.remove()
    for lid, seen in maps.items():
        assert [torch.equal(m, torch.zeros_like(m).scatter(1, session.ids_MK[0][lid], True)) for _, m in seen] == [True]
    assert not torch.equal(forced_BSV[routed_BS], free_BSV[routed_BS])
