"""One `score_logits` call validated into a `_Job`: the input types (`SupportCSR`, `VocabShard`),
the checks that name the bad row and value (`_prepare`), and the job's loop ranges (dense row
chunks under a byte budget, support ranges of kept entries). The backends that run a job are in
scoring.py.

Legend: G scored rows, V vocabulary (V_local on a shard), N kept ids over all rows, C rows of a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..collectives import on_collective_device
from ..errors import Where
from ..trace import SamplingSupport
from .errors import ScoringInputError

CHUNK_BYTES_CAP = 256 << 20
"""Largest fp32 working set of one chunk (two [C, V] buffers): 256 MiB is ~220 rows at V = 151,936."""
CHUNK_FRACTION_OF_LOGITS = 4
"""A chunk's working set is at most logits bytes / 4 (but at least one row), so the extra peak
stays near 1/4 of the logits whatever G is."""
SUPPORT_ENTRY_BYTES = 128
"""Bytes the support loops hold per kept entry at their peak (~15 int64 / fp32 temporaries: its row,
column, source row, logit, exp, the row statistics gathered for it, its gradient). A support loop's
range holds at most chunk bytes / this many entries: its work is per entry, not per [C, V] row, so
it is not cut at the dense loops' row count (at G = 16,384, V = 151,936 those are 75 ranges of 220
rows, each ~20 small launches and 2-4 host reads each way, for ~0.5M kept entries that fit one)."""
CHUNK_BYTES_FLOOR = 8 << 20
"""...and at least 8 MiB: below that the memory saved is noise, while every chunk pays each eager
op's fixed cost again (the fraction rule cut a verl micro-batch of 64 scored rows at V = 512 into
8-16 chunks: ~30 small ops, ~2 ms of CPU each under load, about 10% of the tiny model's step)."""


@dataclass(frozen=True)
class SupportCSR:
    """Kept token ids per scored row, CSR: row g keeps ids_N[offsets_G1[g]:offsets_G1[g + 1]]."""

    offsets_G1: torch.Tensor
    """int64 [G + 1], non-decreasing from 0 to N."""
    ids_N: torch.Tensor
    """int64 [N] global token ids."""
    whole_G: torch.Tensor | None = None
    """bool [G]: rows that keep the whole vocabulary (no support recorded; their CSR row is empty)."""
    ids_distinct: bool = False
    """Each row's ids are known to be distinct (`from_supports`: a SamplingSupport row is strictly
    increasing, checked by `SamplingSupport.validate` on every trace a plan accepts), so
    `score_logits` skips its own check; a hand-built CSR leaves it False and is checked there."""

    @property
    def num_rows(self) -> int:
        return self.offsets_G1.numel() - 1

    def sizes_G(self) -> torch.Tensor:
        return self.offsets_G1[1:] - self.offsets_G1[:-1]

    def to(self, device: torch.device | str) -> "SupportCSR":
        whole = None if self.whole_G is None else self.whole_G.to(device)
        return SupportCSR(self.offsets_G1.to(device), self.ids_N.to(device), whole, self.ids_distinct)

    @classmethod
    def from_supports(
        cls, supports: Sequence[SamplingSupport | None], rows_per_support: Sequence[int], device: torch.device | str = "cpu"
    ) -> "SupportCSR":
        """Concatenate traces' supports (None: that trace's rows keep the whole vocabulary; so do a
        support's rows flagged in its `whole_G`)."""
        sizes, ids, whole = [], [], []
        for i, (sup, rows) in enumerate(zip(supports, rows_per_support)):
            if sup is None:
                sizes.append(np.zeros(rows, np.int64))
                whole.append(np.ones(rows, bool))
                continue
            if sup.num_rows != rows:
                raise ScoringInputError(Where(field=f"supports[{i}]"), f"{rows} rows (one per generated token)", f"{sup.num_rows} rows")
            sizes.append(sup.sizes_G().astype(np.int64))
            ids.append(np.asarray(sup.ids_N, dtype=np.int64))
            whole.append(sup.whole_flags())  # rows kept whole (untruncated sampling): scored over V
        size_G = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
        off = np.zeros(len(size_G) + 1, np.int64)
        np.cumsum(size_G, out=off[1:])
        ids_N = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        whole_G = np.concatenate(whole) if whole else np.zeros(0, bool)
        return cls(torch.from_numpy(off).to(device), torch.from_numpy(ids_N).to(device),
                   torch.from_numpy(whole_G).to(device) if whole_G.any() else None,
                   ids_distinct=True)  # SamplingSupport rows are strictly increasing


