"""Sampling-support capture at the exact point where vLLM truncates.

vLLM's sampler applies temperature and min-p, then `TopKTopPSampler.forward` calls
`apply_top_k_top_p(logits, k, p)` (removed tokens become -inf) and draws from what is left. Our
wrapper runs that same truncation first, reads the kept set off the truncated logits, then hands the
already-truncated logits to the original forward with k=p=None (the truncation is idempotent and
runs once). The kept set is therefore exactly the finite entries the sample was drawn from,
whatever produced the -inf (top-k, top-p, min-p, allowed/bad words, logits processors).

Only sparse data leaves this module: per row the sorted kept ids (CSR), and the sampled token's
logprob log softmax(truncated logits)[token]. Rows above max_support keep no ids (policy decides).
Greedy rows (temperature 0) have support {argmax} and logprob 0: a point mass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

_SAMPLING_EPS = 1e-5  # vllm.v1.sample.sampler._SAMPLING_EPS: below it a row is greedy


@dataclass
class StepSamples:
    """Sampler outcome of one engine step, rows in input-batch order (B rows)."""

    tokens_B: np.ndarray
    """int64 sampled token per row."""
    offsets_B1: np.ndarray
    """int64 CSR offsets into ids_N; overflowing rows are empty."""
    ids_N: np.ndarray
    """int32 kept token ids, sorted within each row."""
    sizes_B: np.ndarray
    """int64 true support size per row (also for rows whose ids were not kept)."""
    logprobs_B: np.ndarray
    """float32 logprob of the sampled token under the truncated distribution."""


class SupportCapture:
    """Wraps one Sampler instance; `last` holds the most recent StepSamples."""

    def __init__(self, max_support: int, want_support: bool, want_logprobs: bool) -> None:
        self.max_support = max_support
        self.want_support = want_support
        self.want_logprobs = want_logprobs
        self._observed: tuple | None = None
        self.orig_s = 0.0
        self.last: StepSamples | None = None

    # -- called by the TopKTopPSampler wrapper (random rows exist) -----------------------------
    def truncate_and_observe(self, orig_forward, logits_BV, generators, k, p):
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        t0 = time.perf_counter()
        logits_BV = apply_top_k_top_p(logits_BV, k, p)  # work the original would do itself
        truncate_s = time.perf_counter() - t0
        kept_BV = torch.isfinite(logits_BV)
        sizes_B = kept_BV.sum(dim=1)
        lse_B = torch.logsumexp(logits_BV, dim=1) if self.want_logprobs else None
        # Read the logits we need before sampling: the sampler may work in place.
        t0 = time.perf_counter()
        sampled_random_B, processed = orig_forward(logits_BV, generators, None, None)
        self.orig_s = time.perf_counter() - t0 + truncate_s
        lp_B = None
        if self.want_logprobs:
            lp_B = logits_BV.gather(1, sampled_random_B.view(-1, 1).long()).view(-1) - lse_B
        offsets, ids = None, None
        if self.want_support:
            over_B = sizes_B > self.max_support
            if bool(over_B.any()):
                kept_BV[over_B] = False
            nz_N2 = kept_BV.nonzero()
            ids = nz_N2[:, 1].to(torch.int32).numpy()
            counts_B = torch.where(over_B, 0, sizes_B)
            offsets = np.zeros(len(sizes_B) + 1, dtype=np.int64)
            np.cumsum(counts_B.numpy(), out=offsets[1:])
        self._observed = (offsets, ids, sizes_B.numpy().astype(np.int64), lp_B)
        return sampled_random_B, processed

    # -- called by the Sampler wrapper after sampling -----------------------------------------
    def finish(self, sampled_B1: torch.Tensor, sampling_metadata) -> StepSamples:
        tokens_B = sampled_B1.view(-1).numpy().astype(np.int64)
        B = len(tokens_B)
        observed, self._observed = self._observed, None
        if observed is None:  # all greedy: topk/topp never ran
            greedy_B = np.ones(B, dtype=bool)
            offsets = np.zeros(B + 1, dtype=np.int64)
            ids = np.zeros(0, dtype=np.int32)
            sizes = np.ones(B, dtype=np.int64)
            lps = np.zeros(B, dtype=np.float32)
        else:
            offsets, ids, sizes, lp_B = observed
            temp = sampling_metadata.temperature
            greedy_B = (temp < _SAMPLING_EPS).numpy() if temp is not None else np.zeros(B, dtype=bool)
            lps = lp_B.numpy().astype(np.float32) if lp_B is not None else np.zeros(B, dtype=np.float32)
            if offsets is None:
                offsets, ids = np.zeros(B + 1, dtype=np.int64), np.zeros(0, dtype=np.int32)
        if greedy_B.any():
            offsets, ids, sizes = _replace_rows_with_token(offsets, ids, sizes, greedy_B, tokens_B)
            lps = np.where(greedy_B, np.float32(0.0), lps).astype(np.float32)
        if not self.want_support:
            offsets, ids = np.zeros(B + 1, dtype=np.int64), np.zeros(0, dtype=np.int32)
        self.last = StepSamples(tokens_B, offsets, ids, sizes, lps)
        return self.last


def _replace_rows_with_token(offsets, ids, sizes, rows_B, tokens_B):
    """Rows flagged in rows_B become the single sampled token (greedy rows)."""
    B = len(rows_B)
    parts, counts = [], np.empty(B, dtype=np.int64)
    for b in range(B):
        if rows_B[b]:
            parts.append(np.array([tokens_B[b]], dtype=np.int32))
        else:
            parts.append(ids[offsets[b] : offsets[b + 1]])
        counts[b] = len(parts[-1])
    new_offsets = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(counts, out=new_offsets[1:])
    new_sizes = np.where(rows_B, 1, sizes)
    return new_offsets, (np.concatenate(parts) if parts else ids), new_sizes
