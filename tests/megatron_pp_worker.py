"""Megatron-core pipeline parallelism (PP=2) under replay, against a one-process replay of the same
weights and routes. Used by tests/test_megatron_parallel.py and benchmarks/topologies.py (cell
`megatron_pp2`).

A 4-layer GPTModel (MoE layers 1 and 3, 8 experts, top-2, allgather dispatcher, fp32, eval) is
built whole in one process and replays two micro-batch plans; its weights, logits and routing maps
are the reference. Two gloo processes then each build one pipeline stage (stage 0: embedding and
layers 0-1; stage 1: layers 2-3, final norm and output layer), load the reference weights of their
own layers, and run Megatron's own 1F1B schedule (`get_forward_backward_func`, forward_only=True,
2 micro-batches) inside `replay(stage, plans, partial=True)`: each stage holds one MoE layer and
accounts for it alone. With a store (run_pp2's default) each stage reads its micro-batches' traces
from a DirectoryStore with the routes of its own layer only (integrations/megatron/stage.py: of each
shared route chunk, only that layer's bytes) and builds its plans for that layer alone
(`build_plan(..., layers=...)`): the stage never holds the other stage's routes.

Test-only CPU shims, in the spawned processes only (library code has none): those of
tests/test_megatron_replay.py (`torch.cuda.current_device` -> "cpu", `te_general_gemm`, CUDA RNG
state -> CPU), and one for the schedule: megatron-core 0.16's non-interleaved schedule allocates
its token counter with a literal `device="cuda"`, so the schedules module sees a `torch` whose
`zeros` maps "cuda" to "cpu". Stage-to-stage tensors go through Megatron's P2PCommunicator with
`batch_p2p_comm=False` (plain isend/irecv: gloo runs them on CPU; the batched path ends with
`torch.cuda.synchronize()`).

Legend: B batch rows, S padded length, M = S * B sequence-first positions, E experts, V vocabulary.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from . import megatron_gloo as gloo

H, VOCAB, NUM_LAYERS, MOE_LAYERS = 16, 512, 4, (1, 3)
LENGTHS = ((11, 6, 9), (7, 11, 5))
"""Two micro-batches of three requests; both pad to S = 12 (the schedule sends one [S, B, H] shape)."""


def _shims() -> None:
    import megatron.core.pipeline_parallel.schedules as schedules

    gloo.cpu_shims()
    cpu_torch = types.ModuleType("torch")
    cpu_torch.__dict__.update(vars(torch))
    cpu_torch.zeros = lambda *a, device=None, **k: torch.zeros(*a, device="cpu" if device == "cuda" else device, **k)
    schedules.torch = cpu_torch


def _gpt(pp: int, rank: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=NUM_LAYERS, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, moe_ffn_hidden_size=32,
                            num_moe_experts=8, moe_router_topk=2, moe_enable_routing_replay=True, moe_layer_freq=[0, 1, 0, 1],
                            use_cpu_initialization=True, moe_router_dtype="fp32", add_bias_linear=False,
                            moe_token_dispatcher_type="allgather", pipeline_model_parallel_size=pp,
                            pipeline_dtype=torch.float32, batch_p2p_comm=False)
    torch.manual_seed(0)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, pp_rank=rank)
    return GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=64, pre_process=rank == 0, post_process=rank == pp - 1,
                    share_embeddings_and_output_weights=False).eval()


def reference_worker(rank: int, init: str, plans, out: dict) -> None:
    """The whole model in one process: weights, replayed logits, and the free-routing logits."""
    gloo.init(rank, 1, init, _shims)
    try:
        out.update(gloo.reference_run(_gpt(1, 0), plans))
    finally:
        gloo.close()


def stage_worker(rank: int, init: str, plans, full: dict, out: dict, store: str | None = None) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from moe_replay.integrations.megatron import find_routers, megatron_inputs, replay

    gloo.init(rank, 2, init, _shims, pp=2)
    try:
        model = _gpt(2, rank)
        # this stage's layers, numbered locally from 0
        gloo.load_reference(model, full, "decoder.layers.", rank * (NUM_LAYERS // 2), f"stage {rank}")
        read = _read_stage(store, plans, model) if store is not None else {}
        plans = read.pop("plans", plans)
        maps, handles = gloo.watch(model)
        logits: list[torch.Tensor] = []

        def keep_logits(logits_BSV: torch.Tensor):
            logits.append(logits_BSV.detach().clone())
            return logits_BSV.sum() * 0, {}

        def forward_step(data_iterator, stage):
            return stage(**next(data_iterator)), keep_logits

        with torch.no_grad(), replay(model, plans, partial=True) as session:
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([megatron_inputs(p) for p in plans]), model=[model],
                num_microbatches=len(plans), seq_length=plans[0].seq_len, micro_batch_size=plans[0].batch_size,
                forward_only=True)
        for h in handles:
            h.remove()
        out[rank] = {
            "layers": tuple(find_routers(model)),
            "calls": {lid: len(seen) for lid, seen in maps.items()},
            "forward_takes": [dict(ledger.forward_takes) for ledger in session.ledgers],
            "flips": gloo.flips(maps, session.ids_MK),
            "ids": session.ids_MK,
            "logits": logits,
            **read,
        }
    finally:
        gloo.close()


def _read_stage(store: str, plans, model) -> dict[str, Any]:
    """This stage's plans from the store's traces of its own layers, and what reading them cost."""
    from moe_replay.integrations.megatron.stage import stage_layers, stage_traces
    from moe_replay.replay import PlanConfig, build_plan
    from moe_replay.store import DirectoryStore

    layers = stage_layers(model)
    with DirectoryStore(store, readonly=True) as s:
        mine = [build_plan(stage_traces(s, p.keys, model), p.geometry, config=PlanConfig(pad_to_multiple_of=4), layers=layers)
                for p in plans]
        stats = s.stats
    return {"plans": mine, "plan_layers": [tuple(p.layer_index) for p in mine], "route_bytes": stats.by_kind["chunk_routes"]}


def write_store(work) -> tuple[str, int]:
    """make_plans' traces in a DirectoryStore whose records keep their routes in chunks (every run
    of routes: these traces are 5-11 tokens); (its path, the chunks' route bytes a reader of every
    layer reads)."""
    from moe_replay.store import DirectoryStore

    _, batches = gloo.random_traces(LENGTHS, num_layers=NUM_LAYERS, moe_layers=MOE_LAYERS, experts=8, vocab=VOCAB, prefix="m")
    path = f"{work}/routes"
    with DirectoryStore(path, chunk_min_bytes=1) as s:
        s.put_many([t for traces in batches for t in traces])
    with DirectoryStore(path, readonly=True) as s:
        s.get_many(s.keys())
        return path, s.stats.by_kind["chunk_routes"]


def make_plans():
    from moe_replay.replay import PlanConfig

    return gloo.random_plans(LENGTHS, num_layers=NUM_LAYERS, moe_layers=MOE_LAYERS, experts=8, vocab=VOCAB, prefix="m",
                             config=PlanConfig(pad_to_multiple_of=4))


def run_pp2(work, store: bool = True) -> dict[str, Any]:
    """Reference in one process, then PP=2 in two (each stage reading its own layers' routes from a
    store, unless store=False: then the whole plans); the figures benchmarks/topologies.py reports,
    plus the raw results for the test."""
    plans = make_plans()
    path, full_route_bytes = write_store(work) if store else (None, 0)
    worker = functools.partial(stage_worker, store=path) if store else stage_worker
    ref, stages = gloo.reference_then_ranks(work, reference_worker, worker, plans)
    ref_logits = ref["logits"]
    got = stages[1]["logits"]
    diff = max(float((a - b).abs().max()) for a, b in zip(got, ref_logits)) if len(got) == len(ref_logits) else float("inf")
    return {
        "plans": plans,
        "reference": ref,
        "stages": stages,
        "max_abs_logit_diff": diff,
        "flips": sum(s["flips"] for s in stages),
        "reference_flips": ref["flips"],
        "replay_vs_free_logit_diff": max(float((a - b).abs().max()) for a, b in zip(ref_logits, ref["free_logits"])),
        "store_route_bytes": full_route_bytes,
    }
