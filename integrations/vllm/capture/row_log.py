"""Captured rows kept as the flushes hand them over, laid out per record only when taken.

A flush hands over its whole window at once (worker.py): route rows (record uid, position, expert
ids) and sampler rows (record uid, generated index g, the flush's kept sets). Each is kept as one
block, as it came; a prefix-cache read is a block of its own. A take picks the rows of every
record it takes out of every block and lays them out record after record with a handful of array
ops per block, so neither a flush nor a take runs array work per record. Why: per-record pieces
cost one fancy-index copy per record at each flush and ~40 numpy calls per record at each take;
take.assemble was the largest part of capture's host time (32%, benchmarks/capture.py
`breakdown`, compiled, 8 records x 16 tokens).

Newest wins: where a record's position (or g) comes several times (a preempted request is
recomputed), the row that arrived last is kept: blocks in arrival order, rows in order in a block.
Provenance: every row carries the engine step it was computed in. Where a position's rows differ
(a recompute preemption's re-prefill routed a token otherwise than the forward that first routed
it: batch-variant numerics), the position is named (`Assembled.rerouted_P`), and so is every
sampled token that depended on the superseded route (`stale_G`): a token at position q was sampled
from the forward of q - 1, which attended to every position before it, so it is stale when some
position <= q - 1 got its final route only after the step the token was sampled in. The trace keeps
the newest route (the one every later token was sampled with); trainers mask the stale tokens
(moe_replay.trace.Rerouted). Rows that agree, the usual case, cost one comparison per repeat.

Memory: rows of taken, discarded and evicted records are marked dead; a block is compacted once
half its rows are dead and dropped once all are, so the log holds at most about twice the rows of
the records not yet taken.

Legend: A rows (of a block, or picked from all blocks), E entries left after newest-wins, U records
taken together, L MoE layers, K top-k, N kept ids (CSR).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


def ranks_within(counts: np.ndarray) -> np.ndarray:
    """For segments of these lengths laid end to end, each element's index inside its segment."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def last_occurrence(keys: np.ndarray) -> np.ndarray:
    """Ascending indices of the last occurrence of each distinct key (the newest write wins)."""
    if len(keys) < 2:
        return np.arange(len(keys))
    _, first_in_reversed = np.unique(keys[::-1], return_index=True)
    return np.sort(len(keys) - 1 - first_in_reversed)


def newest_by_key(keys: np.ndarray) -> np.ndarray:
    """Index of the last occurrence of each distinct key, in ascending key order: a stable sort
    keeps equal keys in arrival order, so each run's last element is the newest (np.unique on the
    reversed keys does the same with twice the numpy calls)."""
    order = np.argsort(keys, kind="stable")
    srt = keys[order]
    ends = np.flatnonzero(srt[1:] != srt[:-1])
    return order[np.append(ends, len(keys) - 1)] if len(keys) else order


