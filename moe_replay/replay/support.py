"""Score a plan's generated tokens from the trainer's logits, over the exact sampling support
(invariant 5).

The engine samples from softmax(logits / temperature) restricted to the kept set (after top-k,
top-p, min-p); its "processed" logprobs are log_softmax over that set. The trainer scores the same
distribution: `score_logits` (scoring.py) renormalises over each row's kept set, read from the
traces' CSR supports, at each trace's recorded temperature. Ids outside the kept set get exactly
zero probability and zero gradient.

Legend: B batch, S sequence, N = B * S, G scored (generated) tokens, V vocabulary.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import Where
from .errors import ScoringInputError
from .plan import RoutePlan
from .scoring import SupportCSR, TokenScores, VocabShard, score_logits


def score_tokens(
    logits_BSV: torch.Tensor,
    plan: RoutePlan,
    *,
    temperature: float | torch.Tensor | None = None,
    use_support: bool = True,
    full: bool = False,
    entropy: bool = True,
    shard: VocabShard | None = None,
) -> TokenScores:
    """Score every generated token of the plan's traces from the trainer's logits [B, S, V].

    `temperature`: None scores each trace at its recorded sampling temperature (trace.sampling);
    a float or a [G] tensor overrides it. With `use_support` the distribution is renormalised over
    each trace's recorded kept set (rows without a support use the full vocabulary), matching the
    engine's processed logprobs; `full=True` adds the full-vocabulary log p and entropy;
    `entropy=False` skips the entropies (cheaper when only log p is used). The scored
    rows are read in place (no copy of the [G, V] rows), in float32 whatever the logits dtype.
    Errors name the trace and the generated token.
    """
    logits_NV = logits_BSV.reshape(-1, logits_BSV.shape[-1])
    dev = logits_NV.device
    if temperature is None:
        temperature = plan.temperature_G
    support = None
    if use_support and any(s is not None for s in plan.supports):
        support = SupportCSR.from_supports(plan.supports, np.diff(plan.gen_offsets_B1).tolist(), dev)
    try:
        return score_logits(logits_NV, plan.target_G.to(dev), rows_G=plan.score_pos_G.to(dev), support=support,
                            temperature=temperature, full=full, entropy=entropy, shard=shard)
    except ScoringInputError as e:
        if e.row is None:
            raise
        b = int(np.searchsorted(plan.gen_offsets_B1, e.row, side="right") - 1)
        field = f"{e.where.field} (generated token {e.row - int(plan.gen_offsets_B1[b])} of the trace)"
        err = ScoringInputError(Where(record=plan.keys[b], field=field), e.expected, e.found, e.detail)
        err.row = e.row
        raise err from None
