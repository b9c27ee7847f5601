"""One engine step's layout, read once and shared by capture (capture/worker.py) and scoring.

Which request owns which rows of a step: the input batch's engine request ids (B, in batch order;
`external_id` drops vLLM's suffix to give the client's id), the query start offsets (B + 1), each
forwarded token's position (T) and the rows whose sample the runner throws away (a chunked prefill
short of its prompt end). KV slots (capture's prefix-cache route cache) are read per KV-cache
group on demand (`kv_slots`).

Where they come from: on HOST_MIRROR_DEVICES runners (CPU) `positions` and the slot mapping are
host tensors, copied as they are into host rings with one byte-view copy each (HostRing: no numpy
or ctypes call inside the step). Other runners (GPU) fill those on the device; positions and slots
are derived from host mirrors (num_computed_tokens_cpu, query_start_loc, the block table), the
same way vLLM computes them, so nothing waits on a device copy.

The layout is taken once per step (`StepViews.layout`), by whichever listener asks first: scoring
asks before the forward (StepBracket.before_forward), capture after it; both see the same arrays.
Legend: B requests of the step, T tokens forwarded in it.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

import numpy as np
import torch

HOST_MIRROR_DEVICES = {"cpu"}
"""Runner device types whose `positions` and slot mapping are host tensors, read as they are."""


RingRows = tuple
"""(ring array, start, stop): rows [start, stop) of a host ring (`HostRing`), viewed only when
read (`rows_of`), so taking a step's rows inside the engine's step runs no numpy and makes no
object with a Python __init__ (a tuple: see HostRing for why)."""


def rows_of(x: "np.ndarray | RingRows") -> np.ndarray:
    """The rows a StepLayout field or a slots value stands for (a view of its ring, or the array)."""
    return x[0][x[1] : x[2]] if type(x) is tuple else x


def join_rows(parts: "list[np.ndarray | RingRows]") -> np.ndarray:
    """Several steps' rows end to end, as a new array. Steps taken one after the other from one
    host ring sit back to back in it (a ring starts over only at a rewind or when full, and
    capture flushes before either), so their rows are one slice: one copy instead of a view and a
    concatenate per step (66 steps: ~1 ms less per flush, most of it Python per step)."""
    if parts and all(type(x) is tuple for x in parts):
        ring = parts[0][0]
        start = parts[0][1]
        if all(x[0] is ring for x in parts) and all(a[2] == b[1] for a, b in zip(parts, parts[1:])):
            return ring[start : parts[-1][2]].copy()
    return np.concatenate([rows_of(x) for x in parts])


class StepLayout:
    """The rows of one engine step (copies: valid after the runner reuses its buffers; on host
    runners views of the StepViews ring, valid until its next `rewind`)."""

    __slots__ = ("req_ids", "num_tokens", "_qsl", "_pos", "_discard")

    def __init__(self, req_ids: list[str], qsl_B1: "np.ndarray | RingRows", pos_T: "np.ndarray | RingRows",
                 discard_B: "np.ndarray | RingRows") -> None:
        self.req_ids = req_ids
        """Engine request id of each of the B rows, in batch order."""
        self.num_tokens = pos_T[2] - pos_T[1] if type(pos_T) is tuple else len(pos_T)
        self._qsl, self._pos, self._discard = qsl_B1, pos_T, discard_B

    @property
    def qsl_B1(self) -> np.ndarray:
        """Row b owns tokens [qsl_B1[b], qsl_B1[b + 1]) of the step."""
        return rows_of(self._qsl)

    @property
    def pos_T(self) -> np.ndarray:
        """Sequence position of each forwarded token."""
        return rows_of(self._pos)

    @property
    def discard_B(self) -> np.ndarray:
        """True where the runner throws the row's sample away (a chunked prefill short of its prompt end)."""
        return rows_of(self._discard)

    @staticmethod
    def joined(lays: "list[StepLayout]") -> "JoinedLayouts":
        """S steps' layouts laid end to end (B rows and T tokens in all, `join_rows`)."""
        n_S = np.fromiter((lay.num_tokens for lay in lays), dtype=np.int64, count=len(lays))
        qsl_X = join_rows([lay._qsl for lay in lays])  # X = B + S: each step's B_s + 1 query starts
        b_S = np.fromiter((len(lay.req_ids) for lay in lays), dtype=np.int64, count=len(lays))
        if len(qsl_X) != int(b_S.sum()) + len(lays):
            raise RuntimeError(f"{len(lays)} steps of {int(b_S.sum())} rows hold {len(qsl_X)} query starts")
        last_S = np.cumsum(b_S + 1) - 1  # each step's closing query start
        first_X = np.zeros(len(qsl_X), dtype=bool)
        first_X[last_S - b_S] = True
        last_X = np.zeros(len(qsl_X), dtype=bool)
        last_X[last_S] = True
        tok0_B = np.repeat(np.cumsum(n_S) - n_S, b_S)  # first window token of each row's step
        return JoinedLayouts(n_S, b_S, qsl_X[~last_X] + tok0_B, qsl_X[~first_X] + tok0_B,
                             join_rows([lay._pos for lay in lays]), join_rows([lay._discard for lay in lays]))


