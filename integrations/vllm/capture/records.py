"""Worker-side bookkeeping: one record per engine request, its rows in the worker's row log.

Routes are indexed by token position (rewrites after preemption land on the same rows), sampling
rows by generated-token index g (position prompt_len + g). The rows themselves stay in the row log
(row_log.py) as the flushes handed them over, and are laid out per record when the client takes
records, all taken records together. Records stay on the worker until the client takes them;
finished ones beyond `max_unclaimed` are evicted oldest first and remembered, so a late take says
"evicted" instead of returning a gap.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from typing import Any

import numpy as np

from ..step import external_id
from ..wire import CaptureRecord
from .row_log import RowLog


_UIDS = itertools.count()


class RequestRecord:
    """One engine request's capture (child requests of n > 1 are separate records): its ids and
    the problems found while capturing it; its rows are in the book's row log under `uid`."""

    def __init__(self, req_id: str, prompt_len: int, route_start: int, L: int, K: int, route_dtype: np.dtype) -> None:
        self.req_id = req_id
        self.prompt_len = prompt_len
        self.route_start = route_start
        self.L, self.K, self.route_dtype = L, K, np.dtype(route_dtype)
        self.uid = next(_UIDS)
        """Process-unique integer: how flushes and takes find a record's rows with array ops."""
        self.problems: list[str] = []
        self.preempted = False
        """The scheduler preempted (and recomputed) this request at least once."""


class RecordBook:
    """All live and unclaimed records of one worker, keyed by internal request id."""

    def __init__(self, max_unclaimed: int, log: RowLog) -> None:
        self.max_unclaimed = max_unclaimed
        self.log = log
        """Every record's rows until taken (row_log.py)."""
        self.live: dict[str, RequestRecord] = {}
        self.finished: OrderedDict[str, RequestRecord] = OrderedDict()
        self.evicted: deque[str] = deque(maxlen=4 * max_unclaimed)
        self.taken: deque[str] = deque(maxlen=4096)
        self._taken_set: set[str] = set()

    def get(self, req_id: str) -> RequestRecord | None:
        return self.live.get(req_id)

    def holds(self, rec: RequestRecord) -> bool:
        """Whether `rec` is still live or unclaimed (not taken, discarded or evicted)."""
        return self.live.get(rec.req_id) is rec or self.finished.get(rec.req_id) is rec

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
        gone = []
        while len(self.finished) > self.max_unclaimed:
            old, old_rec = self.finished.popitem(last=False)
            self.evicted.append(old)
            gone.append(old_rec.uid)
        self.log.drop(gone)

    def _match(self, key: str) -> list[str]:
        return [rid for rid in (*self.finished, *self.live) if rid == key or external_id(rid) == key]

    def _by_key(self) -> dict[str, list[str]]:
        """Every key `_match` answers, to the ids it answers with (in its order): one pass over the
        held records per take, not one per key taken."""
        out: dict[str, list[str]] = {}
        for rid in (*self.finished, *self.live):
            out.setdefault(rid, []).append(rid)
            ext = external_id(rid)
            if ext != rid:
                out.setdefault(ext, []).append(rid)
        return out

    def take(self, keys: list[str]) -> list[CaptureRecord]:
        """Remove and return the records of `keys` (internal ids, or external ids as vLLM outputs
        them), their arrays laid out together (row_log.RowLog.take)."""
        out: list[CaptureRecord | RequestRecord] = []
        held = self._by_key()
        for key in keys:
            matches = [rid for rid in held.get(key, ()) if rid in self.finished or rid in self.live]  # not taken just now
            if not matches:
                status = "evicted" if any(r == key or external_id(r) == key for r in self.evicted) else "unknown"
                out.append(CaptureRecord(status, key=key, known=len(self.finished) + len(self.live)))
                continue
            if len(matches) > 1:
                out.append(CaptureRecord("ambiguous", key=key, matches=matches))
                continue
            rid = matches[0]
            out.append(self.finished.pop(rid, None) or self.live.pop(rid))
            if len(self.taken) == self.taken.maxlen:
                self._taken_set.discard(self.taken[0])
            self.taken.append(rid)
            self._taken_set.add(rid)
        recs = [r for r in out if isinstance(r, RequestRecord)]
        arrays = iter(self.log.take(np.array([r.uid for r in recs], dtype=np.int64),
                                    np.array([r.route_start for r in recs], dtype=np.int64),
                                    np.array([r.prompt_len for r in recs], dtype=np.int64)))
        return [_payload(r, next(arrays)) if isinstance(r, RequestRecord) else r for r in out]

    def discard(self, key: str) -> int:
        matches = self._match(key)
        gone = []
        for rid in matches:
            rec = self.finished.pop(rid, None) or self.live.pop(rid, None)
            if rec is not None:
                gone.append(rec.uid)
        self.log.drop(gone)
        return len(matches)


def _payload(rec: RequestRecord, a: Any) -> CaptureRecord:
    """The record for the RPC reply; the client cuts it to the final sequence length."""
    return CaptureRecord(
        "ok", key=rec.req_id, req_id=rec.req_id, prompt_len=rec.prompt_len, route_start=rec.route_start,
        routes_TLK=a.routes_TLK, routes_filled_T=a.routes_filled_T, tokens_G=a.tokens_G, logprobs_G=a.logprobs_G,
        support_sizes_G=a.sizes_G, support_offsets_G1=a.offsets_G1, support_ids_N=a.ids_N,
        problems=rec.problems + a.problems, rerouted=a.rerouted_P.tolist(), stale=a.stale_G.tolist(),
        preempted=rec.preempted)
