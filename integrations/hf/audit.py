"""The audit's forward on a Hugging Face model (FSDP2-sharded too): the model's own top-k per token.

One forward over the samples' right-padded batch (`moe_replay.audit.free.token_batch`, the plan's
layout; in chunks of `MAX_BATCH_TOKENS` padded tokens), without gradients, in eval mode (a router's
training-time jitter would move its choice), inside the caller's `context()` (the trainer's autocast),
with `capture_routes` hooking every router `find_routers` finds (replay.py: the same discovery and
hooks replay and capture use) and nothing else. An FSDP2-sharded model gathers its parameters in that
forward as in any other, and is left sharded as it was found (`fsdp.shards_kept`: FSDP2 keeps its root
gathered after a forward until a backward). Only the last position's logits are computed where the
model takes `logits_to_keep` (the audit reads routes, not logits: at Qwen3's 151,936-token vocabulary
the LM head is a large share of a forward).

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

from .fsdp import shards_kept
from .replay import _device, capture_routes, model_geometry


MAX_BATCH_TOKENS = 16384
"""Padded tokens the audit forwards at once (B * S of one forward): a trainer's batch (verl's whole mini-batch,
hundreds of samples) goes through in chunks of about a micro-batch, never in one forward."""


def free_routes(model: nn.Module, token_ids: Sequence[np.ndarray],
                context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                max_batch_tokens: int = MAX_BATCH_TOKENS) -> FreeRoutes:
    """The model's own top-k ids [S, L, K] for each sample's tokens (FreeRoutes), the samples forwarded in
    chunks of at most `max_batch_tokens` padded tokens (one sample at least)."""
    hooks = capture_routes(model)
    with hooks as cap:  # refuses routers under a replay session: that forward would not be free
        geometry = model_geometry(model, hooks.sites)
        device = _device(model)
        keep_one = "logits_to_keep" in inspect.signature(model.forward).parameters
        modes = {m: m.training for m in model.modules()}
        rows: list[np.ndarray] = []
        t0 = time.perf_counter()
        try:
            model.eval()
            with shards_kept(model):  # no backward follows: FSDP2's root would stay gathered
                for chunk in _chunks([len(t) for t in token_ids], max_batch_tokens):
                    plan = token_batch([token_ids[b] for b in chunk], geometry)
                    inputs = {k: v.to(device) for k, v in plan.model_inputs().items()}
                    with torch.no_grad(), context():
                        model(**inputs, use_cache=False, **({"logits_to_keep": 1} if keep_one else {}))
                    ids_LBSK = torch.stack([cap[lid].reshape(plan.batch_size, plan.seq_len, -1)
                                            for lid in geometry.moe_layer_ids])
                    rows += split_rows(ids_LBSK.to("cpu", torch.int32).numpy(), plan.lengths_B.tolist())
        finally:
            for m, mode in modes.items():
                m.training = mode
        seconds = time.perf_counter() - t0
    return FreeRoutes(geometry, tuple(rows), seconds)


def _chunks(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive samples whose padded batch (count x longest) stays within `budget` tokens."""
    out: list[list[int]] = []
    longest = 0
    for b, n in enumerate(lengths):
        if out and (len(out[-1]) + 1) * max(longest, n) <= budget:
            out[-1].append(b)
            longest = max(longest, n)
        else:
            out.append([b])
            longest = n
    return out
