"""The trainer side: TRL's per-token logprobs and entropies, under the traces' routes and supports.

TRL lays a batch out as [left-padded prompt | right-padded completion] and scores the completion
columns with a fused LM head over the full vocabulary. Here the same batch is checked against its
traces (`build_plan`: every real token must be the trace's token, in order), routed with the
engine's experts when the preset replays routes, and scored with `score_tokens` (renormalised over
each token's kept set when the preset replays supports). Logits are computed only for the k = C + 1
last columns (HF's `logits_to_keep`), as TRL's own path does.

Legend: B rows, S = P + C padded columns (P prompt, C completion), k = C + 1 kept logit columns,
G generated tokens (row-major), N = B * S flat positions, T routed positions, L MoE layers, K top-k.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ...enablement import TrainBatch
from ...errors import Where
from ...geometry import ModelGeometry
from ...metrics import mismatch_metrics
from ...presets import Preset
from ...replay import BatchLayoutError, build_plan, score_tokens
from ...replay.ledger import in_backward
from ...trace import RolloutTrace


@dataclass
class ChunkScores:
    logps_BC: torch.Tensor
    entropy_BC: torch.Tensor
    aux_loss: torch.Tensor | None
    metrics: dict[str, float]
    """moe_replay's mismatch metrics of this chunk (empty unless asked for)."""


def trace_mask_BS(traces: Sequence[RolloutTrace], attention_mask_BS: torch.Tensor, completion_cols: int) -> torch.Tensor:
    """The attention mask the engine ran with: each trace's prompt ending at column P, its completion after.

    TRL's own mask may be narrower (e.g. `mask_truncated_completions` zeroes a truncated row's
    completion; the loss mask still drops it), never wider: a position TRL attends to that the
    trace does not hold is refused, naming the row.
    """
    b_count, s_len = attention_mask_BS.shape
    p_cols = s_len - completion_cols
    mask_BS = torch.zeros((b_count, s_len), dtype=torch.long)
    for b, trace in enumerate(traces):
        gen = trace.num_tokens - trace.prompt_len
        where = Where(record=trace.key, field=f"trl batch row {b}")
        if trace.prompt_len > p_cols or gen > completion_cols:
            raise BatchLayoutError(where, f"a prompt of {trace.prompt_len} and a completion of {gen} tokens (the trace)",
                                   f"{p_cols} prompt and {completion_cols} completion columns",
                                   "the batch was truncated after generation; keep TRL's prompt/completion lengths")
        mask_BS[b, p_cols - trace.prompt_len : p_cols + gen] = 1
    wider_BS = attention_mask_BS.detach().cpu().bool() & ~mask_BS.bool()
    if wider_BS.any():
        b, col = (int(x) for x in wider_BS.nonzero()[0])
        raise BatchLayoutError(Where(record=traces[b].key, field=f"attention_mask[row {b}]"),
                               "attention only on the trace's tokens", f"column {col} attended outside them",
                               "the batch was re-packed after generation")
    return mask_BS


class _RoutesRan:
    """Records the expert ids each router hands its experts (after replay, when replaying)."""

    def __init__(self, sites: dict) -> None:
        self.ids: dict[int, torch.Tensor] = {}
        self._handles = [s.module.register_forward_hook(self._hook(lid)) for lid, s in sites.items()]

    def _hook(self, lid: int):
        def hook(module, args, output):
            if not in_backward():
                self.ids[lid] = output[2].detach().reshape(-1, output[2].shape[-1]).clone()

        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def to_columns(x_G: torch.Tensor, gen_offsets_B1: np.ndarray, completion_cols: int) -> torch.Tensor:
    """Flat [G] (row-major) -> [B, C] with row b's tokens in columns 0.. (zeros after), keeping grad."""
    counts = np.diff(gen_offsets_B1)
    rows = torch.from_numpy(np.repeat(np.arange(len(counts)), counts)).to(x_G.device)
    cols = torch.from_numpy(np.concatenate([np.arange(n) for n in counts])).to(x_G.device)
    out = x_G.new_zeros((len(counts), completion_cols))
    return out.index_put((rows, cols), x_G)


