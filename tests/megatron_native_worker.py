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


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=4, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, moe_ffn_hidden_size=32,
                num_moe_experts=8, moe_router_topk=2, moe_enable_routing_replay=True, moe_layer_freq=[0, 1, 0, 1],
                use_cpu_initialization=True, moe_router_dtype="fp32", add_bias_linear=False,
                moe_token_dispatcher_type="alltoall", moe_router_pre_softmax=True, moe_router_topk_scaling_factor=1.5,
                hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**{**base, **kw})


def _decided_routers(model) -> None:
    from moe_replay.integrations.megatron import find_routers

    with torch.no_grad():
        for site in find_routers(model).values():
            torch.manual_seed(1000 + site.layer_id)  # the same router weights whatever the layout
            site.module.weight.normal_(0, 0.5)


def _fresh_registry() -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()


def _ep_model(bf16: bool, recompute: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.module import Float16Module

    kw: dict[str, Any] = dict(expert_model_parallel_size=2)
    if bf16:
        kw.update(params_dtype=torch.bfloat16, bf16=True)
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    cfg = _config(**kw)
    torch.manual_seed(0)
    model = GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False), vocab_size=VOCAB, max_sequence_length=64)
    _decided_routers(model)
    return (Float16Module(cfg, model) if bf16 else model).train()


def _plans(lengths, *, num_layers: int, moe_layers: tuple[int, ...], prefix: str):
    return gloo.random_plans(list(lengths), num_layers=num_layers, moe_layers=moe_layers, experts=8, vocab=VOCAB, prefix=prefix)


def _step(model, micro, path):
    """Forward every micro-batch, then backward each; logits and {param: grad}."""
    from moe_replay.integrations.megatron import megatron_inputs, open_replay, score_tokens

    model.zero_grad(set_to_none=True)

    def run():
        logits, losses = [], []
        for p in micro:
            out_BSV = model(**megatron_inputs(p))
            losses.append(score_tokens(out_BSV.float(), p).logprobs_G.sum())
            logits.append(out_BSV.detach().float())
        for loss in losses:
            loss.backward()
        return logits

    if path is None:
        logits = run()
    else:
        with open_replay(model, micro, path=path) as session:
            logits = run()
        assert session.path == path
    return logits, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_diff(a, b) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def ep_phase(rank: int) -> dict[str, Any]:
    """Native vs project (and free) on this EP rank's own micro-batches, per (dtype, recompute)."""
    out = {}
    micro = _plans(EP_LENGTHS[rank], num_layers=4, moe_layers=(1, 3), prefix=f"ep{rank}")
    for bf16 in (False, True):
        for recompute in (False, True):
            _fresh_registry()
            model = _ep_model(bf16, recompute)
            native, native_g = _step(model, micro, "megatron_native")
            project, project_g = _step(model, micro, "project")
            free, _ = _step(model, micro, None)
            routers = [n for n in native_g if ".router." in n]
            out[f"{'bf16' if bf16 else 'fp32'}_{'recompute' if recompute else 'no_recompute'}"] = {
                "native_vs_project_max_abs_diff": _max_diff(native, project),
                "native_grad_max_abs_diff": max(float((native_g[n] - project_g[n]).abs().max()) for n in routers),
                "all_grads_equal": native_g.keys() == project_g.keys() and all(torch.equal(native_g[n], project_g[n]) for n in native_g),
                "router_grads": len(routers),
                "native_forces": _max_diff(native, free) > 0,
                "shapes": [[p.seq_len, p.batch_size] for p in micro],
            }
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

    _fresh_registry()
    cfg, chunks = _vpp_chunks(rank)
    micro = _vpp_plans()
    native = _run_chunks(chunks, micro, "megatron_native")
    project = _run_chunks(chunks, micro, "project")
    return {
        "chunk_layers": [list(find_routers(c)) for c in chunks],
        "native_vs_project_max_abs_diff": max(_max_diff(a, b) for a, b in zip(native, project)),
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
    out["native_vs_vpp_native_max_abs_diff"] = max(_max_diff(a, b) for a, b in zip(native, vpp_native))
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

