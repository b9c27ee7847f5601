"""Worker-side bookkeeping: one growing record per engine request, filled step by step.

Routes are indexed by token position (rewrites after preemption land on the same rows), sampling
rows by generated-token index g (position prompt_len + g). Records stay on the worker until the
client takes them; finished ones beyond `max_unclaimed` are evicted oldest first and remembered,
so a late take says "evicted" instead of returning a gap.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from typing import Any

import numpy as np

from ..step import external_id
from ..wire import CaptureRecord


_UIDS = itertools.count()


class RequestRecord:
    """Captured rows of one engine request (child requests of n > 1 are separate records).

    The worker hands rows over in pieces, one per flush (worker.py); `payload()` assembles them
    once, when the client takes the record. Later pieces win where positions repeat (a request
    preempted and recomputed writes the same positions again; the newest draw is the kept one).
    """

    def __init__(self, req_id: str, prompt_len: int, route_start: int, L: int, K: int, route_dtype: np.dtype) -> None:
        self.req_id = req_id
        self.prompt_len = prompt_len
        self.route_start = route_start
        self.L, self.K, self.route_dtype = L, K, np.dtype(route_dtype)
        self.uid = next(_UIDS)
        """Process-unique integer: how flushes group rows by record with array ops."""
        self._route_pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]] = []
        """(positions [T], routes [T, L, K], valid [T] or None) in arrival order."""
        self._sample_pieces: list[tuple[np.ndarray, np.ndarray, Any]] = []
        """(generated index g [X], stage rows [X], StagedSamples of that flush) in arrival order."""
        self.problems: list[str] = []

    def write_routes(self, start_pos: int, rows_TLK: np.ndarray, valid_T: np.ndarray | None = None) -> None:
        """Rows of consecutive positions start_pos, start_pos + 1, ... (prefix-cache reads)."""
        self.write_routes_at(np.arange(start_pos, start_pos + len(rows_TLK)), rows_TLK, valid_T)

    def write_routes_at(self, pos_T: np.ndarray, rows_TLK: np.ndarray, valid_T: np.ndarray | None = None) -> None:
        self._route_pieces.append((pos_T, rows_TLK, valid_T))

    def write_samples(self, g_X: np.ndarray, rows_X: np.ndarray, staged: Any) -> None:
        self._sample_pieces.append((g_X, rows_X, staged))

    def _routes(self) -> tuple[np.ndarray, np.ndarray]:
        """(routes [P, L, K], filled [P]) indexed by position - route_start, P = last filled + 1."""
        pos = [p for p, _, _ in self._route_pieces]
        stop = max((int(p.max()) + 1 for p in pos if len(p)), default=self.route_start)
        n = max(stop - self.route_start, 0)
        routes = np.zeros((n, self.L, self.K), dtype=self.route_dtype)
        filled = np.zeros(n, dtype=bool)
        for pos_T, rows_TLK, valid_T in self._route_pieces:
            keep = pos_T >= self.route_start
            if not keep.all():
                pos_T, rows_TLK = pos_T[keep], rows_TLK[keep]
                valid_T = None if valid_T is None else valid_T[keep]
            r = pos_T - self.route_start
            last = last_occurrence(r)  # a piece may repeat a position (recompute after preemption)
            routes[r[last]] = rows_TLK[last]
            filled[r[last]] = True if valid_T is None else valid_T[last]
        n_rows = int(np.flatnonzero(filled)[-1]) + 1 if filled.any() else 0
        return routes[:n_rows], filled[:n_rows]

    def _samples(self) -> dict[str, np.ndarray]:
        """Per generated index g: token, logprob, support size and CSR ids (newest draw wins)."""
        if not self._sample_pieces:
            cols = {"tokens": np.zeros(0, np.int64), "logprobs": np.zeros(0, np.float32),
                    "sizes": np.zeros(0, np.int64)}
            return {**cols, "offsets": np.zeros(1, np.int64), "ids": np.zeros(0, np.int32)}
        g_all = np.concatenate([g for g, _, _ in self._sample_pieces])
        last = last_occurrence(g_all)
        order = last[np.argsort(g_all[last], kind="stable")]
        G = int(g_all.max()) + 1
        if len(order) != G:
            missing = sorted(set(range(G)) - set(g_all.tolist()))[:1]
            self.problems.append(f"sample for generated token {missing[0]} never arrived ({len(order)} of {G})")
            order = order[: int(np.searchsorted(g_all[order], missing[0]))]
        piece_of = np.concatenate([np.full(len(g), i) for i, (g, _, _) in enumerate(self._sample_pieces)])
        row_of = np.concatenate([r for _, r, _ in self._sample_pieces])
        piece_X, row_X = piece_of[order], row_of[order]  # X: kept entries, in g order
        X = len(order)
        tokens, lps = np.zeros(X, np.int64), np.zeros(X, np.float32)
        sizes, counts = np.zeros(X, np.int64), np.zeros(X, np.int64)
        outside = np.zeros(X, dtype=bool)
        for i, (_, _, staged) in enumerate(self._sample_pieces):
            m = piece_X == i
            rows = row_X[m]
            tokens[m], lps[m], sizes[m] = staged.tokens_R[rows], staged.logprobs_R[rows], staged.sizes_R[rows]
            counts[m] = staged.offsets_R1[rows + 1] - staged.offsets_R1[rows]
            if staged.outside_R is not None:
                outside[m] = staged.outside_R[rows]
        if outside.any():
            g = int(np.flatnonzero(outside)[0])
            self.problems.append(
                f"sampled token {int(tokens[g])} of generated token {g} is outside its recorded sampling support "
                f"({int(sizes[g])} tokens; {int(outside.sum())} such rows): the sampler drew from another set "
                "than the one recorded (see sampler_hook.py: exactness)")
        offsets = np.zeros(X + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        ids = np.zeros(int(offsets[-1]), dtype=np.int32)
        for i, (_, _, staged) in enumerate(self._sample_pieces):
            m = np.flatnonzero(piece_X == i)
            c = counts[m]
            within = ranks_within(c)
            ids[np.repeat(offsets[m], c) + within] = staged.ids_N[np.repeat(staged.offsets_R1[row_X[m]], c) + within]
        return {"tokens": tokens, "logprobs": lps, "sizes": sizes, "offsets": offsets, "ids": ids}

    def payload(self) -> CaptureRecord:
        """The record for the RPC reply; the client cuts it to the final sequence length."""
        routes, filled = self._routes()
        s = self._samples()
        return CaptureRecord(
            "ok", key=self.req_id, req_id=self.req_id, prompt_len=self.prompt_len, route_start=self.route_start,
            routes_TLK=routes, routes_filled_T=filled, tokens_G=s["tokens"], logprobs_G=s["logprobs"],
            support_sizes_G=s["sizes"], support_offsets_G1=s["offsets"], support_ids_N=s["ids"],
            problems=list(self.problems))


def ranks_within(counts: np.ndarray) -> np.ndarray:
    """For segments of these lengths laid end to end, each element's index inside its segment."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def last_occurrence(keys: np.ndarray) -> np.ndarray:
    """Ascending indices of the last occurrence of each distinct key (the newest write wins)."""
    if len(keys) < 2:
        return np.arange(len(keys))
    _, first_in_reversed = np.unique(keys[::-1], return_index=True)
    return np.sort(len(keys) - 1 - first_in_reversed)


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

    def take(self, key: str) -> CaptureRecord:
        """Remove and return the record of `key` (internal id, or external id as vLLM outputs it)."""
        matches = self._match(key)
        if not matches:
            status = "evicted" if any(r == key or external_id(r) == key for r in self.evicted) else "unknown"
            return CaptureRecord(status, key=key, known=len(self.finished) + len(self.live))
        if len(matches) > 1:
            return CaptureRecord("ambiguous", key=key, matches=matches)
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
