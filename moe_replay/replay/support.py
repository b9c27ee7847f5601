"""Log-probabilities and entropy renormalised over the exact sampling support (invariant 5).

The engine samples from softmax(logits / temperature) restricted to the kept set (after top-k,
top-p, min-p); its "processed" logprobs are log_softmax over that set. The trainer scores the same
distribution by masking its own logits to the same set before the log_softmax. Masked entries get
exactly zero probability and zero gradient.

Legend: B batch, S sequence, N = B * S, G scored (generated) tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..trace import SamplingSupport
from .plan import RoutePlan
from .scoring import TokenScores


def support_mask_GV(
    supports: Sequence[SamplingSupport | None], rows_per_support: Sequence[int], vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """bool [G, V]: True at kept tokens. A None support keeps the whole vocabulary for its rows."""
    total = int(sum(rows_per_support))
    mask_GV = torch.zeros((total, vocab_size), dtype=torch.bool, device=device)
    start = 0
    for sup, rows in zip(supports, rows_per_support):
        if sup is None:
            mask_GV[start : start + rows] = True
        else:
            if sup.num_rows != rows:
                raise ValueError(f"support has {sup.num_rows} rows, expected {rows} (one per generated token)")
            row_N = np.repeat(np.arange(rows, dtype=np.int64), sup.sizes_G()) + start
            mask_GV[torch.from_numpy(row_N).to(device), torch.from_numpy(sup.ids_N.astype(np.int64)).to(device)] = True
        start += rows
    return mask_GV


def masked_logprobs(
    logits_GV: torch.Tensor,
    target_G: torch.Tensor,
    mask_GV: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
) -> TokenScores:
    """log p(target) and entropy of softmax(logits / temperature) renormalised over `mask_GV`.

    Computed in float32 whatever the logits dtype (the engine's processed logprobs are fp32).
    `temperature` is a float or a [G] tensor (per-token, e.g. per-request sampling params); 0 means
    greedy and leaves the logits unscaled (its kept set is the argmax alone, so log p = 0).
    """
    x_GV = logits_GV.float()
    if isinstance(temperature, torch.Tensor):  # 0 = greedy: its support is one token, scale is moot
        t_G = temperature.to(x_GV).reshape(-1, 1)
        x_GV = x_GV / torch.where(t_G > 0, t_G, torch.ones_like(t_G))
    elif temperature not in (0.0, 1.0):
        x_GV = x_GV / temperature
    if mask_GV is not None:
        x_GV = x_GV.masked_fill(~mask_GV, float("-inf"))
    logp_GV = torch.log_softmax(x_GV, dim=-1)
    logprobs_G = logp_GV.gather(1, target_G.reshape(-1, 1)).squeeze(1)
    safe_GV = logp_GV if mask_GV is None else logp_GV.masked_fill(~mask_GV, 0.0)  # 0 * -inf would be NaN
    entropy_G = -(safe_GV.exp() * safe_GV).sum(dim=-1)
    return TokenScores(logprobs_G, entropy_G)


def score_tokens(
    logits_BSV: torch.Tensor, plan: RoutePlan, *, temperature: float | torch.Tensor = 1.0, use_support: bool = True
) -> TokenScores:
    """Score every generated token of the plan's traces from the trainer's logits [B, S, V].

    With `use_support` the distribution is renormalised over each trace's recorded kept set (rows
    without a support use the full vocabulary), matching the engine's processed logprobs.
    """
    logits_NV = logits_BSV.reshape(-1, logits_BSV.shape[-1])
    pos_G = plan.score_pos_G.to(logits_NV.device)
    logits_GV = logits_NV.index_select(0, pos_G)
    mask_GV = None
    if use_support and any(s is not None for s in plan.supports):
        rows = np.diff(plan.gen_offsets_B1).tolist()
        mask_GV = support_mask_GV(plan.supports, rows, logits_GV.shape[-1], logits_GV.device)
    return masked_logprobs(logits_GV, plan.target_G.to(logits_NV.device), mask_GV, temperature)
