"""Traces in verl's batch: one encoded trace per sample, in the DataProto's `non_tensor_batch`.

verl carries per-sample objects (`uid`, `raw_prompt`, ...) as numpy object arrays in
`DataProto.non_tensor_batch`; `DataProto.to_tensordict` turns each into a NonTensorStack that
follows its sample through verl's shuffles, mini-batch and micro-batch splits (also the dynamic
batch-size re-ordering). moe_replay's traces ride there under `TRACES_KEY`, each as moe_replay's
compact record (`moe_replay.codec.encode_trace`: entropy-coded routes and CSR supports; 0.62 B
per token-layer on the tiny model's real traces in benchmarks/store.py, where verl's dense padded
[B, T, L, K] integer tensor spends K ids of 4-8 B each, padding included), so verl's own
`routed_experts` tensor is not needed. A multi-turn rollout is one stitched record
(`stitch_turns`): every turn's routes, in one record.

`to_dataproto` lays the traces out the way verl's agent loop hands rollouts to the trainer
(left-padded prompts, right-padded responses, `rollout_log_probs`), for drivers that generate
with moe_replay's capture.

Legend: B samples, P padded prompt columns, R padded response columns.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ...codec import decode_trace, encode_trace
from ...errors import Where
from ...replay import BatchLayoutError
from ...trace import RolloutTrace, stitch

TRACES_KEY = "moe_replay_traces"
"""Key of the per-sample encoded traces in `DataProto.non_tensor_batch` (and the TensorDict)."""


class MissingTraceError(BatchLayoutError):
    """A sample reached the actor without its trace: it would be routed freely, so it is refused."""


def encode_traces(traces: Sequence[RolloutTrace]) -> np.ndarray:
    """The object array verl's `non_tensor_batch` takes: one encoded record per sample."""
    out = np.empty(len(traces), dtype=object)
    for i, trace in enumerate(traces):
        out[i] = encode_trace(trace)
    return out


def stitch_turns(turns: Sequence[RolloutTrace]) -> RolloutTrace:
    """One record of a multi-turn rollout: each later turn recorded only its new routes
    (vLLM's `routed_experts_prompt_start`), and stitching keeps every turn's routes."""
    if not turns:
        raise ValueError("stitch_turns needs at least one turn, got 0")
    full = turns[0]
    for turn in turns[1:]:
        full = stitch(full, turn)
    return full


def traces_of(micro_batch: Any, sample_ids: Sequence[Any] | None = None, *, decode: bool = True,
              cache: dict[bytes, RolloutTrace] | None = None) -> list[Any]:
    """The decoded trace of every sample of a verl TensorDict (micro-)batch, in its row order.

    Refuses (MissingTraceError, naming the row and its uid when the batch has one) a batch without
    the key or a sample whose entry is empty: replaying some rows and routing others freely is
    the silent fall-back this integration exists to prevent. `decode=False` only checks presence
    and returns the entries as they are (the whole batch is checked before its first micro-batch,
    each micro-batch decodes its own). `cache` ({encoded record: decoded trace}) is read and
    filled: the π_old pass and the update pass carry the same records, so each is decoded once
    per batch (decoding 16 records cost ~25 ms of CPU a step on the tiny model, about 3% of it).
    """
    rows = len(micro_batch)
    uids = _uids(micro_batch, rows) if sample_ids is None else list(sample_ids)
    if TRACES_KEY not in micro_batch.keys():
        raise MissingTraceError(Where(field=f"non_tensor_batch[{TRACES_KEY!r}]"), f"one moe_replay trace per sample ({rows})",
                                "no such key", "generate with moe_replay capture and attach the traces (to_dataproto / "
                                "encode_traces) before compute_log_prob and update_actor")
    entries = micro_batch[TRACES_KEY]
    entries = entries.tolist() if hasattr(entries, "tolist") else list(entries)
    if len(entries) != rows:
        raise MissingTraceError(Where(field=TRACES_KEY), f"{rows} traces (one per sample)", len(entries))
    out = []
    for b, entry in enumerate(entries):
        where = Where(field=f"{TRACES_KEY}[row {b}{_uid_note(uids, b)}]")
        if entry is None or (isinstance(entry, (bytes, bytearray)) and not entry):
            raise MissingTraceError(where, "an encoded moe_replay trace", repr(entry),
                                    "every sample must come from the captured engine")
        if isinstance(entry, RolloutTrace) or not decode:
            out.append(entry)
            continue
        record = bytes(entry)
        trace = None if cache is None else cache.get(record)
        if trace is None:
            trace = decode_trace(record, where)
            if cache is not None:
                cache[record] = trace
        out.append(trace)
    return out


