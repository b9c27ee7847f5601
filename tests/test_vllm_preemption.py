"""Recompute preemption and route provenance: a re-prefill that routes a token otherwise is named.

Unit part (the row log, capture/row_log.py): rows of one position from several forwards; where
they differ the position is named and the tokens sampled before the later forward from routes
it changed are stale. Engine part (benchmarks/_engine_modes.py `preemption`, also engine_coverage's
row): six requests on a KV cache of 12 blocks (the scheduler preempts and recomputes) under the
engine-noise instrument with call-size-dependent route flips, so a re-prefill can route a token
otherwise than its decode step did; HF fp32 replays each stored trace under its routes and kept
sets. Proves: preemption happened and changed routes; every token whose replayed logprob differs
from the engine's is one the trace names stale (no silent mismatch); the stale ones do differ
(the mask is needed); a trace made without preemption names nothing; and the trainer's plan, TRL's
completion mask and verl's response mask leave stale tokens out of the loss.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_replay.errors import TraceAlignmentError, TraceFormatError
from moe_replay.trace import Rerouted, stitch

from .trace_factory import random_trace

ROOT = Path(__file__).parents[1]


def _log():
    from moe_replay.integrations.vllm.capture.row_log import RowLog

    return RowLog(2, 2, np.uint8)


def _rows(v: int, n: int) -> np.ndarray:
    return np.full((n, 2, 2), v, np.uint8) + np.arange(2, dtype=np.uint8)[None, None, :]


def _samples(tokens):
    from moe_replay.integrations.vllm.capture.sampler_hook import StagedSamples

    R = len(tokens)
    return StagedSamples(np.array(tokens), np.arange(R + 1), np.array(tokens, np.int32), np.ones(R, np.int64),
                         np.zeros(R, np.float32))


def _decode(log, uid: int, first: int, n: int, step0: int, value: int = 1) -> None:
    """Positions first..first+n-1 decoded one a step from step0, each sampling the next token."""
    for j in range(n):
        p = first + j
        log.add_routes(np.array([uid]), np.array([p]), _rows(value + p, 1), None, np.array([step0 + j]))
        log.add_samples(np.array([uid]), np.array([p + 1 - 3]), _samples([p]), np.array([step0 + j]))


def test_a_rerouted_position_names_the_tokens_sampled_from_its_old_route():
    log = _log()  # prompt of 3 tokens (positions 0..2), prefill at step 0 samples g0
    log.add_routes(np.full(3, 7), np.arange(3), _rows(1, 3), None, np.zeros(3, np.int64))
    log.add_samples(np.array([7]), np.array([0]), _samples([5]), np.array([0]))
    _decode(log, 7, 3, 3, step0=1)  # positions 3, 4, 5 at steps 1..3 sample g1..g3
    # preempted; the re-prefill at step 9 forwards positions 0..5 again: position 4 routes otherwise
    again = np.concatenate([_rows(1, 3), _rows(1 + 3, 1), _rows(99, 1), _rows(1 + 5, 1)])
    log.add_routes(np.full(6, 7), np.arange(6), again, None, np.full(6, 9))
    log.add_samples(np.array([7]), np.array([4]), _samples([8]), np.array([9]))
    a = log.take(np.array([7]), np.array([0]), np.array([3]))[0]
    assert a.rerouted_P.tolist() == [4]
    # token at q depends on positions <= q - 1: g2 (q 5) and g3 (q 6) were sampled before step 9 from
    # position 4's old route; g0, g1 (q 3, 4) never saw it; g4 was sampled by the re-prefill itself
    assert a.stale_G.tolist() == [2, 3]
    assert a.routes_TLK[4].tolist() == _rows(99, 1)[0].tolist()  # the trace keeps the later route


def test_equal_recomputed_rows_name_nothing_and_a_later_change_back_counts_from_its_own_step():
    log = _log()
    log.add_routes(np.full(3, 1), np.arange(3), _rows(1, 3), None, np.zeros(3, np.int64))
    log.add_samples(np.array([1]), np.array([0]), _samples([5]), np.array([0]))
    _decode(log, 1, 3, 2, step0=1)
    log.add_routes(np.full(5, 1), np.arange(5), np.concatenate([_rows(1, 3), _rows(4, 1), _rows(5, 1)]), None,
                   np.full(5, 6))  # recomputed, the same routes
    a = log.take(np.array([1]), np.array([0]), np.array([3]))[0]
    assert a.rerouted_P.tolist() == [] and a.stale_G.tolist() == []
    log = _log()  # position 3: route A (step 1), B (step 5), A again (step 8): A holds since step 8
    log.add_routes(np.full(3, 2), np.arange(3), _rows(1, 3), None, np.zeros(3, np.int64))
    for step, v in ((1, 4), (5, 50), (8, 4)):
        log.add_routes(np.array([2]), np.array([3]), _rows(v, 1), None, np.array([step]))
    log.add_samples(np.array([2, 2, 2]), np.array([0, 1, 2]), _samples([5, 6, 7]), np.array([0, 6, 8]))
    a = log.take(np.array([2]), np.array([0]), np.array([3]))[0]
    assert a.rerouted_P.tolist() == [3] and a.stale_G.tolist() == [1]  # g1 (step 6) saw route B


def test_rerouted_is_validated_stored_and_stitched():
    t = random_trace("r", np.random.default_rng(0), num_tokens=10, prompt_len=4)
    t.rerouted = Rerouted((5,), (2, 3))
    t.validate()
    assert t.stale_G.tolist() == [False, False, True, True, False, False]
    from moe_replay.codec.record import decode_trace, encode_trace

    assert decode_trace(encode_trace(t)).equals(t)
    with pytest.raises(ValueError, match="ascending and distinct"):
        Rerouted((5, 3), ())
    t.rerouted = Rerouted((), (6,))
    with pytest.raises(TraceFormatError, match=r"rerouted.stale.*\[0, 6\)"):
        t.validate()


def test_a_later_turn_that_reroutes_an_earlier_turns_tokens_names_them():
    """stitch: the turn forwards positions 5 and 6 of the first turn again; position 5 routes otherwise,
    so the record keeps the turn's route there and the first turn's tokens after it are stale."""
    first = random_trace("t1", np.random.default_rng(1), num_tokens=8, prompt_len=4)
    turn = random_trace("t2", np.random.default_rng(2), num_tokens=11, prompt_len=8, route_start=5)
    turn.token_ids_S[:8] = first.token_ids_S
    turn.routes_TLK[0] = first.routes_TLK[5][:, ::-1]  # position 5: the same experts in another column order
    turn.routes_TLK[1] = first.routes_TLK[6]  # position 6: the same route
    joined = stitch(first, turn)
    assert joined.rerouted == Rerouted((5,), (2, 3))  # first-turn tokens at positions 6, 7 were sampled from 5
    assert np.array_equal(joined.routes_TLK[5], turn.routes_TLK[0])
    same = random_trace("t2", np.random.default_rng(2), num_tokens=11, prompt_len=8, route_start=5)
    same.token_ids_S[:8] = first.token_ids_S
    same.routes_TLK[:2] = first.routes_TLK[5:7]
    assert stitch(first, same).rerouted is None
    with pytest.raises(TraceAlignmentError):
        stitch(first, random_trace("x", np.random.default_rng(3), num_tokens=4, prompt_len=2))


def test_plan_and_trainers_leave_stale_tokens_out_of_the_loss():
    from moe_replay.replay import build_plan

    a = random_trace("a", np.random.default_rng(4), num_tokens=8, prompt_len=3)
    b = random_trace("b", np.random.default_rng(5), num_tokens=7, prompt_len=3)
    a.rerouted = Rerouted((4,), (2, 3, 4))
    plan = build_plan([a, b], a.geometry)
    assert plan.stale_G.tolist() == [False, False, True, True, True] + [False] * 4
    assert plan.loss_mask_G.tolist() == [not x for x in plan.stale_G.tolist()]
    assert plan.stale_fraction == pytest.approx(3 / 9)
    assert build_plan([b], b.geometry).stale_G is None
    pytest.importorskip("trl")
    from moe_replay.integrations.trl.trainer import _mask_stale

    mask = torch.ones(2, 6, dtype=torch.long)
    assert _mask_stale(mask, [a, b]) == 3
    assert mask.tolist() == [[1, 1, 0, 0, 0, 1], [1] * 6]
    pytest.importorskip("verl")
    from moe_replay.integrations.verl import to_dataproto, use_cpu

    use_cpu()  # verl keeps the first device it picks for the process

    resp = to_dataproto([a, b], pad_token_id=0).batch["response_mask"]  # verl's loss mask, response columns
    assert resp.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]


@pytest.mark.vllm
@pytest.mark.mrv2
def test_preempted_requests_replay_exactly_or_are_masked_by_name(tiny_model, tmp_path, runner):
    """On the session's runner (the MRV2 session's environment reaches the mode's child process)."""
    pytest.importorskip("vllm")
    spec = importlib.util.spec_from_file_location("engine_modes", ROOT / "benchmarks" / "_engine_modes.py")
    modes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(modes)
    model_dir = tiny_model("mixtral")
    row = modes.run("preemption", model_dir, tmp_path)
    assert row["runner_module"] == {"v1": "vllm.v1.worker.cpu_model_runner", "mrv2": "vllm.v1.worker.cpu.model_runner"}[runner]
    assert row["preempted_requests"] > 0, row
    assert row["preempt_route_changes"] > 0 and row["stale_tokens"] > 0, row  # the noise made a re-prefill reroute
    assert row["silent_mismatch"] == 0, row  # every token HF does not reproduce is named stale
    assert row["max_abs_logprob_not_stale"] <= 2e-5, row
    assert row["stale_tokens_off"] > 0, row  # and the stale ones are off: the mask is needed
    assert row["unpreempted_rerouted"] == 0, row