@dataclass(frozen=True)
class VocabShard:
    """This rank's logits hold vocabulary columns [start, start + V_local) of `vocab_size`."""

    start: int
    vocab_size: int
    group: Any = None
    """torch.distributed process group of the tensor-parallel ranks (None: the default group)."""

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.vocab_size:
            raise ValueError(f"VocabShard.start must be in [0, {self.vocab_size}), got {self.start}")

    def all_reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """On x's own device when the group serves it, else through a copy on the group's (a CPU
        scoring over an NCCL group, say: `collectives.collective_device`)."""
        import torch.distributed as dist

        y = on_collective_device(x, self.group)
        dist.all_reduce(y, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        return y if y is x else x.copy_(y)


@dataclass
class _Job:
    """One scoring call, validated: everything a backend needs."""

    logits_XV: torch.Tensor
    rows_G: torch.Tensor | None
    """Row of logits_XV scored as row g (None: row g itself)."""
    target_G: torch.Tensor
    scale_G: torch.Tensor
    """Divisor of the logits per row (temperature, 1 for greedy rows), compute dtype."""
    support: SupportCSR | None
    dense_G: torch.Tensor
    """bool [G]: rows read over the whole (local) vocabulary in forward."""
    full: bool
    shard: VocabShard | None
    chunk_rows: int
    chunk_bytes: int
    """Working-set budget of one loop range (dense: chunk_rows rows; support: `support_chunks`)."""
    cdt: torch.dtype
    unit_scale: bool
    """Every row at temperature 1 (or greedy): the division is skipped."""
    any_dense: bool = True
    """dense_G.any(), read once at `_prepare` (with the checks' flags, not a host read of its own)."""
    all_dense: bool = True
    """dense_G.all(), read the same way: every row's chunk index is then its range, known on the host."""
    entropy: bool = True
    """Compute the entropies (two more eager passes over each dense chunk; off when only log p is used)."""
    _support_ranges: list[tuple[int, int]] | None = field(default=None, repr=False)
    """`support_chunks`, once taken: forward and backward share it."""
    _host_rows: np.ndarray | None = field(default=None, repr=False)
    """rows_G on the host, read at most once a call (where a dense range's rows must be known there)."""
    _host_offsets: np.ndarray | None = field(default=None, repr=False)
    """The support's offsets on the host, read at most once a call, and only where a loop range is not
    all rows (one range of every row needs only N, which the host knows)."""

    @property
    def num_rows(self) -> int:
        return self.target_G.numel()

    @property
    def start(self) -> int:
        return 0 if self.shard is None else self.shard.start

    def source_index(self, idx_C: torch.Tensor) -> torch.Tensor:
        """Rows of logits_XV holding scored rows idx_C."""
        return idx_C if self.rows_G is None else self.rows_G.index_select(0, idx_C)

    def source_rows(self, idx_C: torch.Tensor, host_C: np.ndarray) -> tuple[torch.Tensor, slice | None]:
        """`source_index`, and the same as a slice when the rows are contiguous (a slice copies at memory
        speed; index_select of bf16 rows is ~10x slower on CPU), decided on the host from host_C, idx_C
        there (a `RowSet` part; with rows_G through one host copy of it a call): no read of the device."""
        src = self.source_index(idx_C)
        n = src.numel()
        h = host_C if self.rows_G is None else self.host_rows()[host_C]
        contiguous = n > 0 and int(h[-1]) - int(h[0]) + 1 == n and bool((np.diff(h) == 1).all())
        return src, slice(int(h[0]), int(h[0]) + n) if contiguous else None

    def host_rows(self) -> np.ndarray:
        if self._host_rows is None:
            self._host_rows = self.rows_G.cpu().numpy()
        return self._host_rows

    def rows(self, idx_C: torch.Tensor, host_C: np.ndarray) -> torch.Tensor:
        """fp-compute copy of the scored rows idx_C, divided by their temperature: [C, V_local]."""
        src, run = self.source_rows(idx_C, host_C)
        x_CV = self.logits_XV[run].to(self.cdt, copy=True) if run is not None else self.logits_XV[src].to(self.cdt)
        if not self.unit_scale:
            x_CV.div_(self.scale_G.index_select(0, idx_C)[:, None])
        return x_CV

    def kept(self, g0: int, g1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Kept entries of rows [g0, g1) that live on this shard: (row_n, local id_n, x_n, is_target_n)."""
        sup = self.support
        n0, n1 = self.entry_bounds(g0, g1)
        row_n = _entry_rows(sup.offsets_G1, g0, g1, (n0, n1))
        col_n = sup.ids_N[n0:n1] - self.start
        if self.shard is not None:
            here = (col_n >= 0) & (col_n < self.logits_XV.shape[1])
            row_n, col_n = row_n[here], col_n[here]
        src_n = row_n if self.rows_G is None else self.rows_G.index_select(0, row_n)
        x_n = self.logits_XV[src_n, col_n].to(self.cdt)
        if not self.unit_scale:
            x_n = x_n / self.scale_G.index_select(0, row_n)
        is_target_n = col_n == (self.target_G.index_select(0, row_n) - self.start)
        return row_n, col_n, x_n, is_target_n

    def chunks(self) -> list[tuple[int, int]]:
        g = self.num_rows
        return [(r0, min(r0 + self.chunk_rows, g)) for r0 in range(0, g, self.chunk_rows)]

    def support_chunks(self) -> list[tuple[int, int]]:
        """Row ranges of the support loops: at most chunk_bytes / SUPPORT_ENTRY_BYTES kept entries each
        (a row's entries never split; a row holding more is a range alone); none without a support.
        Taken once a call; all N entries fitting (the common case: ~2M at the 256 MiB cap) is one range
        of every row, known without reading the offsets."""
        if self._support_ranges is None:
            g, cap = self.num_rows, max(1, self.chunk_bytes // SUPPORT_ENTRY_BYTES)
            if self.support is None or g == 0:
                self._support_ranges = []
            elif self.support.ids_N.numel() <= cap:
                self._support_ranges = [(0, g)]
            else:
                self._support_ranges = _entry_ranges(self.host_offsets(), cap)
        return self._support_ranges

    def host_offsets(self) -> np.ndarray:
        if self._host_offsets is None:
            self._host_offsets = self.support.offsets_G1.cpu().numpy()
        return self._host_offsets

    def entry_bounds(self, g0: int, g1: int) -> tuple[int, int]:
        """[n0, n1): the kept entries of rows [g0, g1) (the offsets were checked: 0 to N)."""
        if g0 == 0 and g1 == self.num_rows:
            return 0, self.support.ids_N.numel()
        off = self.host_offsets()
        return int(off[g0]), int(off[g1])


@dataclass(frozen=True)
class RowSet:
    """Scored rows a dense loop reads, ascending, on the device and on the host: a chunk's rows [r0, r1)
    are then a slice of both (`part`), and the host knows without reading the device whether the chunk
    has any and which slice of the logits they are. Every row costs no read; a subset one (its index
    list), whatever the number of chunks (a boolean mask per chunk was a read per chunk, and more for
    its source rows)."""

    idx_D: torch.Tensor | None
    """int64 [D] scored rows on the device (None: every row, made per chunk by arange)."""
    host_D: np.ndarray
    device: torch.device

    @classmethod
    def of(cls, mask_G: torch.Tensor, every: bool) -> "RowSet":
        """`every`: mask_G is known to be all True (no read)."""
        if every:
            return cls(None, np.arange(mask_G.numel()), mask_G.device)
        idx_D = torch.nonzero(mask_G).reshape(-1)
        return cls(idx_D, idx_D.cpu().numpy(), mask_G.device)

    def part(self, r0: int, r1: int) -> tuple[torch.Tensor, np.ndarray]:
        if self.idx_D is None:
            return torch.arange(r0, r1, device=self.device), self.host_D[r0:r1]
        p0, p1 = (int(p) for p in np.searchsorted(self.host_D, [r0, r1]))
        return self.idx_D[p0:p1], self.host_D[p0:p1]

    @property
    def every(self) -> bool:
        return self.idx_D is None


def _entry_ranges(off: np.ndarray, cap: int) -> list[tuple[int, int]]:
    """Row ranges of a CSR (host offsets [G + 1]) holding at most `cap` entries each, whole rows (a row
    holding more is a range alone)."""
    g = len(off) - 1
    if int(off[-1]) <= cap:
        return [(0, g)] if g else []
    out, r0 = [], 0
    while r0 < g:  # the last r1 whose entries since r0 fit
        r1 = max(r0 + 1, int(np.searchsorted(off, off[r0] + cap, side="right")) - 1)
        out.append((r0, min(r1, g)))
        r0 = out[-1][1]
    return out


def _entry_rows(offsets_G1: torch.Tensor, g0: int, g1: int, bounds: tuple[int, int] | None = None) -> torch.Tensor:
    """Row of each CSR entry of rows [g0, g1): a binary search over the offsets (torch.repeat_interleave
    measured ~9 ms a call for 4 rows on this 2-core CPU, 12 us for this). `bounds`: the entries
    [n0, n1) of those rows where the caller knows them (else two host reads of the offsets)."""
    n0, n1 = bounds if bounds is not None else (int(offsets_G1[g0]), int(offsets_G1[g1]))
    ends = offsets_G1[g0 + 1 : g1 + 1]
    return torch.searchsorted(ends, torch.arange(n0, n1, device=ends.device, dtype=ends.dtype), right=True) + g0


def _fail(field: str, row: int | None, expected: Any, found: Any, detail: str = "") -> ScoringInputError:
    err = ScoringInputError(Where(field=field if row is None else f"{field}[row {row}]"), expected, found, detail)
    err.row = row
    return err


def _first(mask: torch.Tensor) -> int:
    return int(torch.nonzero(mask)[0, 0])


class _Checks:
    """Checks on device values, read back to the host together, and the error of the first that fails.

    Why: `bool(bad.any())` is a device-to-host copy that waits for every launch queued before it. Read
    check by check (and chunk by chunk), a support-only forward + backward read the device 31 times
    (`host_reads.HostReads`: 26 scalar reads, 4 masked indexes, 1 host copy of the offsets), and on a
    GPU each read drains the launch queue: the call is launch-bound at any G. Now it reads 4 times
    (tests/test_scoring.py). Here each check adds its flag (a device bool) and the error it raises (built only on failure: naming the row costs host reads of its own);
    `verify` reads every flag in one copy and raises the first failing check's error, in the order
    added, so the first bad field wins as it did check by check. `extra` flags ride along in that copy."""

    def __init__(self) -> None:
        self._checks: list[tuple[torch.Tensor, Callable[[], ScoringInputError | None]]] = []

    def add(self, bad: torch.Tensor, error: Callable[[], ScoringInputError | None]) -> None:
        """`error` builds the error of a raised flag; None from it means a closer look cleared the flag
        (a flag that only says "look closer": rows not stored ascending may still be distinct)."""
        self._checks.append((bad.any(), error))

    def verify(self, **extra: torch.Tensor) -> dict[str, bool]:
        flags = [f for f, _ in self._checks] + [e.reshape(()) for e in extra.values()]
        read = torch.stack(flags).tolist() if flags else []
        out = dict(zip(extra, map(bool, read[len(self._checks):])))
        for failed, (_, error) in zip(read, self._checks):
            if failed and (e := error()) is not None:
                raise e
        return out


def _prepare(logits_XV, target_G, rows_G, support, temperature, full, shard, chunk_bytes) -> _Job:
    """The call's checks in two reads of the device: the fields (rows, targets, temperatures, the
    support's offsets), then the kept entries, whose rows need valid offsets to be looked up."""
    if logits_XV.ndim != 2 or not logits_XV.is_floating_point():
        raise _fail("logits", None, "a floating [rows, V] tensor", f"{logits_XV.dtype} {list(logits_XV.shape)}")
    dev = logits_XV.device
    target_G = target_G.reshape(-1).to(device=dev, dtype=torch.long)
    g = target_G.numel()
    checks = _Checks()
    if rows_G is not None:
        rows_G = rows_G.reshape(-1).to(device=dev, dtype=torch.long)
        if rows_G.numel() != g:
            raise _fail("rows_G", None, f"{g} rows (one per target)", rows_G.numel())
        bad_rows = (rows_G < 0) | (rows_G >= logits_XV.shape[0])
        checks.add(bad_rows, lambda: _fail("rows_G", _first(bad_rows), f"a logits row in [0, {logits_XV.shape[0]})",
                                           int(rows_G[_first(bad_rows)])))
    elif logits_XV.shape[0] != g:
        raise _fail("logits", None, f"{g} rows (one per target)", logits_XV.shape[0])
    vocab = logits_XV.shape[1] if shard is None else shard.vocab_size
    if shard is not None and shard.start + logits_XV.shape[1] > vocab:
        raise _fail("logits", None, f"at most {vocab - shard.start} columns from shard start {shard.start}", logits_XV.shape[1])
    bad_target = (target_G < 0) | (target_G >= vocab)
    checks.add(bad_target, lambda: _fail("target_G", _first(bad_target), f"a token id in [0, {vocab})",
                                         int(target_G[_first(bad_target)])))

    cdt = torch.promote_types(logits_XV.dtype, torch.float32)
    t_G = (temperature.reshape(-1).to(device=dev, dtype=cdt) if isinstance(temperature, torch.Tensor)
           else torch.full((g,), float(temperature), dtype=cdt, device=dev))
    if t_G.numel() != g:
        raise _fail("temperature", None, f"a float or {g} values (one per row)", t_G.numel())
    bad_t = ~torch.isfinite(t_G) | (t_G < 0)
    checks.add(bad_t, lambda: _fail("temperature", _first(bad_t), "a finite temperature >= 0 (0 = greedy)",
                                    float(t_G[_first(bad_t)])))
    scale_G = torch.where(t_G > 0, t_G, torch.ones_like(t_G))
    # flags read with the checks: every row at scale 1 (a float temperature says so on the host), and
    # whether any row is read over the whole vocabulary
    extra: dict[str, torch.Tensor] = {}
    unit_scale = None
    if isinstance(temperature, torch.Tensor):
        extra["unit_scale"] = (scale_G == 1).all()
    else:
        unit_scale = float(temperature) in (0.0, 1.0)

    dense_G = torch.ones(g, dtype=torch.bool, device=dev) if (support is None or full) else (
        support.whole_G.to(dev).bool() if support.whole_G is not None else torch.zeros(g, dtype=torch.bool, device=dev))
    any_dense = all_dense = g > 0 and (support is None or full)
    if support is not None:
        support = support.to(dev)
        _add_offset_checks(checks, support, g)
        if not full and support.whole_G is not None:
            extra["any_dense"], extra["all_dense"] = dense_G.any(), dense_G.all()
    read = checks.verify(**extra)
    unit_scale = read.get("unit_scale", unit_scale)
    any_dense, all_dense = read.get("any_dense", any_dense), read.get("all_dense", all_dense)
    if support is not None:
        support = _check_support(support, target_G, t_G, vocab)
    v_local = logits_XV.shape[1]
    budget = chunk_bytes if chunk_bytes is not None else min(CHUNK_BYTES_CAP, max(
        CHUNK_BYTES_FLOOR, g * v_local * logits_XV.element_size() // CHUNK_FRACTION_OF_LOGITS))
    per_row = 2 * v_local * torch.finfo(cdt).bits // 8
    chunk_rows = max(1, min(max(g, 1), budget // per_row))
    return _Job(logits_XV, rows_G, target_G, scale_G, support, dense_G, bool(full), shard, int(chunk_rows), int(budget),
                cdt, bool(unit_scale), bool(any_dense), bool(all_dense))


def _add_offset_checks(checks: _Checks, sup: SupportCSR, g: int) -> None:
    """The CSR's shape (host) and its offsets, non-decreasing from 0 to N (device, read with the fields)."""
    off, n = sup.offsets_G1.long(), sup.ids_N.numel()

    def error() -> ScoringInputError:
        return _fail("support.offsets_G1", None, f"{g + 1} non-decreasing offsets from 0 to len(ids_N)={n}",
                     f"{off.numel()} offsets, first {int(off[0]) if off.numel() else None}, "
                     f"last {int(off[-1]) if off.numel() else None}")

    if off.numel() != g + 1:
        raise error()
    if sup.whole_G is not None and sup.whole_G.numel() != g:
        raise _fail("support.whole_G", None, f"{g} flags", sup.whole_G.numel())
    checks.add((off[0] != 0) | (off[-1] != n) | (off[1:] < off[:-1]).any(), error)


def _check_support(sup: SupportCSR, target_G: torch.Tensor, t_G: torch.Tensor, vocab: int) -> SupportCSR:
    """The kept entries (offsets already checked): ids in range, distinct per row, each row keeping its
    sampled token, greedy rows keeping one id; one read of the device, two where ids_distinct is not
    known and the rows are not stored ascending (the duplicate search sorts)."""
    g = target_G.numel()
    off, ids = sup.offsets_G1.long(), sup.ids_N.long()
    whole = sup.whole_G.bool() if sup.whole_G is not None else torch.zeros(g, dtype=torch.bool, device=target_G.device)
    sizes = off[1:] - off[:-1]
    row_n = _entry_rows(off, 0, g, (0, ids.numel()))
    checks = _Checks()
    bad_ids = (ids < 0) | (ids >= vocab)
    checks.add(bad_ids, lambda: _fail("support.ids_N", int(row_n[_first(bad_ids)]), f"kept token ids in [0, {vocab})",
                                      int(ids[_first(bad_ids)])))
    if not sup.ids_distinct:
        _check_distinct(checks, ids, row_n, vocab)
    hits_G = torch.zeros(g, dtype=torch.long, device=target_G.device).index_add_(
        0, row_n, (ids == target_G.index_select(0, row_n)).long())
    bad_hit = (hits_G == 0) & ~whole
    checks.add(bad_hit, lambda: _fail("support", _first(bad_hit), f"the sampled token {int(target_G[_first(bad_hit)])} in its kept set",
                                      f"a kept set of {int(sizes[_first(bad_hit)])} ids without it ({int(bad_hit.sum())} such rows)"))
    bad_greedy = (t_G == 0) & (sizes > 1) & ~whole
    checks.add(bad_greedy, lambda: _fail(
        "temperature", _first(bad_greedy), "a temperature > 0 (a kept set of more than one id means the sampling was stochastic)",
        f"temperature 0 with {int(sizes[_first(bad_greedy)])} kept ids"))
    checks.verify()
    return SupportCSR(off, ids, sup.whole_G.bool() if sup.whole_G is not None else None, ids_distinct=True)


def _check_distinct(checks: _Checks, ids_N: torch.Tensor, row_N: torch.Tensor, vocab: int) -> None:
    """Each row's kept ids distinct (an id kept twice counts its probability twice: a row keeping
    {a, a} scores log p(a) = log 1/2 where 0 is right). One key per entry, row * vocab + id (below
    2^63 for any G * V in reach): keys strictly increasing, as rows stored ascending give, prove it
    in one pass, read with the other checks; otherwise `_duplicate_error` sorts them.
    Measured on one CPU thread for G = 4096 rows of 64 ids, V = 151,936: 0.5 ms with ascending rows
    (the one pass), 6 ms otherwise (the sort), against 27 ms for the support-only forward of those
    rows from bf16 logits; CSRs from `SupportCSR.from_supports` skip it (`ids_distinct`)."""
    if ids_N.numel() < 2:
        return
    key_N = row_N * vocab + ids_N
    checks.add(~(key_N[1:] > key_N[:-1]).all(), lambda: _duplicate_error(key_N, vocab))


def _duplicate_error(key_N: torch.Tensor, vocab: int) -> ScoringInputError | None:
    """The error for the lowest row keeping an id twice, or None (rows not stored ascending, but
    distinct): the keys sorted, equal neighbours are the duplicates."""
    key_N = key_N.sort().values
    dup_N = key_N[1:] == key_N[:-1]
    if not bool(dup_N.any()):
        return None
    key = int(key_N[1:][dup_N][0])  # sorted by row first: the lowest row with a duplicate
    row, token = divmod(key, vocab)
    return _fail("support.ids_N", row, "distinct kept token ids in each row",
                 f"token {token} kept {int((key_N == key).sum())} times", "each kept id would count its probability again")
