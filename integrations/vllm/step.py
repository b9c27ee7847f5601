"""One engine step's layout, read once and shared by capture (capture/worker.py) and scoring: the
types every model runner's port fills (runners/: where the rows come from on each runner).

Which request owns which rows of a step: the engine request ids (B, in batch order; `external_id`
drops vLLM's suffix to give the client's id), the query start offsets (B + 1), each forwarded
token's position (T) and the rows whose sample the runner throws away (a chunked prefill short of
its prompt end). KV slots (capture's prefix-cache route cache) are read per KV-cache group on
demand (`kv_slots`). Host runners copy their buffers' rows into host rings (HostRing: no numpy or
ctypes call inside the step); a speculative step's outcome per row is a `SpecRows`.

The layout is taken once per step (`RunnerPort.layout`), by whichever listener asks first: scoring
asks before the forward (StepBracket.before_forward), capture after it; both see the same arrays.
Legend: B requests of the step, T tokens forwarded in it."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

HOST_MIRROR_DEVICES = {"cpu"}
"""Runner device types whose `positions` and slot mapping are host tensors, read as they are."""


RingRows = tuple
"""(ring array, start, stop): rows [start, stop) of a host ring (`HostRing`), viewed only when
read (`rows_of`), so taking a step's rows inside the engine's step runs no numpy and makes no
object with a Python __init__ (a tuple: see HostRing for why)."""


GREEDY_EPS = 1e-5
"""Below this temperature a row is greedy: a point mass at its token (vllm.v1.sample.sampler._SAMPLING_EPS;
Model Runner V2 treats exactly 0.0 so). The stage (capture/sampler_hook.py) and both runner ports read it."""


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


@dataclass(frozen=True)
class SpecRows:
    """One speculative step's outcome per request row, in batch order."""

    drafts_B: np.ndarray
    """int64 draft tokens forwarded after the row's last sampled token (n_b)."""
    emitted_B: np.ndarray
    """int64 tokens emitted (a_b + 1: accepted drafts, then one recovered or bonus token)."""
