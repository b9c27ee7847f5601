"""The audit's forward on a Megatron-core model: the decoder routers' own top-k per token.

One forward over the samples' right-padded batch (`moe_replay.audit.free.token_batch`, fed as
`layout.megatron_inputs` feeds replay), without gradients, in eval mode, inside the caller's
`context()`, with a forward hook on every decoder `TopKRouter` that `routers.find_routers` finds (the
discovery replay uses; multi-token-prediction routers are left out, as traces hold decoder layers
only). A router's `routing_map` [S * B, E] (sequence-first) holds its top-k as K set bits per token;
the audit compares sets, so those are its ids. A RouterReplay left with an action by the pipeline
(REPLAY_FORWARD, RECORD) would make that forward replay instead of route: every action is cleared
for the forward and put back after it.

Refused by name: a model split over pipeline stages or virtual-pipeline chunks (one stage's forward
needs the schedule's activations) and sequence parallelism over more than one rank (each router sees
a slice of the tokens).

`entry_layers(model)` says which layer each entry of Megatron's process-global RouterReplay list
belongs to (None for an MTP router's), for auditing per-router lists in that order
(`moe_replay.audit(model, lists, token_ids, format="megatron", layers=entry_layers(model))`).

Legend: B samples, S padded length, M = S * B sequence-first positions, E experts, K top-k, L MoE layers.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from moe_replay.audit.free import FreeRoutes, split_rows, token_batch
from moe_replay.replay.errors import UnsupportedRouterError

from .layout import megatron_inputs
from .routers import ModelOrRouters, find_routers, model_geometry, mtp_routers, sequence_share


def free_routes(model: Any, token_ids: Sequence[np.ndarray],
                context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> FreeRoutes:
    """The decoder routers' own top-k ids [S, L, K] for each sample's tokens (FreeRoutes)."""
    if not isinstance(model, nn.Module):
        chunks = list(model)
        if len(chunks) != 1:
            raise UnsupportedRouterError(f"audit: {len(chunks)} virtual-pipeline chunks; the audit runs one forward of the "
                                         "whole decoder in this process (pipeline parallel size 1)")
        model = chunks[0]
    _refuse_pipeline()
    sites = find_routers(model)
    for site in sites.values():
        ranks, _ = sequence_share(site)
        if ranks > 1:
            raise UnsupportedRouterError(f"audit: router {site.name!r} sees 1/{ranks} of each sequence (sequence "
                                         "parallelism); run the audit with sequence_parallel off")
    geometry = model_geometry(model, vocab_size=_vocab(model), family="")
    plan = token_batch(token_ids, geometry)
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in megatron_inputs(plan).items()}
    if getattr(next(iter(sites.values())).module.config, "mtp_num_layers", None):
        inputs["labels"] = inputs["input_ids"]  # GPTModel's MTP block reads labels; its routers are not audited
    maps: dict[int, torch.Tensor] = {}

    def hook(lid: int):
        def record(module, args, output):
            maps[lid] = output[1]

        return record

    handles = [s.module.register_forward_hook(hook(lid)) for lid, s in sites.items()]
    replays = [s.module.router_replay for s in sites.values() if getattr(s.module, "router_replay", None) is not None]
    saved = [rr.router_replay_action for rr in replays]
    modes = {m: m.training for m in model.modules()}
    t0 = time.perf_counter()
    try:
        for rr in replays:
            rr.router_replay_action = None  # free routing for this forward
        model.eval()
        with torch.no_grad(), context():
            model(**inputs)
        b, s, k = plan.batch_size, plan.seq_len, geometry.top_k
        ids_LBSK = torch.stack([maps[lid].float().topk(k, dim=-1).indices.view(s, b, k).transpose(0, 1)
                                for lid in geometry.moe_layer_ids]).to("cpu", torch.int32).numpy()
    finally:
        for h in handles:
            h.remove()
        for rr, action in zip(replays, saved):
            rr.router_replay_action = action
        for m, mode in modes.items():
            m.training = mode
    return FreeRoutes(geometry, split_rows(ids_LBSK, plan.lengths_B.tolist()), time.perf_counter() - t0)


def entry_layers(model_or_routers: ModelOrRouters) -> tuple[int | None, ...]:
    """The layer id of each entry of Megatron's process-global RouterReplay list (its position order: what
    `RouterReplay.set_replay_data` addresses), None for a multi-token-prediction router's entry. Raises
    UnsupportedRouterError where the list holds entries no router of the model owns (native.registry_layout)."""
    from .native import registry_layout

    layout = registry_layout(find_routers(model_or_routers), mtp_routers(model_or_routers))
    return tuple(layout.layer_at.get(pos) for pos in range(len(layout.instances)))


def _vocab(model: nn.Module) -> int:
    vocab = getattr(model, "vocab_size", None) or getattr(getattr(model, "module", None), "vocab_size", None)
    if vocab is None:
        raise UnsupportedRouterError(f"audit: {type(model).__name__} has no vocab_size (a GPTModel has one)")
    return int(vocab)


def _refuse_pipeline() -> None:
    try:
        from megatron.core import parallel_state

        pp = parallel_state.get_pipeline_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    except (ImportError, AssertionError):
        pp = 1
    if pp > 1:
        raise UnsupportedRouterError(f"audit: pipeline parallel size {pp}; the audit runs one forward of the whole decoder "
                                     "in this process (run it on a PP = 1 copy, or per stage with the schedule)")
