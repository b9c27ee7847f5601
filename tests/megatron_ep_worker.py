"""Megatron-core expert parallelism (EP=2) with the all-to-all token dispatcher under replay, against
a one-process replay of the same weights and routes. Used by tests/test_megatron_parallel.py and
benchmarks/topologies.py (cell `megatron_ep2_alltoall`).

A 4-layer GPTModel (MoE layers 1 and 3, 8 experts, top-2, `moe_token_dispatcher_type="alltoall"`,
fp32, eval) is built whole in one process (EP=1: all 8 experts local); it replays each rank's
micro-batch plan and runs it again with free routing; its weights and logits are the reference.
Two gloo processes then each build the same model with `expert_model_parallel_size=2` (rank r
holds experts 4r..4r+3), load the reference weights (their own experts renumbered to local
indices), and replay their own micro-batch: rank 0 a [S, B] = [11, 2] batch, rank 1 a [9, 2] one.
The all-to-all dispatcher exchanges per-expert token counts and sends each rank exactly the tokens
routed to its experts (`all_to_all_single` with split sizes), so unequal shapes need no padding.

Test-only CPU shims, in the spawned processes only (library code has none):
  * those of tests/test_megatron_replay.py: `torch.cuda.current_device` -> "cpu" (Megatron's
    all-to-all allocates its output on `torch.cuda.current_device()`), `te_general_gemm` None,
    CUDA RNG state -> CPU RNG state;
  * the dispatcher module sees a `torch` whose `cuda` has a do-nothing `Stream`, `current_stream`,
    `stream()` and event: megatron-core 0.16's `MoEAlltoAllTokenDispatcher.__init__` creates a
    `torch.cuda.Stream()` for its device-to-host copies of the split sizes ("torch.cuda.Stream
    requires CUDA support" on a CPU build), and `_maybe_dtoh_and_synchronize` enters that stream
    and synchronizes on an event recorded there. On CPU the split sizes are already host tensors
    (`maybe_move_tensor_to_cpu` copies CUDA tensors only), so there is nothing to overlap or wait
    for: the shim changes no value;
  * the dispatcher's `maybe_move_tensor_to_cpu` returns numpy split sizes for host tensors too:
    megatron-core 0.16 converts only CUDA tensors (`tensor.is_cuda`) and leaves host ones as torch
    tensors, which `torch.distributed.all_to_all_single` rejects as split sizes ("TypeError:
    all_to_all_single(): incompatible function arguments", seen with `tensor([24, 16])`). On a GPU
    the same call returns the same integers as numpy arrays, which is what the shim returns.

Legend: B batch rows, S padded length, M = S * B sequence-first positions, E experts, V vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import torch

from . import megatron_gloo as gloo

H, VOCAB, NUM_LAYERS, MOE_LAYERS, EXPERTS = 16, 512, 4, (1, 3), 8
LENGTHS = ((11, 6), (9, 7))
"""Rank 0's micro-batch pads to S = 11, rank 1's to S = 9: unequal [S, B] shapes across EP ranks."""


class _HostStream:
    """A CUDA stream stand-in on a CPU build: work is already ordered, events are already done."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self):
        return types.SimpleNamespace(synchronize=lambda: None)


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """`maybe_move_tensor_to_cpu` as it behaves on a GPU: a host copy, numpy where asked."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


def _shims() -> None:
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    gloo.cpu_shims()
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    stream = _HostStream()
    host_cuda = types.ModuleType("torch.cuda")
    host_cuda.__dict__.update(vars(torch.cuda))
    host_cuda.Stream = lambda *a, **k: stream
    host_cuda.current_stream = lambda *a, **k: stream
    host_cuda.stream = lambda s: contextlib.nullcontext()
    host_torch = types.ModuleType("torch")
    host_torch.__dict__.update(vars(torch))
    host_torch.cuda = host_cuda
    token_dispatcher.torch = host_torch


def _gpt(ep: int, bf16: bool = False, dispatcher: str = "alltoall"):
    """The model; with `bf16`, bf16 parameters in Megatron's Float16Module (as Megatron-LM wraps a
    --bf16 model; fp32 logits out), the router in fp32 (`moe_router_dtype`)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=NUM_LAYERS, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, moe_ffn_hidden_size=32,
                            num_moe_experts=EXPERTS, moe_router_topk=2, moe_enable_routing_replay=True,
                            moe_layer_freq=[0, 1, 0, 1], use_cpu_initialization=True, moe_router_dtype="fp32",
                            add_bias_linear=False, moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=ep,
                            **(dict(params_dtype=torch.bfloat16, bf16=True) if bf16 else {}))
    torch.manual_seed(0)
    model = GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False), vocab_size=VOCAB,
                     max_sequence_length=64)
    if bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)
    return model.eval()


