"""One engine step's layout, read once and shared by capture (capture/worker.py) and scoring.

Which request owns which rows of a step: the input batch's engine request ids (B, in batch order;
`external_id` drops vLLM's suffix to give the client's id), the query start offsets (B + 1), each
forwarded token's position (T) and the rows whose sample the runner throws away (a chunked prefill
short of its prompt end). KV slots (capture's prefix-cache route cache) are read per KV-cache
group on demand (`kv_slots`).

Where they come from: on HOST_MIRROR_DEVICES runners (CPU) `positions` and the slot mapping are
host tensors, read as they are. Other runners (GPU) fill those on the device; positions and slots
are derived from host mirrors (num_computed_tokens_cpu, query_start_loc, the block table), the
same way vLLM computes them, so nothing waits on a device copy.

The layout is taken once per step (`StepViews.layout`), by whichever listener asks first: scoring
asks before the forward (StepBracket.before_forward), capture after it; both see the same arrays.
Legend: B requests of the step, T tokens forwarded in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

HOST_MIRROR_DEVICES = {"cpu"}
"""Runner device types whose `positions` and slot mapping are host tensors, read as they are."""


@dataclass(frozen=True)
class StepLayout:
    """The rows of one engine step (copies: valid after the runner reuses its buffers)."""

    req_ids: list[str]
    """Engine request id of each of the B rows, in batch order."""
    qsl_B1: np.ndarray
    """Row b owns tokens [qsl_B1[b], qsl_B1[b + 1]) of the step."""
    pos_T: np.ndarray
    """Sequence position of each forwarded token."""
    discard_B: np.ndarray
    """True where the runner throws the row's sample away (a chunked prefill short of its prompt end)."""

    @property
    def num_tokens(self) -> int:
        return len(self.pos_T)


def external_id(internal_id: str) -> str:
    """'3-a1b2c3d4' -> '3' (vLLM appends '-' + 8 random chars to every request id)."""
    head, sep, tail = internal_id.rpartition("-")
    return head if sep and len(tail) == 8 else internal_id


def kv_slots(block_ids_T: np.ndarray, pos_T: np.ndarray, block_size: int) -> np.ndarray:
    """KV slot of each position, given the id of the block holding it (vLLM's slot mapping without
    context parallelism): the one formula for prefix reads and for runners whose mapping is on the device."""
    return block_ids_T.astype(np.int64) * block_size + pos_T % block_size


class StepViews:
    """The runner's per-step host buffers, viewed once per input batch; one layout per step."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._ib: Any = None
        self._host = False
        self._layout: StepLayout | None = None
        self._slots_np: dict[int, np.ndarray] = {}

    def new_step(self) -> None:
        """Forget the previous step's layout (called before each engine step)."""
        self._layout = None

    def _bind(self) -> None:
        r = self.runner
        self._ib = r.input_batch
        self._qsl, self._discard = r.query_start_loc.np, r.discard_request_mask.np
        self._host = torch.device(r.device).type in HOST_MIRROR_DEVICES
        self._positions = r.positions.numpy() if self._host else None
        self._slots_np: dict[int, np.ndarray] = {}
        """Host runners: a numpy view of each KV group's slot mapping, made once per input batch
        (a `.numpy()` per step is ~4 dispatcher ops inside the engine's step, benchmarks/capture.py)."""

    def layout(self, n: int) -> StepLayout:
        """The current step's layout for its n scheduled tokens (taken once, then shared)."""
        if self._layout is not None:
            return self._layout
        if self._ib is not self.runner.input_batch:  # re-bound if the input batch is rebuilt
            self._bind()
        num_reqs = self._ib.num_reqs
        qsl_B1 = self._qsl[: num_reqs + 1].copy()
        if self._positions is not None:
            pos_T = self._positions[:n].copy()
        else:
            row_T = np.repeat(np.arange(num_reqs), np.diff(qsl_B1))
            pos_T = self._ib.num_computed_tokens_cpu[row_T].astype(np.int64) + np.arange(n) - qsl_B1[row_T]
        self._layout = StepLayout(list(self._ib.req_ids[:num_reqs]), qsl_B1, pos_T, self._discard[:num_reqs].copy())
        return self._layout

    def slots(self, layout: StepLayout, kv_group: int) -> np.ndarray:
        """KV slot of each forwarded token in `kv_group`'s block table."""
        bt = self._ib.block_table.block_tables[kv_group]
        n = layout.num_tokens
        if self._host:
            # the tensor vLLM's kernel writes: on CPU runners `.gpu` is a host tensor, and it is not
            # always `.cpu` (an input batch rebuilt for a hybrid KV layout gets separate buffers)
            view = self._slots_np.get(kv_group)
            if view is None:
                view = self._slots_np[kv_group] = bt.slot_mapping.gpu.numpy()
            return view[:n].copy()
        row_T = np.repeat(np.arange(len(layout.req_ids)), np.diff(layout.qsl_B1))
        size = int(bt.block_size)
        return kv_slots(bt.block_table.np[row_T, layout.pos_T // size], layout.pos_T, size)