@pytest.mark.vllm
def test_native_routes_of_a_preempted_request_are_refused_by_name(tiny_model, monkeypatch):
    """Routes the engine returns itself (MRV2, or 0.26's V1 runner) cannot say where a re-prefill
    changed them: capture learns which requests were preempted (a PreemptionWatch on the workers
    when no hook is installed, the hooks' own records otherwise) and refuses exactly those by name.
    vLLM-CPU returns no native routes, so the engine is planned as if it did (the plan is what
    decides); the other requests then fail only for the routes the CPU engine never filled."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    from moe_replay.integrations.vllm import CaptureConfig, CollectError, VllmCapture
    from moe_replay.integrations.vllm.capture import native
    from moe_replay.integrations.vllm.capture.native import EngineFlags, NativeOutputError, PreemptedRoutesError

    from .conftest import shutdown_llm
    from .test_vllm_capture import make_engine, prompt_text

    monkeypatch.setattr(native.EngineFlags, "of", classmethod(lambda cls, _cfg: EngineFlags(routed_experts=True)))
    llm = make_engine(tiny_model("qwen3_moe"), num_gpu_blocks_override=12, max_num_seqs=6, max_model_len=256)
    try:
        prompts = [prompt_text(30 + 3 * i, seed=50 + i) for i in range(6)]
        sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, ignore_eos=True)
        for config, watched in ((CaptureConfig(support=False, logprobs=False), True), (CaptureConfig(), False)):
            cap = VllmCapture(llm, config)
            try:
                assert (cap._watch is not None) == watched and cap.plan.native == {"routes"}
                outs = llm.generate(prompts, sp, use_tqdm=False)
                with pytest.raises(CollectError) as e:
                    cap.collect(outs)
                failures = e.value.failures
                preempted = [k for k, err in failures.items() if isinstance(err, PreemptedRoutesError)]
                assert preempted, "the 12-block KV cache should have preempted a request"
                assert all("preempted and recomputed" in str(failures[k]) and "capture_engine_kwargs()" in str(failures[k])
                           for k in preempted)
                others = [err for k, err in failures.items() if k not in preempted]
                assert all(isinstance(err, NativeOutputError) and "routed_experts" in str(err) for err in others)
                assert len(failures) == len(prompts)
            finally:
                cap.uninstall()
    finally:
        shutdown_llm(llm)