def score_chunk(
    model: Any,
    hf_model: torch.nn.Module,
    traces: Sequence[RolloutTrace],
    input_ids_BS: torch.Tensor,
    attention_mask_BS: torch.Tensor,
    completion_cols: int,
    *,
    preset: Preset,
    geometry: ModelGeometry,
    stack: contextlib.ExitStack,
    autocast: Any = contextlib.nullcontext,
    compute_aux_loss: bool = False,
    measure: bool = False,
) -> ChunkScores:
    """Logprobs and entropies [B, C] of the completion tokens, as TRL's `_get_per_token_logps_and_entropies`.

    The replay session is entered on `stack`: the caller closes it after backward, so activation
    recompute inside backward replays the same routes (invariant 6).
    """
    from ..hf.replay import replay
    from ..hf.routers import find_routers

    mask_BS = trace_mask_BS(traces, attention_mask_BS, completion_cols)
    with_routes = all(t.routes_TLK is not None for t in traces)
    plan = build_plan(traces, geometry, input_ids_BS=input_ids_BS.detach().cpu(), attention_mask_BS=mask_BS,
                      config=preset.replay.plan, routes=with_routes or preset.replay.routes)
    session = None
    if preset.replay.routes:
        session = stack.enter_context(replay(hf_model, plan, track_flips=measure))
        plan = session.plan
    device = input_ids_BS.device
    inputs = {k: v.to(device) for k, v in plan.model_inputs().items()}
    k_cols = completion_cols + 1
    ran = _RoutesRan(find_routers(hf_model)) if measure and with_routes else None
    try:
        with autocast():
            out = model(**inputs, logits_to_keep=k_cols, use_cache=False,
                        **({"output_router_logits": True} if compute_aux_loss else {}))
    finally:
        if ran is not None:
            ran.close()

    s_len = plan.seq_len
    pos_G = plan.score_pos_G
    col_G = pos_G % s_len
    if bool((col_G < s_len - k_cols).any()):  # trace_mask_BS puts every completion after column P - 1
        raise BatchLayoutError(Where(field="score positions"), f"columns >= {s_len - k_cols}", int(col_G.min()))
    kept = dataclasses.replace(plan, score_pos_G=(pos_G // s_len) * k_cols + col_G - (s_len - k_cols))
    scores = score_tokens(out.logits, kept, use_support=preset.replay.support)  # at each trace's temperature

    metrics: dict[str, float] = {}
    if measure:
        metrics = _metrics(TrainBatch(preset, plan, traces), scores.logprobs_G.detach(), ran, session)
    return ChunkScores(
        logps_BC=to_columns(scores.logprobs_G, plan.gen_offsets_B1, completion_cols),
        entropy_BC=to_columns(scores.entropy_G, plan.gen_offsets_B1, completion_cols),
        aux_loss=getattr(out, "aux_loss", None) if compute_aux_loss else None,
        metrics=metrics,
    )


def _metrics(batch: TrainBatch, train_G: torch.Tensor, ran: _RoutesRan | None, session: Any) -> dict[str, float]:
    """rollout_corr/* (trainer vs engine logprobs) and moe_replay/route_* (experts that ran vs the engine's)."""
    plan = batch.plan
    route_kwargs: dict[str, Any] = {}
    if ran is not None:
        lids = plan.geometry.moe_layer_ids
        routed_N = plan.routed_N.cpu()
        ran_NLK = torch.stack([ran.ids[lid].cpu() for lid in lids], dim=1)
        trace_NLK = plan.ids_LNK.cpu().permute(1, 0, 2)
        route_kwargs = dict(train_routes=ran_NLK[routed_N], trace_routes=trace_NLK[routed_N], layer_ids=lids)
    cpu_G = train_G.double().cpu()
    m = mismatch_metrics(batch.to_rows(cpu_G), batch.to_rows(batch.rollout_logprobs.cpu()), batch.row_mask(), **route_kwargs)
    if session is not None and session.flips is not None:
        m["moe_replay/free_route_flip_rate"] = session.flips.rate
    return m
