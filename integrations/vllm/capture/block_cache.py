"""Routes per KV-cache slot, so prefix-cache hits still get complete routes.

A cached prompt token is not forwarded again, but its KV lives in a physical KV block that a
forward wrote once. We store that forward's routes at the same slot (block_id * block_size +
offset): the routes and the KV in a slot always come from the same forward, whichever request
later hits the block (its block hash chose the block). Cost: L*K narrow ints per KV slot, a small
fraction of the KV itself (which is >= 2*head_dim*kv_heads*bytes per layer per slot).
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CaptureHookError
from ..step import kv_slots
from .row_log import last_occurrence


def _spec_types(spec) -> list[type]:
    """Attention spec classes of one KV-cache group (a uniform group lists each layer's spec)."""
    inner = getattr(spec, "kv_cache_specs", None)
    return [type(s) for s in inner.values()] if isinstance(inner, dict) else [type(spec)]


def route_kv_group(kv_cache_config, num_block_tables: int):
    """(index, spec) of the KV-cache group whose blocks key the slot route cache.

    A prefix-cache hit skips the forward of positions whose KV every group already holds; only a
    full-attention group keeps one block per position for the whole sequence (a sliding-window
    group's table holds the null block outside its window, a Mamba group one state block), so
    routes live at that group's slots. vLLM builds one group (full attention or MLA), or several
    (GPT-OSS: sliding window + full; hybrid Mamba / linear attention + full): the first group whose
    every layer is plain full attention or MLA is taken; a layout without one is refused.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    plain = (FullAttentionSpec, MLAAttentionSpec)
    groups = list(kv_cache_config.kv_cache_groups)
    kinds = [_spec_types(g.kv_cache_spec) for g in groups]
    if len(groups) != num_block_tables:
        raise CaptureHookError(f"the engine has {len(groups)} KV-cache groups but {num_block_tables} block tables: "
                               "cannot tell which block table keys the slot route cache")
    for i, types in enumerate(kinds):
        if types and all(t in plain for t in types):
            return i, groups[i].kv_cache_spec
    names = [sorted({t.__name__ for t in types}) for types in kinds]
    raise CaptureHookError(
        f"prefix-cache routes need a full-attention KV-cache group; this engine's groups hold {names}. "
        "Use CaptureConfig(prefix_cache_routes=False) with enable_prefix_caching=False on this model"
    )


class SlotRouteCache:
    """routes_SLK[num_slots, L, K] mirror of the KV cache plus a per-slot written flag."""

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, top_k: int, dtype: torch.dtype) -> None:
        self.block_size = int(block_size)
        self.num_slots = int(num_blocks) * self.block_size
        self.routes_SLK = torch.zeros((self.num_slots, num_layers, top_k), dtype=dtype)
        self.valid_S = torch.zeros(self.num_slots, dtype=torch.bool)
        self._routes_np = self.routes_SLK.numpy()
        self._valid_np = self.valid_S.numpy()

    def write(self, slots_T: np.ndarray, routes_TLK: np.ndarray, valid_T: np.ndarray | None = None) -> None:
        """Store routes at the KV slots their forwards wrote (rows in step order: a slot reused by a
        later step keeps the later routes); rows with valid_T False are stored as missing."""
        last = last_occurrence(slots_T)
        self._routes_np[slots_T[last]] = routes_TLK[last]
        self._valid_np[slots_T[last]] = True if valid_T is None else valid_T[last]

    def read(self, block_ids: np.ndarray, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Routes of positions [start, stop) of a request whose block table is block_ids.

        Returns (routes [stop-start, L, K], valid [stop-start]); invalid rows were never written
        while capture was installed.
        """
        pos = np.arange(start, stop)
        slots = kv_slots(block_ids[pos // self.block_size], pos, self.block_size)
        return self._routes_np[slots].copy(), self._valid_np[slots].copy()

    def clear(self) -> None:
        self.valid_S.zero_()
