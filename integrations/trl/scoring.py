"""The trainer side: TRL's per-token logprobs and entropies, under the traces' routes and supports.

TRL lays a batch out as [left-padded prompt | right-padded completion] and scores the completion
columns with a fused LM head over the full vocabulary. Here the batch is checked against its traces
(`check_rows`: every real token must be the trace's token, in place), laid out again by the plan
(left-padded), routed with the engine's experts when the preset replays routes, and scored with
`score_tokens` (renormalised over each token's kept set when the preset replays supports). Logits
are computed only for the k = C + 1 last columns (HF's `logits_to_keep`), as TRL's own path does.

Legend: B rows, S padded columns (TRL's: P + C, P prompt, C completion), k = C + 1 kept logit columns,
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


def check_rows(traces: Sequence[RolloutTrace], input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor,
               completion_cols: int) -> None:
    """Row b of TRL's batch must be trace b: its prompt ending at column P, its completion after.

    TRL's mask may be narrower than the trace (e.g. `mask_truncated_completions` zeroes a truncated
    row's completion; the loss mask then drops it, and the forward still runs the engine's tokens),
    never wider. `build_plan`'s own batch check requires each row's mask to cover exactly its
    trace's tokens, so TRL's layout is checked here and the plan lays the batch out again.
    """
    b_count, s_len = attention_mask_BS.shape
    p_cols = s_len - completion_cols
    ids_BS = input_ids_BS.detach().cpu().numpy()
    mask_BS = attention_mask_BS.detach().cpu().numpy() != 0
    for b, trace in enumerate(traces):
        trace.require_single_span("TRL's prompt/completion layout")
        gen = trace.num_generated
        if trace.prompt_len > p_cols or gen > completion_cols:
            raise BatchLayoutError(Where(record=trace.key, field=f"trl batch row {b}"),
                                   f"a prompt of {trace.prompt_len} and a completion of {gen} tokens (the trace)",
                                   f"{p_cols} prompt and {completion_cols} completion columns",
                                   "the batch was truncated after generation; keep TRL's prompt/completion lengths")
        lo, hi = p_cols - trace.prompt_len, p_cols + gen
        outside = mask_BS[b].copy()
        outside[lo:hi] = False
        if outside.any():
            raise BatchLayoutError(Where(record=trace.key, field=f"attention_mask[row {b}]"),
                                   "attention only on the trace's tokens",
                                   f"column {int(np.flatnonzero(outside)[0])} attended outside them",
                                   "the batch was re-packed after generation")
        row = ids_BS[b, lo:hi]
        if not np.array_equal(row, trace.token_ids_S):
            j = int(np.flatnonzero(row != trace.token_ids_S)[0])
            raise BatchLayoutError(Where(record=trace.key, field=f"input_ids[row {b}]"),
                                   f"token {int(trace.token_ids_S[j])} at position {j}", int(row[j]),
                                   "the batch's tokens are not the ones the engine sampled")


class _RoutesRan:
    """Records the expert ids each router hands its experts (after replay, when replaying)."""

    def __init__(self, sites: dict) -> None:
        self.ids: dict[int, torch.Tensor] = {}
        # through the adapter: a router's output is not always (logits, weights, ids) (DBRX routes in its parent block)
        self._handles = [s.adapter.register_hook(s.module, self._hook(lid, s.adapter.unpack)) for lid, s in sites.items()]

    def _hook(self, lid: int, unpack):
        def hook(module, args, output):
            if not in_backward():
                ids = unpack(output)[2]
                self.ids[lid] = ids.detach().reshape(-1, ids.shape[-1]).clone()

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

    check_rows(traces, input_ids_BS, attention_mask_BS, completion_cols)
    with_routes = all(t.routes_TLK is not None for t in traces)
    # the plan's own left-padded batch: every completion ends in the last column, so the k = C + 1
    # kept logit columns hold every scored position, as in TRL's [prompt | completion] layout.
    # Routes are laid out where they are replayed or measured (route flips); a preset that routes
    # freely (`none`) skips them on its unmeasured passes (TRL's training forward, π_ref)
    plan = build_plan(traces, geometry, config=dataclasses.replace(preset.replay.plan, padding_side="left"),
                      routes=preset.replay.routes or (measure and with_routes))
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
    if bool((col_G < s_len - k_cols).any()):  # left padding puts every completion in the last C columns
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
    """The batch's mismatch metrics, plus how often free routing would have picked other experts."""
    m = batch.mismatch_metrics(train_G, ran.ids if ran is not None else None)
    if session is not None and session.flips is not None:
        m["moe_replay/free_route_flip_rate"] = session.flips.rate
    return m
