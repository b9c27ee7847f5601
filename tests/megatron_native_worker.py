"""Two gloo ranks for the megatron_native path side by side with the project's (tests/test_megatron_native_ranks.py,
benchmarks/megatron_native.py). One spawn of two processes serves three phases, in order:

  ep2   expert parallelism (EP = 2, Megatron's all-to-all dispatcher; each rank 4 of the 8 experts,
        its own micro-batches of its own [S, B] shapes): for fp32 and bf16 parameters, activation
        recompute on and off, two micro-batches forward then backward, native vs project logits and
        every gradient (routers' included) on each rank, and free routing for `forces`;
  vpp   pipeline parallelism with virtual stages (PP = 2, VPP = 2; 8 layers, MoE layers 0, 2, 3, 5, 7:
        rank 0 holds chunks [0, 1] and [4, 5], rank 1 [2, 3] and [6, 7]), each chunk run by hand in
        Megatron's interleaved order (chunk 0 for both micro-batches, then chunk 1) on seeded hidden
        states: per chunk, the layer ids each path finds and native vs project outputs;
  verl  verl 0.9.1's own R3 machinery on the same chunks, after `apply_router_replay_patch()` (verl
        replaces TopKRouter's routing and RouterReplay class for the process, so this phase runs
        last): verl's `set_router_replay_data` fed the project's traces (integrations/verl/megatron.py)
        through its model-scoped and its positional router lookup, each router's targets against the
        project's ids for its layer in verl's packed order; and the native path over verl's registry
        (`RouterReplay.router_instances`), whose outputs must equal the vpp phase's.

CPU shims: those of tests/megatron_ep_worker.py (the all-to-all dispatcher's CUDA streams and split
sizes), in these processes only.

Legend: B batch rows, S padded length, M = S * B sequence-first positions, T packed tokens, L MoE layers, K top-k.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import megatron_gloo as gloo
from .megatron_ep_worker import _shims as ep_shims

H, VOCAB = 16, 512
EP_LENGTHS = (((9, 5, 7), (6, 8, 4)), ((11, 6), (7, 9)))
"""Per EP rank, two micro-batches (token counts of their traces): ranks of different [S, B] shapes."""
VPP_LAYERS = 8
VPP_FREQ = [1, 0, 1, 1, 0, 1, 0, 1]
VPP_LENGTHS = ((9, 5, 7), (6, 8, 4))


def _config(hidden: int = H, **kw):
    """4 layers (MoE layers 1 and 3), 8 experts, top-2, softmax before top-k and scaled; dropout off,
    so train-mode runs compare bit for bit."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=4, hidden_size=hidden, num_attention_heads=2, ffn_hidden_size=2 * hidden,
                moe_ffn_hidden_size=2 * hidden, num_moe_experts=8, moe_router_topk=2, moe_enable_routing_replay=True,
                moe_layer_freq=[0, 1, 0, 1], use_cpu_initialization=True, moe_router_dtype="fp32", add_bias_linear=False,
                moe_token_dispatcher_type="allgather", moe_router_pre_softmax=True, moe_router_topk_scaling_factor=1.5,
                hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**{**base, **kw})


def _decided_routers(model) -> None:
    from moe_replay.integrations.megatron import find_routers

    with torch.no_grad():
        for site in find_routers(model).values():
            torch.manual_seed(1000 + site.layer_id)  # the same router weights whatever the layout
            site.module.weight.normal_(0, 0.5)


def fresh_registry() -> None:
    """Megatron's process-global RouterReplay list, emptied: models built before are in it, and the
    native path refuses entries another model owns."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()


def gpt(*, bf16: bool = False, recompute: bool = False, mtp: bool = False, hidden: int = H, **kw):
    """The GPTModel of `_config` in train mode, routers given decided weights; bf16 parameters in
    Megatron's Float16Module; full activation recompute; one multi-token-prediction layer."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.module import Float16Module

    if bf16:
        kw.update(params_dtype=torch.bfloat16, bf16=True)
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if mtp:
        kw.update(mtp_num_layers=1)
    cfg = _config(hidden, **kw)
    torch.manual_seed(0)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    extra = {"mtp_block_spec": get_gpt_mtp_block_spec(cfg, spec.layer_specs[-1], use_transformer_engine=False)} if mtp else {}
    model = GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=256, **extra)
    _decided_routers(model)
    return (Float16Module(cfg, model) if bf16 else model).train()


def _plans(lengths, *, num_layers: int, moe_layers: tuple[int, ...], prefix: str):
    return gloo.random_plans(list(lengths), num_layers=num_layers, moe_layers=moe_layers, experts=8, vocab=VOCAB, prefix=prefix)


