"""Token scoring at real vocabulary sizes: log p(target) and entropy of softmax(logits / T),
renormalised over each row's kept set (invariant 5), without a full-vocabulary copy of all rows.

Why: at V = 151,936 the dense path (fp32 copy, mask, log_softmax over [G, V]) costs 8-10.5x the
logits' bytes on top of them (52 GB beyond the logits at G = 16k). Here the G rows are
processed in row chunks whose fp32 working set is at most 1/4 of the logits' bytes (and at most
256 MiB; the support loops take ranges of kept entries under the same budget); per row only what
backward needs is kept: the log-sum-exp and the entropy over the kept
set and over V (4 floats). Backward recomputes each chunk's exp from the logits.

Support comes in CSR form (`SupportCSR`: the trace's own offsets_G1 / ids_N), never as a dense
[G, V] mask. A row whose kept set is the whole vocabulary (no support recorded) is marked in
`whole_G` and scored over V. With a support, the kept logits are gathered (N of them) and the
full vocabulary is read only when the full-vocabulary scores are asked for (`full=True`: KL and
entropy bonuses need them).

Temperature is per row. Temperature 0 means greedy, as in the engine: the kept set is the argmax
alone, so the support-renormalised log p is 0 and its entropy 0 whatever the scale; the logits are
scored unscaled (T = 1), which is what the full-vocabulary scores of a greedy row are. A greedy row
with more than one kept id is a contradiction (the sampling was stochastic) and is refused.

Vocabulary-parallel logits (Megatron tensor parallelism): pass `VocabShard`; each rank holds the
columns [start, start + V_local) and the per-row statistics are all-reduced over the group
(max, then sums), so every rank returns the same full-vocabulary-normalised scores and backward
needs no communication.

Backends (`SCORING_BACKENDS`, each with `forward_stats` and `backward`): `torch_chunked` (this
file, eager torch, any device) and `torch_compiled` (scoring_compiled.py: the same with the per-chunk
full-vocabulary math compiled by inductor, one launch each way, no fp32 chunk). `backend="auto"`
takes the compiled one on CPU for full-vocabulary work of real size. A backend is one registration
in SCORING_BACKENDS; a GPU kernel would be another.

The call's inputs, their checks and its loop ranges are scoring_job.py's (`_prepare` -> `_Job`).

Legend: G scored rows, V vocabulary (V_local on a shard), N kept ids over all rows, C rows of a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import torch

from ..registry import Registry
from .scoring_job import RowSet, SupportCSR, VocabShard, _entry_rows, _fail, _first, _Job, _prepare

@dataclass
class TokenScores:
    """Per scored token (concatenated over the batch rows; split with plan.gen_offsets_B1)."""

    logprobs_G: torch.Tensor
    """log p(target) renormalised over the kept set (over V where no support)."""
    entropy_G: torch.Tensor | None
    """Entropy of the same renormalised distribution (None when not asked for)."""
    full_logprobs_G: torch.Tensor | None = None
    """log p(target) over the whole vocabulary (only with full=True)."""
    full_entropy_G: torch.Tensor | None = None
    """Entropy over the whole vocabulary (only with full=True and entropy=True)."""

    def split(self, plan: Any) -> list[torch.Tensor]:
        """logprobs_G cut into one tensor per batch row."""
        off = plan.gen_offsets_B1
        return [self.logprobs_G[off[b] : off[b + 1]] for b in range(len(off) - 1)]


class ScoringBackend(Protocol):
    """What a backend computes; `torch_chunked` is the reference, a fused kernel registers beside it."""

    def forward_stats(self, job: "_Job") -> dict[str, torch.Tensor]: ...

    def backward(self, job: "_Job", stats: dict[str, torch.Tensor], grads: dict[str, torch.Tensor | None]) -> torch.Tensor: ...


SCORING_BACKENDS: Registry[ScoringBackend] = Registry("scoring backend")
AUTO_BACKEND: list[Callable[["_Job"], str]] = []
"""How `backend="auto"` picks a SCORING_BACKENDS name for a call: the last rule registered here
(scoring_compiled.auto_backend, registered when replay/__init__ imports scoring_compiled); with
none, `torch_chunked`."""


def _combine(job: _Job, m_G: torch.Tensor, s_G: torch.Tensor, sy_G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp, entropy) per row from the local max m, sum s = sum e^(x-m), sy = sum e^(x-m)(x-m),
    merged across vocabulary shards when there are any."""
    if job.shard is not None:
        m_loc = m_G.clone()
        m_G = job.shard.all_reduce(m_G.clone(), "max")
        has = s_G > 0
        w = torch.where(has, torch.exp(m_loc - m_G), torch.zeros_like(s_G))
        shift = torch.where(has, m_loc - m_G, torch.zeros_like(s_G))
        stacked = torch.stack([w * s_G, w * (sy_G + shift * s_G)])
        s_G, sy_G = job.shard.all_reduce(stacked, "sum")
    log_s = torch.log(s_G)
    return m_G + log_s, log_s - sy_G / s_G


