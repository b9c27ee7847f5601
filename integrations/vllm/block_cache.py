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

from .records import last_occurrence


def kv_slots(block_ids_T: np.ndarray, pos_T: np.ndarray, block_size: int) -> np.ndarray:
    """KV slot of each position, given the id of the block holding it (vLLM's slot mapping without
    context parallelism): the one formula for prefix reads and for runners whose mapping is on the device."""
    return block_ids_T.astype(np.int64) * block_size + pos_T % block_size


class SlotRouteCache:
    """routes_SLK[num_slots, L, K] mirror of the KV cache plus a per-slot written flag."""

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, top_k: int, dtype: torch.dtype) -> None:
        self.block_size = int(block_size)
        self.num_slots = int(num_blocks) * self.block_size
        self.routes_SLK = torch.zeros((self.num_slots, num_layers, top_k), dtype=dtype)
        self.valid_S = torch.zeros(self.num_slots, dtype=torch.bool)
        self._routes_np = self.routes_SLK.numpy()
        self._valid_np = self.valid_S.numpy()

    def write(self, slots_T: np.ndarray, routes_TLK: np.ndarray) -> None:
        """Store routes at the KV slots their forwards wrote (rows in step order: a slot reused by a
        later step keeps the later routes)."""
        last = last_occurrence(slots_T)
        self._routes_np[slots_T[last]] = routes_TLK[last]
        self._valid_np[slots_T[last]] = True

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