def step(model, micro, path: str | None, *, labels: bool = False, grads: bool = True):
    """Forward every micro-batch, then backward each (schedule order: recompute pops RouterReplay's
    FIFO); under replay on `path` (None: free routing). Returns (outputs per micro-batch, {param name:
    grad} or None, session). Outputs: logits [B, S, V], scored over the plan's tokens; with `labels`,
    GPTModel's per-token loss [B, S] (which runs its MTP block)."""
    from moe_replay.integrations.megatron import megatron_inputs, open_replay, score_tokens

    model.zero_grad(set_to_none=True)
    session = None

    def run():
        outs, losses = [], []
        for p in micro:
            inputs = megatron_inputs(p)
            if labels:
                loss_BS = model(**inputs, labels=p.input_ids_BS)
                losses.append(loss_BS.float().mean())
                outs.append(loss_BS.detach().float())
            else:
                out_BSV = model(**inputs)
                losses.append(score_tokens(out_BSV.float(), p).logprobs_G.sum())
                outs.append(out_BSV.detach().float())
        for loss in losses:
            loss.backward()
        return outs

    if path is None:
        outs = run()
    else:
        with open_replay(model, micro, path=path) as session:
            outs = run()
        assert path == "auto" or session.path == path, (session.path, path)
    got = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None} if grads else None
    return outs, got, session


def random_traces(lengths, geometry, prefix: str) -> list[list]:
    """Seeded random traces, one list per micro-batch (`lengths`: token counts of its traces)."""
    from .trace_factory import random_trace

    rng = np.random.default_rng(0)
    return [[random_trace(f"{prefix}{m}q{i}", rng, geometry=geometry, num_tokens=n, prompt_len=2) for i, n in enumerate(counts)]
            for m, counts in enumerate(lengths)]


def own_route_traces(model, traces: list, geometry) -> list:
    """The traces again, each routed as the model routes it freely (Megatron's RouterReplay RECORD in
    a no-grad forward), so a step replaying them does the same expert work as a free step: what the
    timing compares. Right padding: batch row b holds trace b's positions 0 .. len - 1."""
    import dataclasses

    from moe_replay.integrations.megatron import find_routers, megatron_inputs
    from moe_replay.integrations.megatron.replay import _actions
    from moe_replay.replay import build_plan

    plan = build_plan(traces, geometry)
    sites = find_routers(model)
    for site in sites.values():
        site.module.router_replay.set_router_replay_action(_actions(site.module.router_replay).RECORD)
    try:
        with torch.no_grad():
            model(**megatron_inputs(plan))
        own = {lid: site.module.router_replay.recorded_topk_idx.view(plan.seq_len, plan.batch_size, -1) for lid, site in sites.items()}
    finally:
        for site in sites.values():
            site.module.router_replay.clear_router_replay_action()
            site.module.router_replay.clear_indices()
    return [dataclasses.replace(t, routes_TLK=np.stack([own[lid][: t.num_tokens - 1, b].numpy() for lid in geometry.moe_layer_ids],
                                                       1).astype(t.routes_TLK.dtype)) for b, t in enumerate(traces)]


def compare(model, micro) -> dict[str, Any]:
    """Native, project and free routing on one model and micro-batches: the figures both the tests and
    benchmarks/megatron_native.py report."""
    native, native_g, _ = step(model, micro, "megatron_native")
    project, project_g, _ = step(model, micro, "project")
    free, _, _ = step(model, micro, None, grads=False)
    routers = [n for n in native_g if ".router." in n]
    return {
        "native_vs_project_max_abs_diff": max_diff(native, project),
        "native_grad_max_abs_diff": max(float((native_g[n] - project_g[n]).abs().max()) for n in routers),
        "all_grads_equal": native_g.keys() == project_g.keys() and all(torch.equal(native_g[n], project_g[n]) for n in native_g),
        "router_grads": len(routers),
        "native_forces": max_diff(native, free) > 0,
        "shapes": [[p.seq_len, p.batch_size] for p in micro],
    }


def max_diff(a, b) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


BYPASSES = {
    # name: (TransformerConfig setting, value, what the refusal names)
    "fused_router": ("moe_router_fusion", True, "moe_router_fusion=True"),
    "sinkhorn": ("moe_router_load_balancing_type", "sinkhorn", "moe_router_load_balancing_type='sinkhorn'"),
}
"""Router settings whose routing never consults RouterReplay (Transformer Engine's fused top-k returns
before it; sinkhorn picks its own experts): each must be refused by name before any forward."""