def segment_gather(ids_N: np.ndarray, start_X: np.ndarray, count_X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR (offsets [X + 1], ids) of the segments ids_N[start:start + count], laid end to end.

    The source index of every output id is one cumsum of a ones array with a jump at each
    segment's first id: three passes over the ids (np.repeat + ranks_within took six)."""
    offsets = np.zeros(len(count_X) + 1, dtype=np.int64)
    np.cumsum(count_X, out=offsets[1:])
    n = int(offsets[-1])
    if not n:
        return offsets, ids_N[:0]
    nz = np.flatnonzero(count_X)
    first, start, count = offsets[nz], start_X[nz], count_X[nz]
    step = np.ones(n, dtype=np.int64)
    step[first[1:]] = start[1:] - (start[:-1] + count[:-1] - 1)  # from the previous segment's last id
    step[0] = start[0]
    return offsets, ids_N[np.cumsum(step, out=step)]


def csr_rows(offsets_R1: np.ndarray, ids_N: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR (offsets, ids) of `rows` of a CSR, in that order."""
    return segment_gather(ids_N, offsets_R1[rows], offsets_R1[rows + 1] - offsets_R1[rows])


def superseded(key_K: np.ndarray, rows_KLK: np.ndarray, step_K: np.ndarray, valid_K: np.ndarray,
               rec_K: np.ndarray, rel_K: np.ndarray):
    """(record, positions, steps) of the repeated keys whose rows differ from their newest row: per
    record, the positions whose route a later forward changed and the step of the first row of the
    final run of equal rows (from then on the route the trace keeps was in effect). Rows of a key
    arrive in order (a stable sort keeps it); rows known missing (prefix reads, `valid` False) are
    not compared."""
    order = np.argsort(key_K, kind="stable")
    srt = key_K[order]
    start = np.flatnonzero(np.r_[True, srt[1:] != srt[:-1]])
    size = np.diff(np.r_[start, len(srt)])
    rep = np.flatnonzero(size > 1)
    if not len(rep):
        return []
    gid = np.repeat(np.arange(len(start)), size)
    last = start + size - 1  # the newest row of each key, in sorted order
    in_rep = np.flatnonzero(size[gid] > 1)
    a, b = order[in_rep], order[last[gid[in_rep]]]
    flat = rows_KLK.reshape(len(rows_KLK), -1)
    differs = (flat[a] != flat[b]).any(axis=1) & valid_K[a] & valid_K[b]
    if not differs.any():
        return []
    # per changed key: the last differing row (sorted position), then the row after it
    pos_in_sorted = in_rep[differs]
    g_changed = gid[pos_in_sorted]
    last_diff = np.zeros(len(start), dtype=np.int64) - 1
    np.maximum.at(last_diff, g_changed, pos_in_sorted)
    groups = np.flatnonzero(last_diff >= 0)
    since = step_K[order[last_diff[groups] + 1]]
    first = order[start[groups]]
    rec_G, rel_G = rec_K[first], rel_K[first]
    out = []
    for u in np.unique(rec_G):
        m = rec_G == u
        out.append((int(u), rel_G[m], since[m]))
    return out


def stale_rows(rerouted_P: np.ndarray, since_P: np.ndarray, prompt_len: int, steps_G: np.ndarray) -> np.ndarray:
    """Generated rows g (token at position prompt_len + g) sampled in a step before some position
    <= prompt_len + g - 1 got its final route (`superseded`): int64, ascending."""
    order = np.argsort(rerouted_P)
    p, t = rerouted_P[order], np.maximum.accumulate(since_P[order])
    q1_G = prompt_len + np.arange(len(steps_G)) - 1  # the position whose forward sampled row g
    i = np.searchsorted(p, q1_G, side="right") - 1  # the last rerouted position <= q - 1
    need_G = np.where(i >= 0, t[np.maximum(i, 0)], np.iinfo(np.int64).min)
    return np.flatnonzero(steps_G < need_G).astype(np.int64)


class _Block:
    """Rows of one flush (or one prefix read): row-aligned columns, an optional CSR, a dead mask."""

    __slots__ = ("cols", "offsets", "ids", "dead", "ndead")

    def __init__(self, cols: dict[str, np.ndarray], offsets: np.ndarray | None = None,
                 ids: np.ndarray | None = None) -> None:
        self.cols, self.offsets, self.ids = cols, offsets, ids
        self.dead = cols["uid"] < 0  # rows of no record (scoring requests, taken records)
        self.ndead = int(self.dead.sum())

    def __len__(self) -> int:
        return len(self.dead)

    def rows(self, idx: np.ndarray) -> tuple[dict[str, np.ndarray], tuple[np.ndarray, np.ndarray] | None]:
        cols = {k: v[idx] for k, v in self.cols.items()}
        return cols, (None if self.offsets is None else csr_rows(self.offsets, self.ids, idx))

    def segments(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(first id, id count) of CSR rows idx."""
        start = self.offsets[idx]
        return start, self.offsets[idx + 1] - start

    def compact(self) -> None:
        live = np.flatnonzero(~self.dead)
        self.cols, csr = self.rows(live)
        if csr is not None:
            self.offsets, self.ids = csr
        self.dead = np.zeros(len(live), dtype=bool)
        self.ndead = 0


@dataclass
class Assembled:
    """One taken record's arrays (views into the take's shared arrays) and its assembly problems."""

    routes_TLK: np.ndarray
    routes_filled_T: np.ndarray
    tokens_G: np.ndarray
    logprobs_G: np.ndarray
    sizes_G: np.ndarray
    offsets_G1: np.ndarray
    ids_N: np.ndarray
    steps_G: np.ndarray
    """Engine step each sample was drawn in."""
    problems: list[str] = field(default_factory=list)
    rerouted_P: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Positions whose route a later forward changed (the row log's module docstring)."""
    stale_G: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Generated rows g sampled before a route they depended on was changed."""


class RowLog:
    """Every flush's route and sampler rows until their records are taken (see the module docstring)."""

    def __init__(self, L: int, K: int, route_dtype: Any) -> None:
        self.L, self.K, self.route_dtype = L, K, np.dtype(route_dtype)
        self.route_blocks: list[_Block] = []
        self.sample_blocks: list[_Block] = []
        self._adds = 0
        """Rows added without engine steps (tests) count each add as one step."""

    def _steps(self, n: int, step_A: np.ndarray | None) -> np.ndarray:
        self._adds += 1
        return np.full(n, -(1 << 40) + self._adds, dtype=np.int64) if step_A is None else np.asarray(step_A, np.int64)

    def add_routes(self, uid_A: np.ndarray, pos_A: np.ndarray, rows_ALK: np.ndarray,
                   valid_A: np.ndarray | None = None, step_A: np.ndarray | None = None) -> None:
        """Route rows in arrival order; valid_A False marks a row known to be missing (prefix reads);
        step_A: the engine step each row was computed in (None: this add's arrival)."""
        valid = np.ones(len(uid_A), dtype=bool) if valid_A is None else np.asarray(valid_A, dtype=bool)
        self._add(self.route_blocks, _Block({"uid": uid_A, "key": pos_A, "rows": rows_ALK, "valid": valid,
                                             "step": self._steps(len(uid_A), step_A)}))

    def add_samples(self, uid_A: np.ndarray, g_A: np.ndarray, staged: Any, step_A: np.ndarray | None = None) -> None:
        """Sampler rows: row a of `staged` (sampler_hook.StagedSamples) is generated index g_A[a]
        of record uid_A[a] (-1: a row nobody keeps), sampled in engine step step_A[a]."""
        outside = np.zeros(len(uid_A), dtype=bool) if staged.outside_R is None else staged.outside_R
        cols = {"uid": uid_A, "key": g_A, "tokens": staged.tokens_R, "logprobs": staged.logprobs_R,
                "sizes": staged.sizes_R, "outside": outside, "step": self._steps(len(uid_A), step_A)}
        self._add(self.sample_blocks, _Block(cols, staged.offsets_R1, staged.ids_N))

    @staticmethod
    def _add(blocks: list[_Block], block: _Block) -> None:
        if block.ndead < len(block):
            blocks.append(block)

    @property
    def rows(self) -> int:
        """Rows held, dead ones included (what the memory bound is about)."""
        return sum(len(b) for b in self.route_blocks) + sum(len(b) for b in self.sample_blocks)

    # -- take / drop ---------------------------------------------------------------------------
    def _pick(self, blocks: list[_Block], uid_U: np.ndarray, gather: bool = True):
        """Rows of the records uid_U out of every block, in arrival order, marked dead there:
        (record index into uid_U per row, columns, the CSR ids of the blocks or None); None when
        no row matched. A CSR row's ids are not copied here: column "id0" is where they start in
        the returned ids (once, in the record's order, at the end of the take)."""
        order = np.argsort(uid_U, kind="stable")
        sorted_U = uid_U[order]
        recs, cols, ids, base = [], [], [], 0
        for blk in blocks:
            uid = blk.cols["uid"]
            j = np.searchsorted(sorted_U, uid)
            np.minimum(j, len(sorted_U) - 1, out=j)
            hit = sorted_U[j] == uid
            if blk.ndead:
                hit &= ~blk.dead
            n = int(np.count_nonzero(hit))
            if not n:
                continue
            whole = n == len(uid)  # every row is taken (a prefix read, a window of these records only)
            idx = None if whole else np.flatnonzero(hit)
            if whole:
                blk.dead[:] = True
            else:
                blk.dead[idx] = True
            blk.ndead += n
            if gather:  # a whole block's columns are handed over as they are: it is dropped below
                recs.append(order[j] if whole else order[j[idx]])
                cols.append(dict(blk.cols) if whole else {k: v[idx] for k, v in blk.cols.items()})
                if blk.offsets is not None:
                    if whole:
                        cols[-1]["id0"], cols[-1]["nids"] = blk.offsets[:-1] + base, blk.offsets[1:] - blk.offsets[:-1]
                    else:
                        cols[-1]["id0"], cols[-1]["nids"] = blk.segments(idx)
                        cols[-1]["id0"] += base
                    ids.append(blk.ids)
                    base += len(blk.ids)
        if gather and recs:  # the ids before compaction moves them
            ids = np.concatenate(ids) if len(ids) > 1 else (ids[0] if ids else None)
        blocks[:] = [b for b in blocks if b.ndead < len(b)]
        for b in blocks:
            if 2 * b.ndead > len(b):
                b.compact()
        if not recs:
            return None
        if len(cols) == 1:
            return recs[0], cols[0], ids
        joined = {k: np.concatenate([c[k] for c in cols]) for k in cols[0]}
        return np.concatenate(recs), joined, ids

    def drop(self, uids: list[int]) -> None:
        """Forget the rows of these records (discarded or evicted)."""
        if not uids or not (self.route_blocks or self.sample_blocks):
            return
        uid_U = np.asarray(uids, dtype=np.int64)
        self._pick(self.route_blocks, uid_U, gather=False)
        self._pick(self.sample_blocks, uid_U, gather=False)

    def take(self, uid_U: np.ndarray, route_start_U: np.ndarray,
             prompt_len_U: np.ndarray | None = None) -> list[Assembled]:
        """The arrays of records uid_U (routes from each one's route_start), in that order; their
        rows leave the log. `prompt_len_U` places generated row g at position prompt_len + g for the
        provenance check (module docstring; None: no rerouted position can make a row stale)."""
        U = len(uid_U)
        if not U:
            return []
        problems: list[list[str]] = [[] for _ in range(U)]
        start_U = np.asarray(route_start_U, dtype=np.int64)
        changes: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        routes = self._routes(U, self._pick(self.route_blocks, uid_U), start_U, changes)
        samples = self._samples(U, self._pick(self.sample_blocks, uid_U), problems)
        out = [Assembled(*routes[u], *samples[u], problems=problems[u]) for u in range(U)]
        for u, (rel_C, since_C) in changes.items():  # (only where a repeated position's rows differ)
            a = out[u]
            a.rerouted_P = rel_C + start_U[u]
            if prompt_len_U is not None and len(a.tokens_G):
                a.stale_G = stale_rows(a.rerouted_P, since_C, int(prompt_len_U[u]), a.steps_G)
        return out

    def _routes(self, U: int, picked, start_U: np.ndarray,
                changes: dict[int, tuple[np.ndarray, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per record: routes [P, L, K] and filled [P] by position - route_start, P = last filled + 1
        (rows never written are zeros, not filled); `changes` gets, per record whose repeated
        positions' rows differ, (those positions - route_start, the step each got its final route)."""
        keep = rec_A = rel_A = None
        if picked is not None:
            rec_A, c, _ = picked
            rel_A = c["key"].astype(np.int64) - start_U[rec_A]
            keep = np.flatnonzero(rel_A >= 0)  # positions before route_start are not recorded
        if keep is None or not len(keep):
            empty = np.zeros((0, self.L, self.K), dtype=self.route_dtype), np.zeros(0, dtype=bool)
            return [empty] * U
        whole = len(keep) == len(rel_A)  # no row before its record's route_start (the usual take)
        rec_K, rel_K = (rec_A, rel_A) if whole else (rec_A[keep], rel_A[keep])
        key_K = rec_K * (int(rel_K.max()) + 1) + rel_K
        k = newest_by_key(key_K)  # sorted by (record, position)
        if len(k) < len(key_K):  # some position came more than once (recompute)
            rows_K, step_K = (c["rows"], c["step"]) if whole else (c["rows"][keep], c["step"][keep])
            valid_K = c["valid"] if whole else c["valid"][keep]
            for u, rel, since in superseded(key_K, rows_K, step_K, valid_K, rec_K, rel_K):
                changes[u] = (rel, since)
        e = k if whole else keep[k]
        rec_E, rel_E, valid_E = rec_K[k], rel_K[k], c["valid"][e]
        n_U = np.zeros(U, dtype=np.int64)
        v = np.flatnonzero(valid_E)
        if len(v):  # sorted by position within a record: its last valid entry has its largest position
            last = v[np.append(np.flatnonzero(np.diff(rec_E[v])), len(v) - 1)]
            n_U[rec_E[last]] = rel_E[last] + 1
        off_U1 = np.zeros(U + 1, dtype=np.int64)
        np.cumsum(n_U, out=off_U1[1:])
        inside_E = rel_E < n_U[rec_E]
        if not inside_E.all():  # rows past a record's last valid one (invalid prefix-read rows) are cut
            inside = np.flatnonzero(inside_E)
            rec_E, rel_E, valid_E, e = rec_E[inside], rel_E[inside], valid_E[inside], e[inside]
        dst = off_U1[rec_E] + rel_E
        o = off_U1.tolist()
        routes = np.zeros((o[-1], self.L, self.K), dtype=self.route_dtype)
        filled = np.zeros(o[-1], dtype=bool)
        routes[dst] = c["rows"][e]
        filled[dst] = valid_E
        return [(routes[o[u]:o[u + 1]], filled[o[u]:o[u + 1]]) for u in range(U)]

    def _samples(self, U: int, picked, problems: list[list[str]]) -> list[tuple[np.ndarray, ...]]:
        """Per record, by generated index g from 0: token, logprob, support size and CSR ids, cut
        at the first g that never arrived (a problem names it)."""
        none = (np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros(1, np.int64),
                np.zeros(0, np.int32), np.zeros(0, np.int64))
        if picked is None:
            return [none] * U
        rec_A, c, ids_all = picked
        g_A = c["key"].astype(np.int64)
        ok = np.flatnonzero(g_A >= 0)
        if len(ok) < len(g_A):  # never for a row the runner keeps (its last position is >= prompt_len - 1)
            for u in np.unique(rec_A[g_A < 0]):
                problems[u].append(f"a sampler row at generated index {int(g_A[(rec_A == u) & (g_A < 0)][0])} < 0")
            if not len(ok):
                return [none] * U
        every = len(ok) == len(g_A)  # (the usual take: no row to leave out, no gap; fewer copies)
        rec_V, g_V = (rec_A, g_A) if every else (rec_A[ok], g_A[ok])
        k = newest_by_key(rec_V * (int(g_V.max()) + 1) + g_V)  # sorted by (record, g)
        e, rec_E, g_E = (k if every else ok[k]), rec_V[k], g_V[k]
        count_U = np.bincount(rec_E, minlength=U)
        start_U = np.cumsum(count_U) - count_U
        whole_E = g_E == np.arange(len(e)) - start_U[rec_E]  # g rises within a record: true up to its first gap
        gapless = bool(whole_E.all())
        if not gapless:
            for u in np.unique(rec_E[~whole_E]):
                have = int(np.count_nonzero(whole_E & (rec_E == u)))
                top = int(g_E[start_U[u] + count_U[u] - 1])
                problems[u].append(f"sample for generated token {have} never arrived ({int(count_U[u])} of {top + 1})")
        x, rec_X = (e, rec_E) if gapless else (e[whole_E], rec_E[whole_E])
        off_U1 = np.zeros(U + 1, dtype=np.int64)
        np.cumsum(count_U if gapless else np.bincount(rec_X, minlength=U), out=off_U1[1:])
        tokens, lps, sizes, outside, steps = c["tokens"][x], c["logprobs"][x], c["sizes"][x], c["outside"][x], c["step"][x]
        offsets, ids = segment_gather(ids_all, c["id0"][x], c["nids"][x])
        if outside.any():
            for u in np.unique(rec_X[outside]):
                a, b = off_U1[u], off_U1[u + 1]
                g = int(np.flatnonzero(outside[a:b])[0])
                problems[u].append(
                    f"sampled token {int(tokens[a + g])} of generated token {g} is outside its recorded sampling "
                    f"support ({int(sizes[a + g])} tokens; {int(outside[a:b].sum())} such rows): the sampler drew "
                    "from another set than the one recorded (see sampler_hook.py: exactness)")
        out, o, n = [], off_U1.tolist(), offsets[off_U1].tolist()  # Python ints: cheap slicing
        for u in range(U):
            a, b = o[u], o[u + 1]
            out.append((tokens[a:b], lps[a:b], sizes[a:b], offsets[a:b + 1] - n[u], ids[n[u]:n[u + 1]], steps[a:b]))
        return out