def reference_worker(rank: int, init: str, plans, out: dict, *, bf16: bool = False, dispatcher: str = "alltoall") -> None:
    """The whole model in one process (all experts local): weights, replayed and free logits per plan."""
    gloo.init(rank, 1, init, _shims)
    try:
        out.update(gloo.reference_run(_gpt(1, bf16, dispatcher), plans))
    finally:
        gloo.close()


def ep_worker(rank: int, init: str, plans, full: dict, out: dict, *, bf16: bool = False,
              dispatcher: str = "alltoall") -> None:
    from moe_replay.integrations.megatron import find_routers, megatron_inputs, replay

    gloo.init(rank, 2, init, _shims, ep=2)
    try:
        model = _gpt(2, bf16, dispatcher)
        dispatcher = next(m.token_dispatcher for m in model.modules() if hasattr(m, "token_dispatcher"))
        # local expert i of this EP rank is global expert rank * (EXPERTS / 2) + i
        gloo.load_reference(model, full, ".local_experts.", rank * (EXPERTS // 2), f"EP rank {rank}")
        maps, handles = gloo.watch(model)
        plan = plans[rank]
        with torch.no_grad(), replay(model, plan) as session:
            logits = model(**megatron_inputs(plan)).clone()
        for h in handles:
            h.remove()
        out[rank] = {
            "dispatcher": type(dispatcher).__name__,
            "local_experts": list(dispatcher.local_expert_indices),
            "layers": tuple(find_routers(model)),
            "calls": {lid: len(seen) for lid, seen in maps.items()},
            "flips": gloo.flips(maps, session.ids_MK),
            "ids": session.ids_MK[0],
            "logits": logits,
            "param_dtype": str(next(model.parameters()).dtype),
        }
    finally:
        gloo.close()


EQUAL_LENGTHS = ((11, 6), (11, 5))
"""Both ranks' micro-batches pad to [11, 2]: the allgather dispatcher gathers the EP ranks' tokens as equal shapes."""


def make_plans(lengths=LENGTHS):
    """One micro-batch plan per EP rank (by default of different [S, B] shapes)."""
    return gloo.random_plans(lengths, num_layers=NUM_LAYERS, moe_layers=MOE_LAYERS, experts=EXPERTS, vocab=VOCAB,
                             prefix="r")


def run_ep2_alltoall(work, bf16: bool = False, dispatcher: str = "alltoall") -> dict[str, Any]:
    """Reference in one process, then EP=2 in two (both with bf16 parameters when `bf16`); the
    figures benchmarks/topologies.py reports, plus the raw results for the test. `dispatcher`
    "allgather" runs Megatron's allgather dispatcher instead, on equal micro-batch shapes."""
    plans = make_plans(EQUAL_LENGTHS if dispatcher == "allgather" else LENGTHS)
    ref, ranks = gloo.reference_then_ranks(work, functools.partial(reference_worker, bf16=bf16, dispatcher=dispatcher),
                                           functools.partial(ep_worker, bf16=bf16, dispatcher=dispatcher), plans)
    ref_logits, free_logits = ref["logits"], ref["free_logits"]
    diff = max(float((r["logits"] - want).abs().max()) for r, want in zip(ranks, ref_logits))
    free = max(float((r["logits"] - f).abs().max()) for r, f in zip(ranks, free_logits))
    return {
        "plans": plans,
        "reference": ref,
        "ranks": ranks,
        "shapes": [[p.seq_len, p.batch_size] for p in plans],
        "max_abs_logit_diff": diff,
        "flips": sum(r["flips"] for r in ranks),
        "reference_flips": ref["flips"],
        "replay_vs_free_logit_diff": free,
    }
