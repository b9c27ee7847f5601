"""Shared by the multi-process Megatron workers (tests/megatron_pp_worker.py, megatron_ep_worker.py):
a gloo process group with Megatron's parallel state, rendezvous files, and route flips seen by
forward hooks on the real TopKRouters.

Legend: M sequence-first positions, E experts, K top-k.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch


def cpu_shims() -> None:
    """What megatron-core 0.16 needs to run on a CPU build (see tests/test_megatron_replay.py):
    `torch.cuda.current_device` -> "cpu", `te_general_gemm` defined, CUDA RNG state -> CPU's."""
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils

    torch.cuda.current_device = lambda: "cpu"
    moe_utils.te_general_gemm = None
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None


def init(rank: int, world: int, init_method: str, shims: Callable[[], None] = cpu_shims, *, pp: int = 1, ep: int = 1,
         cp: int = 1) -> None:
    """One gloo rank with Megatron's model-parallel state (TP 1) and CPU RNG tracking."""
    import torch.distributed as dist
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    shims()
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(1, pp, expert_model_parallel_size=ep, context_parallel_size=cp)
    mrandom.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)


def close() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def init_method(work: Any) -> str:
    """A fresh rendezvous file per process group (gloo's file store must not be reused)."""
    return f"file://{work}/init_{np.random.default_rng().integers(1 << 30)}"


def watch(model) -> tuple[dict[int, list[torch.Tensor]], list]:
    """Every router call's routing map [M, E], by global layer id."""
    from moe_replay.integrations.megatron import find_routers

    maps: dict[int, list[torch.Tensor]] = {}
    handles = [site.module.register_forward_hook(lambda m, a, out, lid=lid: maps.setdefault(lid, []).append(out[1].clone()))
               for lid, site in find_routers(model).items()]
    return maps, handles


def flips(maps: dict[int, list[torch.Tensor]], ids: list[dict[int, torch.Tensor]]) -> int:
    """Positions (per layer, per micro-batch) whose routed expert set differs from the replayed ids [M, K]."""
    return sum(int((map_ME != torch.zeros_like(map_ME).scatter(1, ids[m][lid], True)).any(-1).sum())
               for lid, seen in maps.items() for m, map_ME in enumerate(seen))


def random_traces(lengths: list[tuple[int, ...]], *, num_layers: int, moe_layers: tuple[int, ...], experts: int,
                  vocab: int, prefix: str) -> tuple[Any, list[list]]:
    """(geometry, one list of seeded random traces per entry of `lengths`, their token counts)."""
    from moe_replay.geometry import ModelGeometry

    from .trace_factory import random_trace

    geometry = ModelGeometry(num_layers=num_layers, moe_layer_ids=moe_layers, num_experts=experts, top_k=2,
                             vocab_size=vocab, family="megatron")
    rng = np.random.default_rng(0)
    return geometry, [[random_trace(f"{prefix}{p}q{i}", rng, geometry=geometry, num_tokens=n, prompt_len=2)
                       for i, n in enumerate(counts)] for p, counts in enumerate(lengths)]


def random_plans(lengths: list[tuple[int, ...]], *, num_layers: int, moe_layers: tuple[int, ...], experts: int,
                 vocab: int, prefix: str, config: Any = None) -> list:
    """One RoutePlan per entry of `lengths` (token counts of its traces), from seeded random traces."""
    from moe_replay.replay import build_plan

    geometry, batches = random_traces(lengths, num_layers=num_layers, moe_layers=moe_layers, experts=experts,
                                      vocab=vocab, prefix=prefix)
    return [build_plan(traces, geometry, **({"config": config} if config else {})) for traces in batches]


def reference_then_ranks(work: Any, reference_worker: Callable, rank_worker: Callable, plans: list,
                         ranks: int = 2) -> tuple[dict, list[dict]]:
    """The one-process reference run, then `ranks` gloo processes given the reference's weights."""
    import torch.multiprocessing as mp

    ref, out = mp.Manager().dict(), mp.Manager().dict()
    mp.spawn(reference_worker, args=(init_method(work), plans, ref), nprocs=1, join=True)
    mp.spawn(rank_worker, args=(init_method(work), plans, ref["state"], out), nprocs=ranks, join=True)
    return dict(ref), [out[r] for r in range(ranks)]


def load_reference(model, full: dict[str, torch.Tensor], marker: str, offset: int, who: str) -> None:
    """Load the one-process reference weights `full` into this rank's `model`, whose keys number
    the index after `marker` (a layer, or an expert) locally: global = local + offset."""
    own = {}
    for key in model.state_dict():
        name = key
        if marker in key:
            head, rest = key.split(marker, 1)
            i, tail = rest.split(".", 1)
            name = f"{head}{marker}{int(i) + offset}.{tail}"
        if name in full:  # tensors only: _extra_state entries are None without Transformer Engine
            own[key] = full[name]
    missing = [k for k in model.state_dict() if k not in own and not k.endswith("_extra_state")]
    if missing:
        raise RuntimeError(f"{who}: reference weights missing {missing[:4]}")
    model.load_state_dict(own, strict=False)  # Float16Module's returns None: the keys are checked above


def reference_run(model, plans: list) -> dict[str, Any]:
    """The whole model in one process: its routers given decided weights (so free and replayed routes
    differ), then each plan replayed and run free. Returns the weights, both logits, flips and ids."""
    from moe_replay.integrations.megatron import find_routers, megatron_inputs, replay

    with torch.no_grad():
        for site in find_routers(model).values():
            site.module.weight.normal_(0, 0.5)
    maps, handles = watch(model)
    with torch.no_grad(), replay(model, plans) as session:
        logits = [model(**megatron_inputs(p)).clone() for p in plans]
    for h in handles:
        h.remove()
    with torch.no_grad():
        free = [model(**megatron_inputs(p)).clone() for p in plans]
    return {"state": {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
            "logits": logits, "free_logits": free, "flips": flips(maps, session.ids_MK), "ids": session.ids_MK}
