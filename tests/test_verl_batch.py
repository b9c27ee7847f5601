"""A shared prefix's routes cross verl's batch once: records naming route chunks, the chunks in a
column of shared objects (integrations/verl/batch.py), on verl 0.9.1's real DataProto and the
operations its PPO/GRPO path applies between the rollout and the actor (the agent-loop manager's
concat, the trainer's slice, union and balance reorder, to_tensordict and left_right_2_no_padding,
the dispatch's chunking to DP ranks, pickling as Ray sends it, the engine's dynamic micro-batches).
No engine: traces are random and valid (tests/trace_factory.py), on a geometry where the default
threshold (4 KiB of routes, 171 rows here) makes a 200-token prompt a chunk.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from moe_replay.integrations.verl import use_cpu

use_cpu()  # before anything of verl picks its device: verl keeps the first one for the process (the verl tests after this run on it)
# Installed by the project's `verl` extra; a missing verl is a failure, as in test_verl_parity.py.
from verl import DataProto  # noqa: E402

from moe_replay.codec import record_chunks
from moe_replay.geometry import ModelGeometry
from moe_replay.integrations.verl import CHUNKS_KEY, TRACES_KEY, encode_traces, share_chunks, to_dataproto, traces_of
from moe_replay.store import ChunkMissingError
from moe_replay.store.chunks import label
from tests.trace_factory import random_routes, random_trace

GEOMETRY = ModelGeometry(num_layers=8, moe_layer_ids=tuple(range(8)), num_experts=64, top_k=4, vocab_size=1000, family="tiny")
"""8 MoE layers, top-4 of 64: ~24 B of routes a row at the bound, so 4 KiB is 171 rows."""
PROMPT = 200


def group(q: int, n: int, seed: int = 0, gen: int | None = None) -> list:
    """n samples of prompt q: one prefill (the prompt's tokens and routes alike), then each its own
    completion (`gen` tokens, or 8..39)."""
    rng = np.random.default_rng([seed, q])
    head = random_trace("head", rng, geometry=GEOMETRY, num_tokens=PROMPT + 1, prompt_len=PROMPT, with_support=False,
                        with_logprobs=False)
    out = []
    for i in range(n):
        t = random_trace(f"q{q}#{i}", rng, geometry=GEOMETRY, num_tokens=PROMPT + (gen or int(rng.integers(8, 40))),
                         prompt_len=PROMPT)
        t.token_ids_S[:PROMPT] = head.token_ids_S[:PROMPT]
        t.routes_TLK[:PROMPT] = head.routes_TLK[:PROMPT]  # rows 0..PROMPT-1: the prompt's forward
        out.append(t.validate())
    return out


def dataproto(traces):
    return to_dataproto(traces, pad_token_id=0)


def decoded(td) -> list:
    return traces_of(td)


def same(got, want) -> bool:
    return len(got) == len(want) and all(a.equals(b) for a, b in zip(got, want))


def payloads(col) -> dict[int, bytes]:
    return {id(p): p for row in col for p in row}


def test_a_prompts_n_samples_carry_its_routes_once_and_decode_bit_identical():
    traces = group(0, 8)
    batch = dataproto(traces)
    recs, chunks = batch.non_tensor_batch[TRACES_KEY], batch.non_tensor_batch[CHUNKS_KEY]
    (prompt_chunk,) = payloads(chunks).values()  # one object: the prompt's chunk (completions stay inline, < 171 rows)
    assert all(row == (prompt_chunk,) and row[0] is prompt_chunk for row in chunks)
    assert all(record_chunks(r) == [(0, PROMPT, record_chunks(recs[0])[0][2])] for r in recs)
    assert same(decoded(batch.to_tensordict()), traces)

    # what Ray ships: the prompt's routes once, against n times with whole records
    shared = len(pickle.dumps({k: batch.non_tensor_batch[k] for k in (TRACES_KEY, CHUNKS_KEY)}, protocol=5))
    whole = len(pickle.dumps({TRACES_KEY: encode_traces(traces)}, protocol=5))
    assert shared < sum(map(len, recs)) + len(prompt_chunk) + 1024
    assert whole - shared > 6 * len(prompt_chunk), (whole, shared)  # n - 1 = 7 copies saved, less the chunk's own meta

    # a sample whose prompt routes differ (no prefix cache) gets a chunk of its own, never merged
    other = group(0, 8)
    other[3].routes_TLK[5] = random_routes(np.random.default_rng(9), 1, GEOMETRY)[0]
    batch = dataproto(other)
    assert len(payloads(batch.non_tensor_batch[CHUNKS_KEY])) == 2
    assert same(decoded(batch.to_tensordict()), other)


def test_chunks_survive_verls_batch_operations_and_each_rank_gets_only_its_own():
    from verl.protocol import BatchData
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches
    from verl.workers.utils.padding import left_right_2_no_padding

    g0, g1 = group(0, 4, gen=30), group(1, 4, gen=30)  # concat: verl pads every worker's batch to one width
    traces = g0 + g1
    by_key = {t.key: t for t in traces}
    # verl's agent-loop manager: one DataProto per rollout worker, concatenated
    batch = DataProto.concat([dataproto(g0), dataproto(g1)])
    c0, c1 = batch.non_tensor_batch[CHUNKS_KEY][0][0], batch.non_tensor_batch[CHUNKS_KEY][4][0]
    assert c0 is not c1 and same(decoded(batch.to_tensordict()), traces)
    for part, want in zip(batch.chunk(2), (g0, g1)):
        assert same(decoded(part.to_tensordict()), want)
    for part, want in zip(batch.split(3), (traces[:3], traces[3:6], traces[6:])):
        assert same(decoded(part.to_tensordict()), want)

    for order in ([5, 0, 7, 2, 4, 1, 6, 3], [2, 0, 3, 1, 6, 4, 7, 5]):  # each rank gets both prompts / one
        b = batch.slice(0, len(batch))  # the trainer's gen_batch_output
        b = b.union(DataProto.from_dict(tensors={"rm_scores": torch.zeros(len(traces), 3)}))
        b.reorder(torch.tensor(order))  # _balance_batch, in place
        assert same(decoded(b.to_tensordict()), [traces[i] for i in order])
        # the actor path: verl's conversions, then its dispatch to 2 DP ranks, pickled as Ray sends each
        td = left_right_2_no_padding(b.to_tensordict())
        for rank, part in enumerate(BatchData(td).chunk(2)):
            blob = pickle.dumps(part, protocol=5)
            mine = [traces[i] for i in order[rank * 4:(rank + 1) * 4]]
            for chunk, g in ((c0, g0), (c1, g1)):
                needed = bool({t.key for t in mine} & {t.key for t in g})
                assert blob.count(chunk) == int(needed), (order, rank)  # once if a sample needs it, else never
            part = pickle.loads(blob)
            assert same(decoded(part), mine)
            # the engine's dynamic micro-batches re-order rows again; each still reads its own chunks
            tu.assign_non_tensor(part, use_dynamic_bsz=True, max_token_len_per_gpu=2 * (PROMPT + 30))
            micro, _ = prepare_micro_batches(part)
            assert len(micro) > 1
            for mb in micro:
                assert same(decoded(mb), [by_key[k] for k in mb["uid"]])


def test_a_record_whose_chunk_is_missing_is_refused_by_name():
    traces = group(0, 4)
    batch = dataproto(traces)
    key = record_chunks(batch.non_tensor_batch[TRACES_KEY][2])[0][2]
    batch.non_tensor_batch[CHUNKS_KEY][2] = ()
    td = batch.to_tensordict()
    for decode in (False, True):  # refused before any forward (the presence check) and at decode
        with pytest.raises(ChunkMissingError, match=rf"'q0#2'.*{label(key)}.*row 2, uid 'q0#2'"):
            traces_of(td, decode=decode)
    del batch.non_tensor_batch[CHUNKS_KEY]  # records naming chunks, the column gone
    with pytest.raises(ChunkMissingError, match=rf"'q0#0'.*{label(key)}"):
        traces_of(batch.to_tensordict())


def test_verls_agent_loop_postprocess_output_is_shared_in_place():
    """What registry.install() wraps around `AgentLoopWorker._postprocess`: verl packs one whole
    record per sample from the extra fields; share_chunks leaves one copy of the prompt's routes."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopWorker, _InternalAgentLoopOutput

    traces = group(0, 4)
    p_cols, r_cols = PROMPT, 40

    def internal(t):
        r = t.num_tokens - PROMPT
        resp = torch.zeros(1, r_cols, dtype=torch.long)
        resp[0, :r] = torch.from_numpy(t.token_ids_S[PROMPT:])
        mask = torch.zeros(1, p_cols + r_cols, dtype=torch.long)
        mask[0, : p_cols + r] = 1
        prompt = torch.from_numpy(t.token_ids_S[:PROMPT])[None]
        return _InternalAgentLoopOutput(
            prompt_ids=prompt, response_ids=resp, input_ids=torch.cat([prompt, resp], 1), position_ids=mask.cumsum(-1) - 1,
            response_mask=(torch.arange(r_cols) < r).long()[None], attention_mask=mask, num_turns=2, metrics=AgentLoopMetrics(),
            extra_fields={TRACES_KEY: encode_traces([t])[0]})

    from moe_replay.integrations.verl import registry

    worker = object.__new__(AgentLoopWorker)
    worker.reward_loop_worker_handles = None
    verls_own = registry._rollout_saved.get("postprocess", AgentLoopWorker._postprocess)  # an earlier test may leave it wrapped
    batch = verls_own(worker, [internal(t) for t in traces])
    assert CHUNKS_KEY not in batch.non_tensor_batch and not record_chunks(batch.non_tensor_batch[TRACES_KEY][0])
    assert share_chunks(batch) is batch
    assert len(payloads(batch.non_tensor_batch[CHUNKS_KEY])) == 1 and same(decoded(batch.to_tensordict()), traces)
    before = list(batch.non_tensor_batch[TRACES_KEY])
    share_chunks(batch)  # sharing twice changes nothing
    assert list(batch.non_tensor_batch[TRACES_KEY]) == before
