"""verl's two micro-batch layouts, mapped onto a RoutePlan through verl's own sequence offsets.

verl hands the engine each micro-batch as jagged `input_ids` (sample b's tokens are
`values()[cu[b]:cu[b+1]]`, cu = `offsets()`). Its model forward then runs either
  * padded (`use_remove_padding=False`): [B, S] right-padded, sample b at columns 0.., or
  * packed (`use_remove_padding=True`): one row [1, cu[B]], sample b at cu[b].., each restarting
    its position ids (flash-attention varlen on GPU; transformers' packed-sequence mask elsewhere).
The plan is checked and laid out on the padded layout (`padded_batch`, build_plan's checks name
the trace and the row); for the packed layout `pack_plan` moves every route row and scored
position to its packed index cu[b] + t. In both, verl's jagged log-prob of (b, t) sits at the flat
index cu[b] + t (`nested_index_G`).

Legend: B samples, S padded length, N positions of the forward (B * S padded, cu[B] packed),
L MoE layers, K top-k, G scored tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from ...errors import Where
from ...replay import BatchLayoutError, RoutePlan


def padded_batch(offsets_B1: torch.Tensor, values_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, S], attention_mask [B, S]) right-padded from verl's jagged ids."""
    lengths_B = offsets_B1.diff()
    b_count, s_len = len(lengths_B), int(lengths_B.max())
    b_N = torch.repeat_interleave(torch.arange(b_count), lengths_B)
    t_N = torch.arange(len(values_N)) - offsets_B1[b_N]
    ids_BS = torch.zeros((b_count, s_len), dtype=torch.long)
    mask_BS = torch.zeros((b_count, s_len), dtype=torch.long)
    ids_BS[b_N, t_N] = values_N.long()
    mask_BS[b_N, t_N] = 1
    return ids_BS, mask_BS


def pack_plan(plan: RoutePlan, offsets_B1: torch.Tensor) -> RoutePlan:
    """The plan with its routes and scored positions in verl's packed order (one row of cu[B] tokens).

    Per-sample fields (keys, supports, generated-token offsets) stay as they are; the scoring
    temperature must then be passed explicitly (the packed plan has one row).
    """
    offsets_B1 = offsets_B1.cpu().long()
    lengths_B = offsets_B1.diff()
    if not torch.equal(lengths_B, torch.as_tensor(plan.lengths_B)) or not (plan.offsets_B == 0).all():
        raise BatchLayoutError(Where(field="input_ids.offsets()"), f"right-padded rows of lengths {plan.lengths_B.tolist()}",
                               lengths_B.tolist(), "the packed batch does not hold the plan's samples")
    s_len = plan.seq_len
    b_N = torch.repeat_interleave(torch.arange(len(lengths_B)), lengths_B)
    src_N = b_N * s_len + torch.arange(int(offsets_B1[-1])) - offsets_B1[b_N]
    pos_G = plan.score_pos_G.cpu()
    return dataclasses.replace(
        plan,
        input_ids_BS=plan.input_ids_BS.reshape(-1)[src_N][None],
        attention_mask_BS=torch.ones((1, len(src_N)), dtype=torch.long),
        position_ids_BS=plan.position_ids_BS.reshape(-1)[src_N][None],
        offsets_B=plan.offsets_B * 0,
        ids_LNK=plan.ids_LNK[:, src_N],
        routed_N=plan.routed_N[src_N],
        score_pos_G=offsets_B1[pos_G // s_len] + pos_G % s_len,
    )


def nested_index_G(plan: RoutePlan, offsets_B1: torch.Tensor, packed: bool) -> torch.Tensor:
    """Flat index into verl's jagged per-token outputs of each scored position (the logits that
    predict generated token g); refuses a position at a sample's last token (it predicts nothing)."""
    offsets_B1 = offsets_B1.to(plan.score_pos_G.device)
    if packed:
        idx_G = plan.score_pos_G
        b_G = torch.searchsorted(offsets_B1, idx_G, right=True) - 1
    else:
        b_G = plan.score_pos_G // plan.seq_len
        idx_G = offsets_B1[b_G] + plan.score_pos_G % plan.seq_len
    bad_G = idx_G >= offsets_B1[b_G + 1] - 1
    if bool(bad_G.any()):
        g = int(bad_G.nonzero()[0])
        raise BatchLayoutError(Where(record=plan.keys[int(b_G[g])], field="log_probs"),
                               "a scored position before the sample's last token", f"flat index {int(idx_G[g])}")
    return idx_G