def bypass_refusals(model, micro) -> dict[str, dict[str, str | None]]:
    """{bypass: {path: the refusal's message, or None if the session was created}} with each bypass
    set on the built model's config (TE's fused kernel is not on a CPU machine, so it is set after the
    build, as the sinkhorn routing type is on each router), then put back."""
    from moe_replay.integrations.megatron import find_routers, open_replay
    from moe_replay.replay import UnsupportedRouterError

    routers = [s.module for s in find_routers(model).values()]
    configs = {id(r.config): r.config for r in routers}.values()
    out = {}
    for name, (setting, value, _) in BYPASSES.items():
        saved = [(c, getattr(c, setting)) for c in configs]
        kinds = [(r, r.routing_type) for r in routers]
        try:
            for c in configs:
                setattr(c, setting, value)
            for r in routers:
                r.routing_type = r.config.moe_router_load_balancing_type
            out[name] = {}
            for path in ("megatron_native", "project", "auto"):
                try:
                    open_replay(model, micro, path=path)
                    out[name][path] = None
                except UnsupportedRouterError as e:
                    out[name][path] = str(e)
        finally:
            for c, v in saved:
                setattr(c, setting, v)
            for r, kind in kinds:
                r.routing_type = kind
    return out


def refused_by_name(refusals: dict[str, dict[str, str | None]]) -> dict[str, bool]:
    """{bypass: every path refused it, naming the setting}."""
    return {name: all(m is not None and BYPASSES[name][2] in m for m in by_path.values()) for name, by_path in refusals.items()}


def config_name(bf16: bool, recompute: bool) -> str:
    return f"{'bf16' if bf16 else 'fp32'}_{'recompute' if recompute else 'no_recompute'}"


def ep_phase(rank: int) -> dict[str, Any]:
    """Native vs project (and free) on this EP rank's own micro-batches, per (dtype, recompute)."""
    out = {}
    micro = _plans(EP_LENGTHS[rank], num_layers=4, moe_layers=(1, 3), prefix=f"ep{rank}")
    for bf16 in (False, True):
        for recompute in (False, True):
            fresh_registry()
            model = gpt(bf16=bf16, recompute=recompute, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=2)
            out[config_name(bf16, recompute)] = compare(model, micro)
    return out