class JoinedLayouts(NamedTuple):
    """Several steps' rows end to end (`StepLayout.joined`): S steps, B rows, T tokens."""

    n_S: np.ndarray
    """Tokens forwarded per step."""
    b_S: np.ndarray
    """Rows per step."""
    start_B: np.ndarray
    """First token of each row, counted from the first step's first token."""
    stop_B: np.ndarray
    """One past each row's last token, counted alike."""
    pos_T: np.ndarray
    discard_B: np.ndarray


class HostRing:
    """Host copies of one runner buffer's per-step rows, laid end to end (dtype of the source).

    Why: right after a 30 ms forward the core's caches hold the model, not our code: inside the
    engine's step the first numpy call of a hook costs ~25 us, the first ctypes.memmove ~20-25 us
    (libffi; moving the rings from memmove to byte views moved that cost to the next ctypes call of
    the hook: bench model, compiled, 2-core machine). A step therefore copies by slice assignment
    between byte memoryviews (a memcpy inside CPython) and the views are made when the rows are
    read (at a flush). `take_rows` hands out RingRows; `rewind` starts over (the holder of earlier
    rows has read them: capture rewinds after its flush)."""

    __slots__ = ("array", "bytes", "itemsize", "capacity", "used")

    def __init__(self, dtype: np.dtype, capacity: int) -> None:
        self.array = np.empty(capacity, dtype=dtype)
        self.bytes = memoryview(self.array).cast("B")
        self.itemsize, self.capacity = self.array.itemsize, capacity
        self.used = 0


def take_rows(sources: "tuple[tuple[HostRing, memoryview], ...]", counts: "tuple[int, ...]") -> list:
    """Copy the first counts[i] items of each source (a byte view of a host buffer of its ring's
    dtype: `byte_view`) to its ring's next rows; a ring without room starts over first. Returns
    each ring's RingRows. One call for all of a step's rings: a method call per ring cost ~2-3 us
    more each inside the step (`benchmarks/capture.py`, step.after_forward)."""
    out = []
    for (ring, src), n in zip(sources, counts):
        a = ring.used
        if a + n > ring.capacity:
            if n > ring.capacity:
                raise RuntimeError(f"a step of {n} items exceeds the host ring ({ring.capacity})")
            a = 0
        size = ring.itemsize
        ring.bytes[a * size : (a + n) * size] = src[: n * size]
        ring.used = a + n
        out.append((ring.array, a, a + n))
    return out


