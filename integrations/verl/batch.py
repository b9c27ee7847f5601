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

A shared prefix's routes, once per batch (`trace_columns`, `share_chunks`). The n samples of a GRPO
prompt hold the same prompt routes; whole records would carry them n times into every message. So
the rows records share become route chunks (store/chunks.py, as the stores cut them: keyed by
identity, tokens and a digest of the routes, so routes that differ are never merged), each record
names its chunks (schema v4), and a second column, `CHUNKS_KEY`, holds per sample the tuple of the
chunk payloads its record names: the same Python bytes object in every sample that shares it. Why
a column of shared objects and not a table in `meta_info`: verl's agent-loop manager keeps only
its first worker's meta_info (`AgentLoopManager.generate_sequences`: `{"timing": ...,
**outputs[0].meta_info}`), `DataProto.concat` asserts equal values per key, and every dispatch
(`DataProto.chunk`, `chunk_tensordict`) copies meta_info to each DP rank whole, so each rank would
receive every prompt's chunks, more bytes than whole records once ranks outnumber n. A column
follows its samples through every batch operation (chunk, split, concat, union, reorder,
select_idxs, repeat, to_tensordict, micro-batching) as references, and pickle (Ray's serializer)
writes an object once per message however many rows refer to it, so each rank receives each
chunk its samples name once, and no chunk no sample of it names (tests/test_verl_batch.py,
through verl's own DataProto and dispatch chunking). The actor decodes each record from its own
row's chunks (`traces_of`); a record naming a chunk its row lacks is refused by name (record,
chunk, row, uid) before any forward. `AgentLoopWorker._postprocess` (registry.py) shares each
rollout worker's batch; `to_dataproto` shares its own.

`to_dataproto` lays the traces out the way verl's agent loop hands rollouts to the trainer
(left-padded prompts, right-padded responses, `rollout_log_probs`), for drivers that generate
with moe_replay's capture.

Legend: B samples, P padded prompt columns, R padded response columns.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ...codec import decode_trace, encode_trace, peek_key, record_chunks
from ...codec.chunk import ChunkShape, peek_chunk_key
from ...errors import TraceFormatError, Where
from ...replay import BatchLayoutError
from ...store.chunks import WIRE_CHUNK_MIN_BYTES, ChunkMissingError, ChunkTable, encode_shared, label, read_held
from ...trace import RolloutTrace, stitch

TRACES_KEY = "moe_replay_traces"
"""Key of the per-sample encoded traces in `DataProto.non_tensor_batch` (and the TensorDict)."""
CHUNKS_KEY = "moe_replay_route_chunks"
"""Key of the per-sample route chunks: a tuple of the chunk payloads the sample's record names (one
shared bytes object per chunk across the batch); () for a record holding all its rows."""
CHUNK_MIN_BYTES = WIRE_CHUNK_MIN_BYTES
"""Shared rows become a chunk from this many bytes of routes (at the order-preserving bound)."""


class MissingTraceError(BatchLayoutError):
    """A sample reached the actor without its trace: it would be routed freely, so it is refused."""


def encode_traces(traces: Sequence[RolloutTrace]) -> np.ndarray:
    """The object array verl's `non_tensor_batch` takes: one whole encoded record per sample (every
    route in it; `trace_columns` sends a shared prefix's routes once)."""
    out = np.empty(len(traces), dtype=object)
    for i, trace in enumerate(traces):
        out[i] = encode_trace(trace)
    return out


def trace_columns(traces: Sequence[RolloutTrace | None], *, min_bytes: int = CHUNK_MIN_BYTES) -> dict[str, np.ndarray]:
    """The two `non_tensor_batch` columns of a batch's traces: {TRACES_KEY: one record per sample,
    naming the route chunks it shares with others of the batch; CHUNKS_KEY: per sample, the tuple of
    those chunks' payloads, one bytes object per chunk however many samples name it}. A None
    (a sample without its trace) stays None, with (), and is refused at the actor by row."""
    table, payloads = ChunkTable(), {}
    records, chunks = np.empty(len(traces), dtype=object), np.empty(len(traces), dtype=object)
    for b, trace in enumerate(traces):
        if trace is None:
            records[b], chunks[b] = None, ()
            continue
        records[b], split = encode_shared(trace, table, min_bytes)
        payloads.update(split.new)
        chunks[b] = tuple(payloads[p.key] for p in split.pieces)
    return {TRACES_KEY: records, CHUNKS_KEY: chunks}


def share_chunks(batch: Any, *, min_bytes: int = CHUNK_MIN_BYTES) -> Any:
    """Re-encode a DataProto's traces so the rows its samples share travel once (`trace_columns`),
    in place; returns the batch. A batch without `TRACES_KEY` is returned as it is; records that
    name chunks already are read from their rows' chunks first (sharing twice changes nothing)."""
    cols = batch.non_tensor_batch
    if TRACES_KEY not in cols:
        return batch
    entries = list(cols[TRACES_KEY])
    held = _RowChunks.of(cols.get(CHUNKS_KEY), len(entries), None)
    traces = []
    for b, entry in enumerate(entries):
        if _absent(entry) or isinstance(entry, RolloutTrace):
            traces.append(None if _absent(entry) else entry)
            continue
        traces.append(decode_trace(bytes(entry), Where(field=f"{TRACES_KEY}[row {b}]"), chunks=held.row(b)))
    cols.update(trace_columns(traces, min_bytes=min_bytes))
    return batch


class _RowChunks:
    """The chunks each row of a batch carries (`CHUNKS_KEY`), as the ChunkSource of that row's record:
    a record reads only its own row's chunks (wherever verl moved the row, they moved with it), and
    each chunk is decoded once per call however many rows name it (the arrays are read-only: records
    copy out of them)."""

    def __init__(self, rows: list[dict[str, Any]], notes: list[str]) -> None:
        self._rows, self._notes = rows, notes
        self._decoded: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    @classmethod
    def of(cls, column: Any, rows: int, uids: list[Any] | None) -> "_RowChunks":
        notes = [f"not in non_tensor_batch[{CHUNKS_KEY!r}] of its row (row {b}{_uid_note(uids, b)})" for b in range(rows)]
        if column is None:
            return cls([{} for _ in range(rows)], notes)
        entries = column.tolist() if hasattr(column, "tolist") else list(column)
        if len(entries) != rows:
            raise MissingTraceError(Where(field=CHUNKS_KEY), f"{rows} tuples of route chunks (one per sample)", len(entries))
        keys: dict[int, str] = {}  # id(payload) -> its key: a shared payload is read once
        held = []
        for b, entry in enumerate(entries):
            where = Where(field=f"{CHUNKS_KEY}[row {b}{_uid_note(uids, b)}]")
            if not isinstance(entry, (tuple, list)):
                raise TraceFormatError(where, "a tuple of route chunk payloads", type(entry).__name__)
            row = {}
            for payload in entry:
                if not isinstance(payload, (bytes, bytearray)):
                    raise TraceFormatError(where, "route chunk payload bytes", type(payload).__name__)
                key = keys.get(id(payload))
                if key is None:
                    key = keys[id(payload)] = peek_chunk_key(payload, where)
                row[key] = payload
            held.append(row)
        return cls(held, notes)

    def row(self, b: int) -> "_Row":
        return _Row(self, b)

    def check(self, b: int, record: bytes, where: Where) -> None:
        """Refuse, before anything runs, a record naming a chunk its row does not carry."""
        for _, _, key in record_chunks(record, where):
            if key not in self._rows[b]:
                raise ChunkMissingError(where.with_(record=peek_key(record, where), field=label(key)),
                                        "the route chunk the record names", self._notes[b])

    def read(self, b: int, key: str, want: ChunkShape, first: int, stop: int, record_where: Where):
        held = self._rows[b]
        memo = (key, want, first, stop)
        got = self._decoded.get(memo) if key in held else None
        if got is None:
            got = read_held(held, key, want, first, stop, record_where, self._notes[b])
            for array in got:
                array.flags.writeable = False
            self._decoded[memo] = got
        return got


class _Row:
    """One row's view of _RowChunks (codec.record's ChunkSource)."""

    def __init__(self, chunks: _RowChunks, b: int) -> None:
        self._chunks, self._b = chunks, b

    def read_chunk(self, key: str, want: ChunkShape, first: int, stop: int, record_where: Where):
        return self._chunks.read(self._b, key, want, first, stop, record_where)


def _absent(entry: Any) -> bool:
    return entry is None or (isinstance(entry, (bytes, bytearray)) and not entry)


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
    the silent fall-back this integration exists to prevent. A record naming route chunks reads
    them from its own row's `CHUNKS_KEY` entry; one its row does not carry is refused by name
    (ChunkMissingError: record, chunk, row and uid). `decode=False` only checks presence (of the
    traces and of the chunks they name) and returns the entries as they are (the whole batch is
    checked before its first micro-batch, each micro-batch decodes its own). `cache` ({encoded
    record: decoded trace}) is read and filled: the π_old pass and the update pass carry the same
    records, so each is decoded once per batch (decoding 16 records cost ~25 ms of CPU a step on
    the tiny model, about 3% of it); a record pins its chunks by digest, so equal records are
    equal traces.
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
    held = _RowChunks.of(micro_batch[CHUNKS_KEY] if CHUNKS_KEY in micro_batch.keys() else None, rows, uids)
    out = []
    for b, entry in enumerate(entries):
        where = Where(field=f"{TRACES_KEY}[row {b}{_uid_note(uids, b)}]")
        if _absent(entry):
            raise MissingTraceError(where, "an encoded moe_replay trace", repr(entry),
                                    "every sample must come from the captured engine")
        if isinstance(entry, RolloutTrace):
            out.append(entry)
            continue
        if not decode:
            held.check(b, bytes(entry), where)
            out.append(entry)
            continue
        record = bytes(entry)
        trace = None if cache is None else cache.get(record)
        if trace is None:
            trace = decode_trace(record, where, chunks=held.row(b))
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
    non_tensors = {**trace_columns(traces), "uid": np.array(keys, dtype=object)}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