def _vpp_chunks(rank: int):
    """This PP rank's two virtual-stage chunks of the 8-layer GPTModel (fp32, eval)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    cfg = _config(num_layers=VPP_LAYERS, moe_layer_freq=VPP_FREQ, moe_token_dispatcher_type="allgather",
                  pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    chunks = []
    for vp in range(2):
        torch.manual_seed(0)
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, vp_stage=vp, pp_rank=rank)
        chunk = GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=64, vp_stage=vp,
                         pre_process=rank == 0 and vp == 0, post_process=rank == 1 and vp == 1,
                         share_embeddings_and_output_weights=False)
        _decided_routers(chunk)
        chunks.append(chunk.eval())
    return cfg, chunks


def _vpp_traces():
    """One list of seeded random traces per micro-batch (the 8-layer model's geometry)."""
    from moe_replay.geometry import ModelGeometry

    from .trace_factory import random_trace

    geometry = ModelGeometry(num_layers=VPP_LAYERS, moe_layer_ids=tuple(i for i, f in enumerate(VPP_FREQ) if f),
                             num_experts=8, top_k=2, vocab_size=VOCAB, family="megatron")
    rng = np.random.default_rng(0)
    return [[random_trace(f"vpp{m}q{i}", rng, geometry=geometry, num_tokens=n, prompt_len=2) for i, n in enumerate(counts)]
            for m, counts in enumerate(VPP_LENGTHS)]


def _vpp_plans():
    from moe_replay.replay import build_plan

    return [build_plan(traces, traces[0].geometry) for traces in _vpp_traces()]


def _run_chunks(chunks, micro, path) -> list[list[torch.Tensor]]:
    """Megatron's interleaved forward order by hand: chunk 0 for every micro-batch, then chunk 1;
    a chunk without the embedding gets seeded hidden states [S, B, H] (what the stage before sends)."""
    from moe_replay.integrations.megatron import megatron_inputs, open_replay

    outs: list[list[torch.Tensor]] = [[], []]
    with torch.no_grad(), open_replay(chunks, micro, path=path, partial=True) as session:
        for c, chunk in enumerate(chunks):
            for m, p in enumerate(micro):
                inputs = megatron_inputs(p)
                if not chunk.pre_process:
                    g = torch.Generator().manual_seed(100 * c + m)
                    chunk.set_input_tensor(torch.randn(p.seq_len, p.batch_size, H, generator=g))
                    inputs["input_ids"] = None
                outs[c].append(chunk(**inputs).clone())
    assert session.path == path
    return outs


def vpp_phase(rank: int) -> tuple[dict[str, Any], Any]:
    from moe_replay.integrations.megatron import find_routers

    fresh_registry()
    cfg, chunks = _vpp_chunks(rank)
    micro = _vpp_plans()
    native = _run_chunks(chunks, micro, "megatron_native")
    project = _run_chunks(chunks, micro, "project")
    return {
        "chunk_layers": [list(find_routers(c)) for c in chunks],
        "native_vs_project_max_abs_diff": max(max_diff(a, b) for a, b in zip(native, project)),
    }, native


def verl_phase(rank: int, vpp_native) -> dict[str, Any]:
    """verl's own R3 helpers on this rank's chunks, fed the project's traces."""
    from moe_replay.integrations.verl import use_cpu

    use_cpu()  # before verl's router-replay modules read the device at import
    from verl.utils.megatron.router_replay_patch import RouterReplay, apply_router_replay_patch
    from verl.utils.megatron.router_replay_utils import RouterReplayHelper, set_router_replay_data

    from moe_replay.integrations.megatron import find_routers
    from moe_replay.integrations.verl.megatron import packed_ids, routed_experts_BSLK

    apply_router_replay_patch()
    cfg, chunks = _vpp_chunks(rank)
    micro = _vpp_plans()
    plan = micro[0]
    routes_BSLK, mask_BS = routed_experts_BSLK(plan)
    out: dict[str, Any] = {"registry": len(RouterReplay.router_instances), "lookups": {}}
    for lookup in ("model", "positional"):
        mismatched = []
        for c, chunk in enumerate(chunks):
            set_router_replay_data(routes_BSLK, mask_BS, cfg, vp_rank=c, model=chunk if lookup == "model" else None)
            for lid, site in find_routers(chunk).items():
                rr = site.module.router_replay
                if not torch.equal(rr.target_topk_idx, packed_ids(plan, lid)):
                    mismatched.append(lid)
        positional = [[id(r) for r in RouterReplayHelper.get_micro_batch_router_list(cfg, c)] for c in range(2)]
        own = [[id(s.module.router_replay) for s in find_routers(c).values()] for c in chunks]
        out["lookups"][lookup] = {"mismatched_layers": mismatched, "positional_list_is_chunk_routers": positional == own}
        RouterReplay.clear_global_indices()
    native = _run_chunks(chunks, micro, "megatron_native")  # the native path over verl's registry and routing
    out["r3_nested"] = _r3_nested(cfg, chunks, plan)
    out["native_vs_vpp_native_max_abs_diff"] = max(max_diff(a, b) for a, b in zip(native, vpp_native))
    out["routing_owner"] = type(find_routers(chunks[0])[next(iter(find_routers(chunks[0])))].module).routing.__module__
    return out


def _r3_nested(cfg, chunks, plan) -> dict[str, Any]:
    """verl's R3 input path proper: the project's traces as `routed_experts` (one [T_b - 1, L, K] per
    sample, jagged), aligned and masked by verl's own functions, packed by `set_router_replay_data`
    (THD); each router's targets against the plan's ids of its layer on the replayed rows."""
    from verl.utils.megatron.router_replay_patch import RouterReplay
    from verl.utils.megatron.router_replay_utils import align_r3_router_replay_data, build_r3_replay_mask, set_router_replay_data

    from moe_replay.integrations.megatron import find_routers
    from moe_replay.integrations.verl.megatron import packed_ids, routed_experts

    traces = _vpp_traces()[0]
    ids = torch.nested.as_nested_tensor([torch.from_numpy(t.token_ids_S) for t in traces], layout=torch.jagged)
    response = torch.zeros(len(traces), max(t.num_tokens for t in traces), dtype=torch.long)
    for b, t in enumerate(traces):
        response[b, : t.num_generated] = 1
    routes = align_r3_router_replay_data(routed_experts(traces), ids)
    mask = build_r3_replay_mask(ids, response)
    mismatched, replayed = [], 0
    for c, chunk in enumerate(chunks):
        set_router_replay_data(routes, None, cfg, vp_rank=c, replay_mask=mask, model=chunk)
        for lid, site in find_routers(chunk).items():
            rr = site.module.router_replay
            keep_T = rr.target_replay_mask.bool()
            replayed = int(keep_T.sum())
            if not torch.equal(rr.target_topk_idx[keep_T], packed_ids(plan, lid)[keep_T]):
                mismatched.append(lid)
    RouterReplay.clear_global_indices()
    return {"mismatched_layers": mismatched, "replayed_rows": replayed,
            "routed_rows": sum(t.num_tokens - 1 for t in traces)}


def worker(rank: int, init: str, out: dict) -> None:
    from megatron.core import parallel_state

    gloo.init(rank, 2, init, ep_shims, ep=2)
    try:
        result: dict[str, Any] = {"ep2": ep_phase(rank)}
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, 2, virtual_pipeline_model_parallel_size=2)
        result["vpp"], vpp_native = vpp_phase(rank)
        result["verl"] = verl_phase(rank, vpp_native)
        out[rank] = result
    finally:
        gloo.close()


def run(work) -> list[dict[str, Any]]:
    """Both ranks' results (one spawn of two processes)."""
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    mp.spawn(worker, args=(gloo.init_method(work), out), nprocs=2, join=True)
    return [out[0], out[1]]