def byte_view(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous host array, as a flat memoryview (slice-assignable)."""
    if not a.flags.c_contiguous:
        raise RuntimeError(f"expected a contiguous host array, found strides {a.strides} for shape {a.shape}")
    return memoryview(a).cast("B")


def copy_from_addresses(out: np.ndarray, ptrs: "list[int]", nbytes: "list[int]") -> np.ndarray:
    """Fill the C-contiguous host array `out` with nbytes[i] bytes from each address ptrs[i], end to
    end (one memmove each); the caller keeps the memory behind every address alive until it returns.
    Why: at a capture flush the held tensors of 66 steps are cold, and reading them through their
    tensor objects (torch.cat, or a numpy view each) touched every tensor's metadata again."""
    if out.nbytes != sum(nbytes) or not out.flags.c_contiguous:
        raise RuntimeError(f"copy of {sum(nbytes)} bytes into an array of {out.nbytes} (contiguous: "
                           f"{out.flags.c_contiguous})")
    move, at = ctypes.memmove, out.ctypes.data
    for ptr, n in zip(ptrs, nbytes):
        move(at, ptr, n)
        at += n
    return out


def external_id(internal_id: str) -> str:
    """'3-a1b2c3d4' -> '3' (vLLM appends '-' + 8 random chars to every request id)."""
    head, sep, tail = internal_id.rpartition("-")
    return head if sep and len(tail) == 8 else internal_id


def kv_slots(block_ids_T: np.ndarray, pos_T: np.ndarray, block_size: int) -> np.ndarray:
    """KV slot of each position, given the id of the block holding it (vLLM's slot mapping without
    context parallelism): the one formula for prefix reads and for runners whose mapping is on the device."""
    return block_ids_T.astype(np.int64) * block_size + pos_T % block_size


class StepViews:
    """The runner's per-step host buffers, viewed once per input batch; one layout per step.

    Host runners copy each step's rows into HostRings (byte views, no numpy inside the step): the
    layouts stay valid until `rewind`, which the capture listener calls after each flush; a ring
    without room starts over by itself, so a listener that keeps layouts counts the items it took
    against `free_items` and flushes first (a step of n tokens takes n positions, n slots, <= n
    discard flags and <= n + 1 query starts)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._ib: Any = None
        self._direct = False
        self._host = False
        self.current: StepLayout | None = None
        """The current step's layout once a listener took it; the step bracket sets it to None
        before each engine step (an attribute store: a method call there was one more frame a step)."""
        self._rings: dict[str, HostRing] = {}
        """Host runners: "qsl", "pos", "discard" and "slots<group>" rings (allocated at first bind)."""
        self._layout_src: tuple[tuple[HostRing, memoryview], ...] = ()
        """Host runners: the qsl, pos and discard rings with a byte view of their runner buffer."""
        self._ids: list[str] | None = None
        """The request ids of the last layout taken (a copy; shared by the next one while the batch
        keeps them: a list of B ids compared by identity instead of a new slice per step)."""
        self._slot_src: dict[int, tuple[tuple[HostRing, memoryview]]] = {}
        """Host runners: per KV group, its slot ring and a byte view of vLLM's slot mapping (`take_rows`)."""
        self._with_slots: dict[int, tuple[tuple[HostRing, memoryview], ...]] = {}
        """Host runners: per KV group, the layout's sources and then its slots' (`layout_slots`)."""
        tokens = int(getattr(runner, "max_num_tokens", 0) or 0)
        self.ring_tokens = max(1 << 16, 4 * tokens)
        """Tokens the host rings hold: 64 Ki (512 KiB of int64 positions) or four full steps."""

    def _bind(self) -> None:
        r = self.runner
        ib = self._ib = r.input_batch
        # The list and map that InputBatch's `req_ids` / `num_reqs` properties read, read directly
        # where they are what the properties return: the two property calls (one a typing.cast) were
        # ~5 us a step inside the engine (benchmarks/capture.py, step.after_forward).
        self._direct = (type(getattr(ib, "_req_ids", None)) is list and ib.req_ids is ib._req_ids
                        and type(getattr(ib, "req_id_to_index", None)) is dict
                        and ib.num_reqs == len(ib.req_id_to_index))
        self._qsl, self._discard = r.query_start_loc.np, r.discard_request_mask.np
        self._host = torch.device(r.device).type in HOST_MIRROR_DEVICES
        self._slot_src = {}
        self._with_slots = {}
        if not self._host:
            return
        # the runner's host buffers, viewed once: a `.numpy()` per step is ~4 dispatcher ops
        src = {"qsl": self._qsl, "pos": r.positions.numpy(), "discard": self._discard}
        sizes = {"qsl": 2 * self.ring_tokens, "pos": self.ring_tokens, "discard": 2 * self.ring_tokens}
        for name, a in src.items():
            ring = self._rings.get(name)
            if ring is None or ring.array.dtype != a.dtype:
                self._rings[name] = HostRing(a.dtype, sizes[name])
        self._layout_src = tuple((self._rings[name], byte_view(a)) for name, a in src.items())

    def free_items(self) -> int:
        """Items the fullest host ring takes before it starts over (rings not made yet: ring_tokens;
        off host the layouts are copies and the rings are not used)."""
        return min((ring.capacity - ring.used for ring in self._rings.values()), default=self.ring_tokens)

    def rewind(self) -> None:
        """Start every host ring over: layouts and slots taken before are no longer valid, except
        the current step's layout (a listener that flushes inside a step keeps what another
        listener took of it before the forward)."""
        keep = {}
        if self.current is not None and self._host:
            lay = self.current
            keep = {id(r[0]): r[2] for r in (lay._qsl, lay._pos, lay._discard)}
        for ring in self._rings.values():
            ring.used = keep.get(id(ring.array), 0)

    def layout(self, n: int) -> StepLayout:
        """The current step's layout for its n scheduled tokens (taken once, then shared)."""
        if self.current is not None:
            return self.current
        if self._ib is not self.runner.input_batch:  # re-bound if the input batch is rebuilt
            self._bind()
        return self._take(n, self._layout_src)[0]

    def layout_slots(self, n: int, kv_group: int) -> "tuple[StepLayout, np.ndarray | RingRows]":
        """`layout(n)` and `slots(layout, kv_group)`; where the layout is not taken yet on a host
        runner, the slots ride in its one `take_rows` call (their own call was ~3 us a step inside
        the engine: bench model, compiled)."""
        if self.current is None:
            if self._ib is not self.runner.input_batch:  # re-bound if the input batch is rebuilt
                self._bind()
            if self._host:
                src = self._with_slots.get(kv_group)
                if src is None:
                    src = self._with_slots[kv_group] = self._layout_src + self._slot_source(kv_group)
                return self._take(n, src)
        layout = self.layout(n)
        return layout, self.slots(layout, kv_group)

    def _take(self, n: int, src: "tuple[tuple[HostRing, memoryview], ...]") -> "tuple[StepLayout, RingRows | None]":
        """Take the step's layout (and, on a host runner, the rows of any sources past the layout's
        three: the slots of `layout_slots`)."""
        ib, req_ids = self._ib, self._ids
        if self._direct:  # the input batch's live list (condensed: num_reqs long)
            num_reqs, ids = len(ib.req_id_to_index), ib._req_ids
        else:
            num_reqs, ids = ib.num_reqs, ib.req_ids
        if len(ids) != num_reqs or ids != req_ids:
            req_ids = self._ids = ids[:num_reqs]  # a slice: a new list
        if self._host:
            rows = take_rows(src, (num_reqs + 1, n, num_reqs, n))  # zip stops at the sources given
            self.current = StepLayout(req_ids, rows[0], rows[1], rows[2])
            return self.current, (rows[3] if len(rows) > 3 else None)
        qsl_B1 = self._qsl[: num_reqs + 1].copy()
        row_T = np.repeat(np.arange(num_reqs), np.diff(qsl_B1))
        pos_T = ib.num_computed_tokens_cpu[row_T].astype(np.int64) + np.arange(n) - qsl_B1[row_T]
        self.current = StepLayout(req_ids, qsl_B1, pos_T, self._discard[:num_reqs].copy())
        return self.current, None

    def _slot_source(self, kv_group: int) -> "tuple[tuple[HostRing, memoryview]]":
        """Host runners: `kv_group`'s slot ring and a byte view of vLLM's slot mapping, bound once
        per input batch."""
        # the tensor vLLM's kernel writes: on CPU runners `.gpu` is a host tensor, and it is not
        # always `.cpu` (an input batch rebuilt for a hybrid KV layout gets separate buffers)
        mapping = self._ib.block_table.block_tables[kv_group].slot_mapping.gpu
        if not mapping.is_contiguous() or mapping.dtype != torch.int64:
            raise RuntimeError(f"vLLM slot mapping of KV group {kv_group} is {mapping.dtype}, not contiguous int64")
        name = f"slots{kv_group}"
        if name not in self._rings:
            self._rings[name] = HostRing(np.dtype(np.int64), self.ring_tokens)
        bound = self._slot_src[kv_group] = ((self._rings[name], byte_view(mapping.numpy())),)
        return bound

    def slots(self, layout: StepLayout, kv_group: int) -> "np.ndarray | RingRows":
        """KV slot of each forwarded token in `kv_group`'s block table (`rows_of` gives the array)."""
        n = layout.num_tokens
        if self._host:
            bound = self._slot_src.get(kv_group)  # per step: one lookup (the first time, the buffers)
            return take_rows(bound or self._slot_source(kv_group), (n,))[0]
        bt = self._ib.block_table.block_tables[kv_group]
        row_T = np.repeat(np.arange(len(layout.req_ids)), np.diff(layout.qsl_B1))
        size = int(bt.block_size)
        return kv_slots(bt.block_table.np[row_T, layout.pos_T // size], layout.pos_T, size)