def _uids(batch: Any, rows: int) -> list[Any] | None:
    if "uid" not in batch.keys():
        return None
    uids = batch["uid"]
    uids = uids.tolist() if hasattr(uids, "tolist") else list(uids)
    return uids if len(uids) == rows else None


def _uid_note(uids: list[Any] | None, b: int) -> str:
    return f", uid {uids[b]!r}" if uids is not None else ""


def to_dataproto(traces: Sequence[RolloutTrace], *, pad_token_id: int, uids: Sequence[str] | None = None,
                 prompt_lens: Sequence[int] | None = None) -> Any:
    """A verl `DataProto` of rollouts as verl's agent loop emits them, with the traces attached.

    `prompt_lens` (default: each trace's prompt_len) is where verl's prompt ends. As verl's agent
    loop does, `response_mask` is 1 on the tokens the engine sampled (every span of a stitched
    multi-turn record) and 0 on the text between them (tool output), which the loss skips; 0 too on
    sampled tokens the trace names stale (`trace.Rerouted`: sampled before a route they depended on
    was changed by a later forward), the rule for them.
    `rollout_log_probs` (the engine's logprobs, for verl's own rollout correction) holds each
    sampled token's recorded logprob and 0 elsewhere, set only when every trace recorded them.
    """
    from verl import DataProto

    b_count = len(traces)
    p_lens = [t.prompt_len for t in traces] if prompt_lens is None else [int(p) for p in prompt_lens]
    r_lens = [t.num_tokens - p for t, p in zip(traces, p_lens)]
    if min(p_lens) < 1 or min(r_lens) < 1:
        raise ValueError(f"to_dataproto: every sample needs >= 1 prompt and >= 1 response token, got prompts {p_lens}, "
                         f"responses {r_lens}")
    p_cols, r_cols = max(p_lens), max(r_lens)
    prompts_BP = torch.full((b_count, p_cols), pad_token_id, dtype=torch.long)
    responses_BR = torch.full((b_count, r_cols), pad_token_id, dtype=torch.long)
    mask_BS = torch.zeros((b_count, p_cols + r_cols), dtype=torch.long)
    rollout_lp_BR = torch.zeros((b_count, r_cols), dtype=torch.float32)
    response_mask_BR = torch.zeros((b_count, r_cols), dtype=torch.long)
    with_lp = all(t.logprobs_G is not None for t in traces)
    for b, (t, p, r) in enumerate(zip(traces, p_lens, r_lens)):
        ids = torch.from_numpy(t.token_ids_S)
        prompts_BP[b, p_cols - p:] = ids[:p]
        responses_BR[b, :r] = ids[p:]
        mask_BS[b, p_cols - p: p_cols + r] = 1
        sampled_J = torch.from_numpy(t.generated_positions()) - p
        if len(sampled_J) and int(sampled_J[0]) < 0:
            raise ValueError(f"to_dataproto: trace {t.key!r} sampled position {int(sampled_J[0]) + p}, inside the "
                             f"prompt of {p} tokens given for it (prompt_lens)")
        response_mask_BR[b, sampled_J] = 1
        response_mask_BR[b, sampled_J[torch.from_numpy(t.stale_G)]] = 0  # stale tokens (trace.Rerouted): out of the loss
        if with_lp:
            rollout_lp_BR[b, sampled_J] = torch.from_numpy(t.logprobs_G)
    position_ids_BS = (mask_BS.cumsum(-1) - 1).clamp(min=0)
    tensors = {
        "prompts": prompts_BP, "responses": responses_BR, "input_ids": torch.cat([prompts_BP, responses_BR], 1),
        "attention_mask": mask_BS, "position_ids": position_ids_BS, "response_mask": response_mask_BR,
    }
    if with_lp:
        tensors["rollout_log_probs"] = rollout_lp_BR
    keys = [t.key for t in traces] if uids is None else list(uids)
    non_tensors = {TRACES_KEY: encode_traces(traces), "uid": np.array(keys, dtype=object)}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
