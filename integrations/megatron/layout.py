"""Plan ids in Megatron's token order: sequence-first, every position holding K valid experts.

A RoutePlan flattens its padded batch row-major, n = b * S + s (batch-major). Megatron runs on
hidden states [S, B, H] and its router flattens them to m = s * B + b (sequence-first), so each
layer's ids are transposed before they reach `RouterReplay`.

Megatron's REPLAY_FORWARD gathers scores at the given ids for every position, so positions the
plan leaves unrouted (-1: pads and each sequence's final token) need valid ids too. They get a
fixed rotating set, (m * K + j) mod E for j < K: distinct per position, spread evenly over the
experts (no expert is flooded, which matters for capacity and expert-bias counts), deterministic
and identical in recompute. Under causal attention none of these positions reaches a scored
logit, so their experts do not change the loss (the HF adapter routes them freely instead;
Megatron's replay path has no free choice to offer).

Legend: B batch rows, S padded length, N = B * S (batch-major), M = S * B (sequence-first),
K top-k, E experts, L MoE layers.
"""

from __future__ import annotations

import torch


def fill_ids_MK(num_positions: int, top_k: int, num_experts: int) -> torch.Tensor:
    """The rotating ids given to unrouted positions: row m is (m * K + j) mod E, j < K."""
    m_M1 = torch.arange(num_positions, dtype=torch.int64).unsqueeze(-1)
    return (m_M1 * top_k + torch.arange(top_k, dtype=torch.int64)) % num_experts


def sequence_first_ids(ids_NK: torch.Tensor, routed_N: torch.Tensor, batch: int, seq: int, num_experts: int) -> torch.Tensor:
    """One layer's plan ids [B*S, K] (batch-major, -1 unrouted) -> Megatron's [S*B, K] int64, all valid."""
    k = ids_NK.shape[-1]
    ids_MK = ids_NK.view(batch, seq, k).transpose(0, 1).reshape(seq * batch, k)
    routed_M1 = routed_N.view(batch, seq).transpose(0, 1).reshape(seq * batch, 1)
    fill_MK = fill_ids_MK(seq * batch, k, num_experts).to(ids_MK.device)
    return torch.where(routed_M1, ids_MK, fill_MK).to(torch.int64).contiguous()


def megatron_inputs(plan) -> dict[str, torch.Tensor]:
    """GPTModel keyword arguments for a plan's batch: input_ids, position_ids and a boolean
    attention_mask [B, 1, S, S] (True = masked: future keys and pad keys), on the plan's device."""
    s = plan.seq_len
    keep_BS = plan.attention_mask_BS.bool()
    future_SS = torch.ones(s, s, dtype=torch.bool, device=keep_BS.device).triu(1)
    mask_B1SS = future_SS.view(1, 1, s, s) | ~keep_BS.view(-1, 1, 1, s)
    return {"input_ids": plan.input_ids_BS, "position_ids": plan.position_ids_BS, "attention_mask": mask_B1SS}