class TorchChunked:
    """Row-chunked torch reference backend: any device, any float dtype (fp64 stays fp64).

    The full-vocabulary work per chunk is two methods, `dense_stats` (forward) and `dense_grad`
    (backward); the rest (CSR support, shards, row bookkeeping) is shared with `TorchCompiled`.
    Eager torch makes each op a pass over the [C, V] chunk: forward 5 (fp32 copy, log_softmax,
    exp, one fused multiply-reduce), backward 5 (copy, exp, two fused updates, write-back)."""

    def dense_stats(self, job: _Job, idx_C: torch.Tensor, col_C: torch.Tensor,
                    host_C: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-sum-exp, entropy) over the local vocabulary of scored rows idx_C; col_C: a local column
        per row (its target where it lives on this shard) at which the log-sum-exp is read off;
        host_C: idx_C on the host (`RowSet.part`: the rows' slice is then known without a read)."""
        x_CV = job.rows(idx_C, host_C)
        # torch's fused row log_softmax (max, sum of exp and write in one cache-friendly kernel),
        # then log-sum-exp = x_j - logp_j at column j
        lp_CV = torch.log_softmax(x_CV, 1)
        j_C1 = col_C[:, None]
        lse_C = (x_CV.gather(1, j_C1) - lp_CV.gather(1, j_C1)).squeeze(1)
        if not job.entropy:
            return lse_C, torch.zeros_like(lse_C)
        # H = -sum p logp: p into x's buffer, then one batched dot (bmm reads both rows once and writes
        # nothing: the mul + sum pair it replaces reads three rows and writes one)
        p_CV = torch.exp(lp_CV, out=x_CV)
        ent_C = torch.bmm(p_CV[:, None, :], lp_CV[:, :, None]).view(-1).neg_()
        return lse_C, ent_C

    def chunks(self, job: _Job, buffered: bool) -> list[tuple[int, int]]:
        """Row ranges of the dense loops: each allocates [C, V] compute-dtype buffers here."""
        return job.chunks()

    def dense_grad(self, job: _Job, idx_C: torch.Tensor, lse_C1: torch.Tensor, mean_C1: torch.Tensor, a_C1: torch.Tensor,
                   b_C1: torch.Tensor, t_C1: torch.Tensor, out: torch.Tensor, dst_C: torch.Tensor | None,
                   host_C: np.ndarray, entropy_grad: bool) -> None:
        """Write d(a logp_t + b H)/d logits of rows idx_C, divided by the temperature, into rows dst_C of
        `out` (the gradient), or into `out` [C, V] itself when dst_C is None: onehot_t a - p (a + b (x -
        E[x])), E[x] = mean_C1; t_C1 = -1 where the target column is not on this shard. host_C: as in
        dense_stats; entropy_grad: whether any b of the call is nonzero (read with the backward's plan).
        With b = 0 both branches give -(a p) bit for bit: the flag only saves a buffer."""
        x_CV = job.rows(idx_C, host_C)
        if entropy_grad:
            p_CV = torch.sub(x_CV, lse_C1).exp_()
            dx_CV = x_CV.sub_(mean_C1).mul_(b_C1).add_(a_C1).mul_(p_CV).neg_()
            del p_CV
        else:  # no entropy term: one buffer, p computed in place
            dx_CV = x_CV.sub_(lse_C1).exp_().mul_(-a_C1)
        # + a at each row's target column; a row whose target is on another shard adds 0 at column 0
        # (a masked index would be a host read of the mask's count)
        here_C1 = t_C1 >= 0
        dx_CV.scatter_add_(1, t_C1.clamp(min=0), torch.where(here_C1, a_C1, torch.zeros_like(a_C1)).to(dx_CV.dtype))
        if not job.unit_scale:
            dx_CV.div_(job.scale_G.index_select(0, idx_C)[:, None])
        if dst_C is None:
            out.copy_(dx_CV)
            return
        _, run = job.source_rows(idx_C, host_C)
        if run is not None:  # a slice copies at memory speed
            out[run].copy_(dx_CV)
        else:
            out[dst_C] = dx_CV.to(out.dtype)

    def forward_stats(self, job: _Job) -> dict[str, torch.Tensor]:
        g, dev, cdt = job.num_rows, job.target_G.device, job.cdt
        out: dict[str, torch.Tensor] = {}
        # target logit: on its owning shard only, summed over shards
        local_t = job.target_G - job.start
        here_G = (local_t >= 0) & (local_t < job.logits_XV.shape[1])
        src_G = torch.arange(g, device=dev) if job.rows_G is None else job.rows_G
        xt_G = job.logits_XV[src_G, local_t.clamp(0, job.logits_XV.shape[1] - 1)].to(cdt) / job.scale_G
        xt_G = torch.where(here_G, xt_G, torch.zeros_like(xt_G))
        out["xt"] = xt_G if job.shard is None else job.shard.all_reduce(xt_G, "sum")

        if job.any_dense:
            m, s, sy = (torch.full((g,), float("-inf"), dtype=cdt, device=dev), torch.zeros(g, dtype=cdt, device=dev),
                        torch.zeros(g, dtype=cdt, device=dev))
            rows = RowSet.of(job.dense_G, job.all_dense)  # one read where only some rows are dense
            for r0, r1 in self.chunks(job, buffered=False):
                idx, host = rows.part(r0, r1)
                if len(host) == 0:
                    continue
                lse_C, ent_C = self.dense_stats(job, idx, torch.where(here_G[idx], local_t[idx], torch.zeros_like(local_t[idx])), host)
                # as (max, sum e^(x-max), sum e^(x-max) (x-max)) with max := lse: (lse, 1, -H)
                m[idx], s[idx], sy[idx] = lse_C, 1.0, -ent_C
            s = torch.where(job.dense_G, s, torch.ones_like(s))  # rows not read: finite placeholders
            out["lse_full"], out["ent_full"] = _combine(job, torch.where(job.dense_G, m, torch.zeros_like(m)), s, sy)

        if job.support is not None:
            m, s, sy = (torch.full((g,), float("-inf"), dtype=cdt, device=dev), torch.zeros(g, dtype=cdt, device=dev),
                        torch.zeros(g, dtype=cdt, device=dev))
            for r0, r1 in job.support_chunks():
                row_n, _, x_n, _ = job.kept(r0, r1)
                if row_n.numel() == 0:
                    continue
                m.scatter_reduce_(0, row_n, x_n, "amax")
                y_n = x_n - m.index_select(0, row_n)
                e_n = torch.exp(y_n)
                s.index_add_(0, row_n, e_n)
                sy.index_add_(0, row_n, e_n * y_n)
            whole = job.support.whole_G
            keep = torch.ones_like(s, dtype=torch.bool) if whole is None else ~whole
            s = torch.where(keep & (s > 0), s, torch.ones_like(s)) if job.shard is None else torch.where(keep, s, torch.ones_like(s))
            lse, ent = _combine(job, torch.where(keep & torch.isfinite(m), m, torch.zeros_like(m)), s, sy)
            if whole is not None and "lse_full" in out:
                lse, ent = torch.where(whole, out["lse_full"], lse), torch.where(whole, out["ent_full"], ent)
            out["lse_sup"], out["ent_sup"] = lse, ent
        return out

    def backward(self, job: _Job, stats: dict[str, torch.Tensor], grads: dict[str, torch.Tensor | None]) -> torch.Tensor:
        g, dev, cdt = job.num_rows, job.target_G.device, job.cdt
        zero = torch.zeros(g, dtype=cdt, device=dev)
        a_sup, b_sup = (grads["lp_sup"] if grads["lp_sup"] is not None else zero), (grads["ent_sup"] if grads["ent_sup"] is not None else zero)
        a_full, b_full = (grads["lp_full"] if grads["lp_full"] is not None else zero), (grads["ent_full"] if grads["ent_full"] is not None else zero)
        sup = job.support
        whole = torch.ones(g, dtype=torch.bool, device=dev) if sup is None else (
            sup.whole_G if sup.whole_G is not None else torch.zeros(g, dtype=torch.bool, device=dev))
        # a row that keeps the whole vocabulary: its support scores are its full scores
        a_full = a_full + torch.where(whole, a_sup, zero)
        b_full = b_full + torch.where(whole, b_sup, zero)
        a_sup, b_sup = torch.where(whole, zero, a_sup), torch.where(whole, zero, b_sup)
        dense_G = job.dense_G & ((a_full != 0) | (b_full != 0))
        sparse_G = (a_sup != 0) | (b_sup != 0)
        # the loop's plan in one host read (see scoring_job._Checks: a read each costs a GPU a queue drain)
        dense_all, merge, any_dense, any_sparse, entropy_grad = torch.stack(
            [dense_G.all(), (dense_G & sparse_G).any(), dense_G.any(), sparse_G.any(), (b_full != 0).any()]).tolist()
        every_row = job.rows_G is None and dense_all  # each row is written: no zero fill needed
        merge = sup is not None and merge  # support terms added to dense rows
        any_sparse = sup is not None and any_sparse
        # without dense rows only support terms: ranges of kept entries, not of [C, V] rows

        rows = RowSet.of(dense_G, dense_all) if any_dense else None  # one read where only some rows are dense
        x_shape = job.logits_XV.shape
        grad_XV = (torch.empty if every_row else torch.zeros)(x_shape, dtype=job.logits_XV.dtype, device=dev)
        v_local = x_shape[1]
        local_t = job.target_G - job.start
        here_G = (local_t >= 0) & (local_t < v_local)
        for r0, r1 in (self.chunks(job, buffered=merge) if any_dense else job.support_chunks()):
            dx_CV = dst = run = pos_in_dense = None
            d_host = None
            if rows is not None:
                d_idx, d_host = rows.part(r0, r1)
                if rows.every:
                    pos_in_dense = d_idx - r0
                else:
                    pos_in_dense = torch.full((r1 - r0,), -1, dtype=torch.long, device=dev)
                    pos_in_dense[d_idx - r0] = torch.arange(d_idx.numel(), device=dev)
            if d_host is not None and len(d_host):
                lse, ent = stats["lse_full"].index_select(0, d_idx)[:, None], stats["ent_full"].index_select(0, d_idx)[:, None]
                a, b = a_full.index_select(0, d_idx)[:, None], b_full.index_select(0, d_idx)[:, None]
                t_here = here_G.index_select(0, d_idx)
                t_C1 = torch.where(t_here, local_t.index_select(0, d_idx), torch.full_like(t_here, -1, dtype=torch.long))[:, None]
                dst, run = job.source_rows(d_idx, d_host)
                if merge:  # a chunk buffer in the compute dtype: support terms are added before rounding
                    dx_CV = torch.empty((d_idx.numel(), v_local), dtype=cdt, device=dev)
                    self.dense_grad(job, d_idx, lse, lse - ent, a, b, t_C1, dx_CV, None, d_host, entropy_grad)
                else:  # straight into the gradient's rows
                    self.dense_grad(job, d_idx, lse, lse - ent, a, b, t_C1, grad_XV, dst, d_host, entropy_grad)
            if any_sparse:
                # every kept entry of the range: a row without a support gradient has a = b = 0, so its
                # entries add -0.0 (exp(x - lse) is finite: the forward checked lse), a no-op on any sum
                # (filtering them out would be a host read of the mask's count)
                row_n, col_n, x_n, is_t = job.kept(r0, r1)
                lse, ent = stats["lse_sup"].index_select(0, row_n), stats["ent_sup"].index_select(0, row_n)
                a, b = a_sup.index_select(0, row_n), b_sup.index_select(0, row_n)
                q_n = torch.exp(x_n - lse)
                dx_n = -q_n * (a + b * (x_n - (lse - ent))) + torch.where(is_t, a, torch.zeros_like(a))  # per scaled logit
                if not job.unit_scale:
                    dx_n = dx_n / job.scale_G.index_select(0, row_n)
                if dx_CV is not None and rows.every:  # every row is in the dense buffer
                    dx_CV.index_put_((pos_in_dense[row_n - r0], col_n), dx_n.to(dx_CV.dtype), accumulate=True)
                else:
                    if dx_CV is not None:  # entries of rows in the dense buffer go there, the rest to the gradient:
                        # each side adds 0 for the other's entries (at its buffer's row 0, or at a gradient row
                        # the buffer overwrites below), where a masked index would be a read of the mask's count
                        p_n = pos_in_dense[row_n - r0]
                        in_dense = p_n >= 0
                        zero_n = torch.zeros_like(dx_n)
                        dx_CV.index_put_((p_n.clamp(min=0), col_n), torch.where(in_dense, dx_n, zero_n).to(dx_CV.dtype), accumulate=True)
                        dx_n = torch.where(in_dense, zero_n, dx_n)
                    dst_n = row_n if job.rows_G is None else job.rows_G.index_select(0, row_n)
                    grad_XV.index_put_((dst_n, col_n), dx_n.to(grad_XV.dtype), accumulate=True)
            if dx_CV is not None:
                if run is not None:
                    grad_XV[run].copy_(dx_CV)
                else:
                    grad_XV[dst] = dx_CV.to(grad_XV.dtype)
                del dx_CV
        return grad_XV


SCORING_BACKENDS.add("torch_chunked", TorchChunked())


class _ScoreFunction(torch.autograd.Function):
    """Outputs (lp_sup, ent_sup, lp_full, ent_full); the full pair is empty unless job.full."""

    @staticmethod
    def forward(ctx, logits_XV: torch.Tensor, job: _Job, backend: ScoringBackend):
        if job.num_rows == 0:  # a batch without generated tokens: empty scores (no backend is asked)
            empty = logits_XV.new_empty(0, dtype=job.cdt)
            stats = {"xt": empty, "lse_full": empty, "ent_full": empty, "lse_sup": empty, "ent_sup": empty}
        else:
            stats = backend.forward_stats(job)
            _check_finite(job, stats)
        xt = stats["xt"]
        if job.support is not None:
            lp_sup, ent_sup = xt - stats["lse_sup"], stats["ent_sup"]
        else:
            lp_sup, ent_sup = xt - stats["lse_full"], stats["ent_full"]
        if job.full:
            lp_full, ent_full = xt - stats["lse_full"], stats["ent_full"]
        else:
            lp_full = ent_full = xt.new_empty(0)
            ctx.mark_non_differentiable(lp_full, ent_full)
        if not job.entropy:
            ent_sup, ent_full = ent_sup.new_zeros(0), ent_full.new_zeros(0)
            ctx.mark_non_differentiable(ent_sup, ent_full)
        ctx.job, ctx.stats, ctx.backend = job, stats, backend
        ctx.set_materialize_grads(False)
        return lp_sup, ent_sup, lp_full, ent_full

    @staticmethod
    def backward(ctx, g_lp, g_ent, g_lp_full, g_ent_full):
        job = ctx.job
        if job.support is None:  # the "support" outputs are the full ones
            grads = {"lp_sup": None, "ent_sup": None, "lp_full": _add(g_lp, g_lp_full if job.full else None),
                     "ent_full": _add(g_ent, g_ent_full if job.full else None)}
        else:
            grads = {"lp_sup": g_lp, "ent_sup": g_ent, "lp_full": g_lp_full if job.full else None,
                     "ent_full": g_ent_full if job.full else None}
        if all(v is None for v in grads.values()):
            return None, None, None
        if job.num_rows == 0:
            return torch.zeros_like(job.logits_XV), None, None
        return ctx.backend.backward(job, ctx.stats, grads), None, None


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a + b


def score_logits(
    logits_XV: torch.Tensor,
    target_G: torch.Tensor,
    *,
    rows_G: torch.Tensor | None = None,
    support: SupportCSR | None = None,
    temperature: float | torch.Tensor = 1.0,
    full: bool = False,
    shard: VocabShard | None = None,
    entropy: bool = True,
    chunk_bytes: int | None = None,
    backend: str = "auto",
) -> TokenScores:
    """Score `target_G` under softmax(logits / temperature), renormalised over `support` when given.

    `logits_XV`: any float dtype; row g is logits_XV[rows_G[g]] (or row g without rows_G, so a
    [B*S, V] view can be scored without copying the scored rows out). Computation runs in float32
    (float64 for float64 logits); gradients flow to `logits_XV` (zero on rows not scored and on ids
    outside the kept set). `temperature`: a float or a [G] tensor; 0 = greedy (see module doc).
    `full=True` adds the full-vocabulary log p and entropy. `shard`: logits are this rank's
    vocabulary slice (Megatron tensor parallelism); every rank calls with the same rows.
    `entropy=False` skips the entropies (None in the result): a loss on log p alone saves two
    passes over each full-vocabulary chunk (eager). `backend`: a `SCORING_BACKENDS` name, or "auto"
    (`torch_compiled` on CPU for full-vocabulary work of at least COMPILE_MIN_ELEMENTS logits,
    `torch_chunked` otherwise). No scored rows (G = 0: a batch without generated tokens) gives empty
    [0] scores in the compute dtype and a zero gradient. Bad input (an id outside [0, V), a kept
    set without its sampled token or holding an id twice, a bad temperature, non-finite logits)
    raises ScoringInputError naming the row and the value.
    """
    job = _prepare(logits_XV, target_G, rows_G, support, temperature, full, shard, chunk_bytes)
    job.entropy = bool(entropy)
    if backend == "auto":
        backend = AUTO_BACKEND[-1](job) if AUTO_BACKEND else "torch_chunked"
    impl = SCORING_BACKENDS.get(backend)
    # a trainer's autocast (verl's FSDP forward runs under bf16 autocast) would put bmm/matmul in bf16:
    # the statistics are fp32 math by contract, whatever the ambient autocast says
    with torch.autocast(logits_XV.device.type, enabled=False):
        lp, ent, lp_full, ent_full = _ScoreFunction.apply(logits_XV, job, impl)
    return TokenScores(lp, ent if entropy else None, lp_full if full else None, ent_full if full and entropy else None)


def _check_finite(job: _Job, stats: dict[str, torch.Tensor]) -> None:
    """NaN/inf logits make the per-row statistics non-finite: find the row and name the value."""
    bad = ~torch.isfinite(stats["xt"])
    for name in ("lse_full", "ent_full", "lse_sup", "ent_sup"):
        if name in stats:
            part = ~torch.isfinite(stats[name])
            if name.endswith("full"):
                part &= job.dense_G
            bad |= part
    if not bool(bad.any()):
        return
    r = _first(bad)
    src = r if job.rows_G is None else int(job.rows_G[r])
    row = job.logits_XV[src]
    nonfinite = ~torch.isfinite(row)
    if bool(nonfinite.any()):
        col = _first(nonfinite)
        raise _fail("logits", r, "finite logits", f"{float(row[col])} at token {col + job.start} (logits row {src})")
    raise _fail("logits", r, "finite scores", f"a non-finite log-sum-exp from logits in [{float(row.min())}, {float(row.max())}]",
                "the scaled logits overflow; check the temperature")


def engine_support_logprobs(logits_GV: torch.Tensor, target_G: torch.Tensor, support: SupportCSR,
                            temperature_G: torch.Tensor | None = None) -> torch.Tensor:
    """log p(target) of softmax(logits / T) renormalised over each row's kept ids; forward only, fp32.

    For an inference engine scoring one step's rows (vLLM re-scoring, force.py): the rows of many
    requests share one call, so a target outside its row's kept set gets -inf (p = 0) for that row
    instead of the ScoringInputError of `score_logits`, which would fail every request of the step;
    the client reports it per trace. A row with an empty CSR row (no support recorded) is scored
    over V. Temperature 0 (greedy) scores unscaled, as in `score_logits`. The engine's rows are
    already materialised as [G, V] logits (G is a step's scored rows), so no chunking.
    """
    x_GV = logits_GV.float()
    if temperature_G is not None:
        t_G = temperature_G.to(device=x_GV.device, dtype=torch.float32)
        t_G = torch.where(t_G > 0, t_G, torch.ones_like(t_G))
        if bool((t_G != 1).any()):
            x_GV = x_GV / t_G[:, None]
    target_G = target_G.reshape(-1).to(device=x_GV.device, dtype=torch.long)
    lse_G = torch.logsumexp(x_GV, dim=-1)
    out_G = x_GV.gather(1, target_G.reshape(-1, 1)).squeeze(1)
    sup = support.to(x_GV.device)
    if sup.ids_N.numel():
        r_N = _entry_rows(sup.offsets_G1, 0, sup.num_rows)  # the CSR row lookup score_logits uses (no repeat_interleave)
        i_N = sup.ids_N.long()
        v_N = x_GV[r_N, i_N]
        m_G = torch.full_like(lse_G, float("-inf")).scatter_reduce(0, r_N, v_N, "amax")
        s_G = torch.zeros_like(lse_G).index_add_(0, r_N, (v_N - m_G[r_N]).exp())
        has_G = torch.zeros_like(lse_G, dtype=torch.bool)
        has_G[r_N] = True
        hit_G = torch.zeros_like(has_G)
        hit_G[r_N[i_N == target_G[r_N]]] = True
        lse_G = torch.where(has_G, m_G + s_G.log(), lse_G)
        out_G = torch.where(has_G & ~hit_G, torch.full_like(out_G, float("-inf")), out_G)  # outside: p = 0
    return out_G - lse_G
