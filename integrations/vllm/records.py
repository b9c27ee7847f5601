"""Worker-side bookkeeping: one growing record per engine request, filled step by step.

Routes are indexed by token position (rewrites after preemption land on the same rows), sampling
rows by generated-token index g (position prompt_len + g). Records stay on the worker until the
client takes them; finished ones beyond `max_unclaimed` are evicted oldest first and remembered,
so a late take says "evicted" instead of returning a gap.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

import numpy as np


def pack_array(arr: np.ndarray) -> dict[str, Any]:
    """Array as plain bytes + dtype + shape: survives every RPC serialiser vLLM uses unchanged."""
    arr = np.ascontiguousarray(arr)
    return {"dtype": arr.dtype.str, "shape": list(arr.shape), "data": arr.tobytes()}


def unpack_array(d: Any) -> np.ndarray:
    if isinstance(d, dict) and "data" in d:
        return np.frombuffer(d["data"], dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()
    return np.asarray(d)


def external_id(internal_id: str) -> str:
    """'3-a1b2c3d4' -> '3' (vLLM appends '-' + 8 random chars to every request id)."""
    head, sep, tail = internal_id.rpartition("-")
    return head if sep and len(tail) == 8 else internal_id


class RequestRecord:
    """Captured rows of one engine request (child requests of n > 1 are separate records)."""

    def __init__(self, req_id: str, prompt_len: int, route_start: int, L: int, K: int, route_dtype: np.dtype) -> None:
        self.req_id = req_id
        self.prompt_len = prompt_len
        self.route_start = route_start
        self.routes_PLK = np.zeros((max(prompt_len + 16 - route_start, 16), L, K), dtype=route_dtype)
        self.filled_P = np.zeros(len(self.routes_PLK), dtype=bool)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.sizes: list[int] = []
        self.support_rows: list[np.ndarray] = []
        self.problems: list[str] = []

    def _grow(self, stop_row: int) -> None:
        if stop_row > len(self.routes_PLK):
            new = max(stop_row, 2 * len(self.routes_PLK))
            routes = np.zeros((new, *self.routes_PLK.shape[1:]), dtype=self.routes_PLK.dtype)
            routes[: len(self.routes_PLK)] = self.routes_PLK
            filled = np.zeros(new, dtype=bool)
            filled[: len(self.filled_P)] = self.filled_P
            self.routes_PLK, self.filled_P = routes, filled

    def write_routes(self, start_pos: int, rows_TLK: np.ndarray, valid_T: np.ndarray | None = None) -> None:
        lo = max(start_pos, self.route_start)
        if lo >= start_pos + len(rows_TLK):
            return
        rows_TLK = rows_TLK[lo - start_pos :]
        r0 = lo - self.route_start
        self._grow(r0 + len(rows_TLK))
        self.routes_PLK[r0 : r0 + len(rows_TLK)] = rows_TLK
        self.filled_P[r0 : r0 + len(rows_TLK)] = True if valid_T is None else valid_T[lo - start_pos :]

    def write_sample(self, g: int, token: int, logprob: float, size: int, ids: np.ndarray) -> None:
        if g == len(self.tokens):
            self.tokens.append(token)
            self.logprobs.append(logprob)
            self.sizes.append(size)
            self.support_rows.append(ids)
        elif g < len(self.tokens):  # re-sampled after preemption: the newest draw is the kept one
            self.tokens[g], self.logprobs[g], self.sizes[g], self.support_rows[g] = token, logprob, size, ids
        else:
            self.problems.append(f"sample for generated token {g} arrived after only {len(self.tokens)} samples")

    def payload(self) -> dict[str, Any]:
        """Plain arrays for the RPC reply; the client cuts them to the final sequence length."""
        sizes = np.asarray(self.sizes, dtype=np.int64)
        counts = np.array([len(r) for r in self.support_rows], dtype=np.int64)
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        ids = np.concatenate(self.support_rows).astype(np.int32) if self.support_rows else np.zeros(0, np.int32)
        filled = self.filled_P
        n_rows = int(np.flatnonzero(filled)[-1]) + 1 if filled.any() else 0
        return {
            "status": "ok",
            "req_id": self.req_id,
            "prompt_len": self.prompt_len,
            "route_start": self.route_start,
            "routes": pack_array(self.routes_PLK[:n_rows]),
            "routes_filled": pack_array(filled[:n_rows]),
            "tokens": pack_array(np.asarray(self.tokens, dtype=np.int64)),
            "logprobs": pack_array(np.asarray(self.logprobs, dtype=np.float32)),
            "support_sizes": pack_array(sizes),
            "support_offsets": pack_array(offsets),
            "support_ids": pack_array(ids),
            "problems": list(self.problems),
        }


class RecordBook:
    """All live and unclaimed records of one worker, keyed by internal request id."""

    def __init__(self, max_unclaimed: int) -> None:
        self.max_unclaimed = max_unclaimed
        self.live: dict[str, RequestRecord] = {}
        self.finished: OrderedDict[str, RequestRecord] = OrderedDict()
        self.evicted: deque[str] = deque(maxlen=4 * max_unclaimed)
        self.taken: deque[str] = deque(maxlen=4096)
        self._taken_set: set[str] = set()

    def get(self, req_id: str) -> RequestRecord | None:
        return self.live.get(req_id)

    def add(self, record: RequestRecord) -> RequestRecord | None:
        """Register a new live record; None when this id was already taken by the client."""
        if record.req_id in self._taken_set:
            return None
        self.live[record.req_id] = record
        return record

    def finish(self, req_id: str) -> None:
        rec = self.live.pop(req_id, None)
        if rec is None:
            return
        self.finished[req_id] = rec
        while len(self.finished) > self.max_unclaimed:
            old, _ = self.finished.popitem(last=False)
            self.evicted.append(old)

    def _match(self, key: str) -> list[str]:
        return [rid for rid in (*self.finished, *self.live) if rid == key or external_id(rid) == key]

    def take(self, key: str) -> dict[str, Any]:
        """Remove and return the record of `key` (internal id, or external id as vLLM outputs it)."""
        matches = self._match(key)
        if not matches:
            status = "evicted" if any(r == key or external_id(r) == key for r in self.evicted) else "unknown"
            return {"status": status, "key": key, "known": len(self.finished) + len(self.live)}
        if len(matches) > 1:
            return {"status": "ambiguous", "key": key, "matches": matches}
        rid = matches[0]
        rec = self.finished.pop(rid, None) or self.live.pop(rid)
        if len(self.taken) == self.taken.maxlen:
            self._taken_set.discard(self.taken[0])
        self.taken.append(rid)
        self._taken_set.add(rid)
        return rec.payload()

    def discard(self, key: str) -> int:
        matches = self._match(key)
        for rid in matches:
            self.finished.pop(rid, None)
            self.live.pop(rid, None)
        return len(matches)
