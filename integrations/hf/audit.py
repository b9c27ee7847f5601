"""The audit's forward on a Hugging Face model (FSDP2-sharded too): the model's own top-k per token.

One forward over the samples' right-padded batch (`moe_replay.audit.free.token_batch`, the plan's
layout), without gradients, in eval mode (a router's training-time jitter would move its choice),
inside the caller's `context()` (the trainer's autocast), with `capture_routes` hooking every router
`find_routers` finds (replay.py: the same discovery and hooks replay and capture use) and nothing
else. An FSDP2-sharded model gathers its parameters in that forward as in any other. Only the last
position's logits are computed where the model takes `logits_to_keep` (the audit reads routes, not
logits: at Qwen3's 151,936-token vocabulary the LM head is a large share of a forward).

Legend: B samples, S padded length, L MoE layers, K top-k.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from moe_replay.audit.free import FreeRoutes, split_rows, token_batch

from .replay import _device, capture_routes, model_geometry


def free_routes(model: nn.Module, token_ids: Sequence[np.ndarray],
                context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> FreeRoutes:
    """The model's own top-k ids [S, L, K] for each sample's tokens (FreeRoutes)."""
    hooks = capture_routes(model)
    with hooks as cap:  # refuses routers under a replay session: that forward would not be free
        geometry = model_geometry(model, hooks.sites)
        plan = token_batch(token_ids, geometry)
        device = _device(model)
        inputs = {k: v.to(device) for k, v in plan.model_inputs().items()}
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            inputs["logits_to_keep"] = 1
        modes = {m: m.training for m in model.modules()}
        t0 = time.perf_counter()
        try:
            model.eval()
            with torch.no_grad(), context():
                model(**inputs, use_cache=False)
            ids_LBSK = torch.stack([cap[lid].reshape(plan.batch_size, plan.seq_len, -1) for lid in geometry.moe_layer_ids])
            ids_LBSK = ids_LBSK.to("cpu", torch.int32).numpy()
        finally:
            for m, mode in modes.items():
                m.training = mode
        seconds = time.perf_counter() - t0
    return FreeRoutes(geometry, split_rows(ids_LBSK, plan.lengths_B.tolist()), seconds)
