"""Pure logic of the batched capture path: record assembly from the row log and the support stage.

The real-engine behaviour is proven in test_vllm_capture.py; these pin the array bookkeeping
(newest write wins, gaps are reported, CSR rows are gathered exactly) on hand-made inputs, and the
row log's vectorised layout against the per-token reference (tests/capture_reference.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moe_replay.integrations.vllm.capture.row_log import RowLog, last_occurrence
from moe_replay.integrations.vllm.capture.sampler_hook import StagedSamples, SupportStage
from moe_replay.integrations.vllm.runners.v1 import _temperatures
from moe_replay.integrations.vllm.errors import CaptureHookError

from tests.capture_reference import RowLogSpy, assert_record_equals, reference_record


def test_last_occurrence_keeps_the_newest_write():
    keys = np.array([5, 3, 5, 7, 3, 5])
    assert last_occurrence(keys).tolist() == [3, 4, 5]
    assert last_occurrence(np.array([2])).tolist() == [0]
    assert last_occurrence(np.zeros(0, dtype=np.int64)).tolist() == []


def _log() -> RowLog:
    return RowLog(L=2, K=2, route_dtype=np.uint8)


def _take_one(log: RowLog, uid: int = 7, route_start: int = 0):
    return log.take(np.array([uid]), np.array([route_start]))[0]


def test_routes_from_blocks_newest_wins_and_prefix_reads_count():
    log = _log()
    rows = lambda v, n: np.full((n, 2, 2), v, dtype=np.uint8)  # noqa: E731
    uid = lambda n: np.full(n, 7)  # noqa: E731
    log.add_routes(uid(2), np.arange(2), rows(1, 2), np.array([True, False]))  # prefix read: position 1 invalid
    log.add_routes(uid(3), np.array([2, 3, 3]), rows(2, 3) + np.arange(3, dtype=np.uint8)[:, None, None])
    log.add_routes(uid(1), np.array([1]), rows(9, 1))  # recomputed later (preemption): newest wins
    p = _take_one(log)
    assert p.routes_filled_T.tolist() == [True, True, True, True]
    assert p.routes_TLK[:, 0, 0].tolist() == [1, 9, 2, 4]  # position 3 written twice in one block: last kept
    assert log.rows == 0  # taken rows leave the log


def _staged(tokens, sizes, rows_ids, lps) -> StagedSamples:
    counts = np.array([len(r) for r in rows_ids])
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    ids = np.concatenate(rows_ids).astype(np.int32) if rows_ids else np.zeros(0, np.int32)
    return StagedSamples(np.asarray(tokens, np.int64), offsets, ids, np.asarray(sizes, np.int64),
                         np.asarray(lps, np.float32))


def test_samples_gathered_across_flushes_in_g_order():
    log = _log()
    a = _staged([10, 11, 12], [2, 1, 3], [[10, 40], [11], [5, 12, 30]], [-0.5, 0.0, -1.0])
    b = _staged([20, 21], [1, 2], [[20], [1, 21]], [-0.1, -0.2])
    log.add_samples(np.array([7, -1, 7]), np.array([0, 5, 1]), a)  # row 1: a row nobody keeps
    log.add_samples(np.array([7, 7]), np.array([2, 1]), b)  # g=1 drawn again: newest wins
    p = _take_one(log)
    assert p.tokens_G.tolist() == [10, 21, 20]
    assert p.sizes_G.tolist() == [2, 2, 1]
    off, ids = p.offsets_G1, p.ids_N
    assert [ids[off[g]:off[g + 1]].tolist() for g in range(3)] == [[10, 40], [1, 21], [20]]
    assert np.allclose(p.logprobs_G, [-0.5, -0.2, -0.1])
    assert p.problems == []


def test_a_missing_sample_is_reported_not_skipped():
    log = _log()
    s = _staged([1, 2], [1, 1], [[1], [2]], [0.0, 0.0])
    log.add_samples(np.array([7, 7]), np.array([0, 2]), s)
    p = _take_one(log)
    assert p.tokens_G.tolist() == [1]
    assert "generated token 1 never arrived (2 of 3)" in p.problems[0]


def _random_history(rng, uids, flushes: int, idle: bool = True):
    """Flush blocks as a busy engine hands them over: records interleaved, positions recomputed
    (preemption), prefix reads with invalid rows, rows of no record (-1; none if not `idle`, so a
    take can hold every row of a block), a missing sample, a sample outside its set, rows before a
    record's route_start."""
    L, K = 3, 2
    pos_next = {u: 0 for u in uids}
    g_next = {u: 0 for u in uids}
    out = []
    for f in range(flushes):
        if f == 1:
            u = uids[0]
            n = int(rng.integers(1, 6))
            out.append(("routes", np.full(n, u), np.arange(n), rng.integers(0, 8, (n, L, K)).astype(np.uint8),
                        rng.random(n) < 0.7))
        uid_T, pos_T, uid_X, g_X = [], [], [], []
        for u in rng.permutation(uids + [-1] * idle):
            u = int(u)
            if u < 0:
                uid_T += [-1] * 3
                pos_T += [0, 1, 2]
                uid_X += [-1]
                g_X += [0]
                continue
            n = max(int(rng.integers(0, 4)), int(u == uids[1] and f == 2))
            back = int(rng.integers(0, 3)) if rng.random() < 0.3 else 0  # recomputed positions
            start = max(pos_next[u] - back, 0)
            uid_T += [u] * n
            pos_T += list(range(start, start + n))
            pos_next[u] = max(pos_next[u], start + n)
            if n:
                gb = 1 if rng.random() < 0.2 and g_next[u] else 0  # drawn again (preemption)
                g = g_next[u] - gb
                if u == uids[1] and f == 2:
                    g = g_next[u] + 1  # a sample that never arrives: its record is cut there
                uid_X.append(u)
                g_X.append(g)
                g_next[u] = max(g_next[u], g + 1)
        T, X = len(uid_T), len(uid_X)
        out.append(("routes", np.array(uid_T, dtype=np.int64), np.array(pos_T, dtype=np.int64),
                    rng.integers(0, 8, (T, L, K)).astype(np.uint8), None))
        sizes = rng.integers(1, 6, X)
        ids = [np.sort(rng.choice(50, int(k), replace=False)) for k in sizes]
        staged = _staged([int(r[0]) for r in ids], sizes, ids, rng.normal(size=X))
        if f == flushes - 1:  # the last draws fell outside their sets
            staged.outside_R = (np.array(uid_X) >= 0) & (np.array(uid_X) != uids[1])
        out.append(("samples", np.array(uid_X, dtype=np.int64), np.array(g_X, dtype=np.int64), staged))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("idle", [True, False])
def test_row_log_layout_equals_the_per_token_reference(seed, idle):
    """The vectorised layout (all taken records at once, newest wins by sort) against the per-token
    reference over random flush histories; records taken in two takes with more flushes between,
    one discarded: every array bit for bit, the same problems, and no rows left behind. Without
    idle rows, blocks whose every row is taken are handed over whole (row_log._pick)."""
    rng = np.random.default_rng(seed)
    uids = [3, 11, 12, 40, 41, 57]
    later = [12, 40, 41] if idle else [112, 140, 141]  # without idle rows the first take holds every record
    starts = {u: int(rng.integers(0, 3)) if u % 2 else 0 for u in uids + later[idle * 3:]}
    log = RowLog(L=3, K=2, route_dtype=np.uint8)
    spy = RowLogSpy(log)

    def replay(history):
        for kind, *cols in history:
            (log.add_routes if kind == "routes" else log.add_samples)(*cols)

    replay(_random_history(rng, uids, 5, idle))
    first = [11, 3, 57] if idle else uids
    want = {u: reference_record(spy.history, u, starts[u], 3, 2, np.uint8) for u in uids}
    got = log.take(np.array(first), np.array([starts[u] for u in first]))
    for u, rec in zip(first, got):
        assert_record_equals(rec.__dict__ | {"support_sizes_G": rec.sizes_G, "support_offsets_G1": rec.offsets_G1,
                                             "support_ids_N": rec.ids_N}, want[u], f"record {u}")
        assert rec.problems == want[u]["problems"]
    assert any("never arrived" in p for u in uids for p in want[u]["problems"])  # the cases ran
    assert any("outside its recorded" in p for u in uids for p in want[u]["problems"])
    replay(_random_history(rng, later, 4, idle))  # more flushes of the records not yet taken
    log.drop([later[2]])
    rest = [later[1], later[0]]
    got = log.take(np.array(rest), np.array([starts[u] for u in rest]))
    for u, rec in zip(rest, got):
        want_u = reference_record(spy.history, u, starts[u], 3, 2, np.uint8)
        assert_record_equals(rec.__dict__ | {"support_sizes_G": rec.sizes_G, "support_offsets_G1": rec.offsets_G1,
                                             "support_ids_N": rec.ids_N}, want_u, f"record {u}")
    assert log.rows == 0 and not log.route_blocks and not log.sample_blocks


def test_row_log_compacts_blocks_half_dead():
    """Rows of taken records are dead; a block half dead is compacted, so a long-lived record does
    not hold every other record's rows."""
    log = _log()
    uid_A = np.repeat(np.arange(10), 4)
    log.add_routes(uid_A, np.tile(np.arange(4), 10), np.zeros((40, 2, 2), np.uint8))
    log.take(np.arange(4), np.zeros(4, np.int64))
    assert log.rows == 40  # 16 of 40 dead: kept as it is
    log.take(np.array([4, 5]), np.zeros(2, np.int64))
    assert log.rows == 16  # 24 of 40 dead: compacted to the live rows
    assert _take_one(log, uid=9).routes_TLK.shape == (4, 2, 2)


def _meta(temperature=None, all_random=True):
    return SimpleNamespace(temperature=temperature, all_random=all_random)


def commit(stage, sampled_B1, meta):
    """What the V1 runner's sampler wrapper commits after a step (runners/v1.py)."""
    return stage.commit_rows(sampled_B1, _temperatures(stage, meta))


def test_support_stage_batches_steps_and_handles_greedy_and_overflow():
    stage = SupportStage(max_support=3, want_support=True, want_logprobs=True, budget_bytes=0, min_rows=4)
    neg = float("-inf")
    step1 = torch.tensor([[0.0, 1.0, neg, neg, 2.0], [neg, 0.5, neg, neg, neg]])
    step2 = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [3.0, neg, 1.0, neg, neg]])

    def sample(logits, tokens, meta):
        stage.truncate_and_observe(lambda x, g, k, p: (torch.tensor(tokens), None), logits, {}, None, None)
        return commit(stage, torch.tensor(tokens).view(-1, 1), meta)

    assert sample(step1, [4, 1], _meta()) == 0
    assert sample(step2, [2, 0], _meta(torch.tensor([1.0, 0.0]), all_random=False)) == 2  # row 3 greedy
    assert commit(stage, torch.tensor([[7]]), _meta()) == 4 and stage.rows == 5  # an all-greedy step
    out = stage.compute()
    assert stage.rows == 0
    assert out.tokens_R.tolist() == [4, 1, 2, 0, 7]
    assert out.sizes_R.tolist() == [3, 1, 5, 1, 1]  # row 2 keeps 5 > max_support: size kept, ids not
    rows = [out.ids_N[out.offsets_R1[r]:out.offsets_R1[r + 1]].tolist() for r in range(5)]
    assert rows == [[0, 1, 4], [1], [], [0], [7]]
    want0 = float(step1[0, 4] - torch.logsumexp(step1[0], 0))
    assert np.allclose(out.logprobs_R, [want0, 0.0, float(-np.log(5)), 0.0, 0.0], atol=1e-6)


def test_greedy_rows_before_the_first_truncation_survive_allocation():
    stage = SupportStage(max_support=8, want_support=True, want_logprobs=True, budget_bytes=1 << 16, min_rows=2)
    assert commit(stage, torch.tensor([[3], [5]]), _meta()) == 0  # all greedy: nothing staged yet
    logits = torch.tensor([[0.0, 1.0, float("-inf")]])
    stage.truncate_and_observe(lambda x, g, k, p: (torch.tensor([1]), None), logits, {}, None, None)
    assert commit(stage, torch.tensor([[1]]), _meta()) == 2
    out = stage.compute()
    assert out.tokens_R.tolist() == [3, 5, 1] and out.sizes_R.tolist() == [1, 1, 2]
    assert [out.ids_N[out.offsets_R1[r]:out.offsets_R1[r + 1]].tolist() for r in range(3)] == [[3], [5], [0, 1]]


def test_window_lays_steps_end_to_end():
    """A prefill step (rows of 3 and 2 tokens, the second a chunk short of its prompt end) then a
    decode step: each token gets its row's record, each row its last position and discard flag."""
    from moe_replay.integrations.vllm.step import StepLayout
    from moe_replay.integrations.vllm.capture.worker import _Batch, _Step, _Window

    batch = _Batch(["a", "b"], [None, None], np.array([7, 9]), np.array([3, 4]))
    prefill = _Step(batch, StepLayout(["a", "b"], np.array([0, 3, 5]), np.array([0, 1, 2, 0, 1]), np.array([False, True])),
                    0, None, None)
    decode = _Step(batch, StepLayout(["a", "b"], np.array([0, 1, 2]), np.array([3, 2]), np.array([False, False])), 5, None, None)
    win = _Window.of([prefill, decode])
    assert win.n_S.tolist() == [5, 2] and win.b_S.tolist() == [2, 2]
    assert win.uid_T.tolist() == [7, 7, 7, 9, 9, 7, 9]
    assert win.pos_T.tolist() == [0, 1, 2, 0, 1, 3, 2]
    assert win.step_T.tolist() == [0, 0, 0, 0, 0, 1, 1] and win.step_B.tolist() == [0, 0, 1, 1]
    assert win.last_pos_B.tolist() == [2, 1, 3, 2]
    assert (win.last_pos_B + 1 - win.prompt_B).tolist() == [0, -2, 1, -1]  # generated index of each sample
    assert win.discard_B.tolist() == [False, True, False, False]


def test_a_sample_outside_its_recorded_support_is_counted_and_fails_the_trace():
    """A sampler that draws from another set than the one recorded (as a kernel that truncates on
    its own could): the row is flagged at compute() and the record carries a problem naming it."""
    stage = SupportStage(max_support=8, want_support=True, want_logprobs=True, budget_bytes=0, min_rows=2)
    neg = float("-inf")
    logits = torch.tensor([[0.0, 1.0, neg], [2.0, neg, 0.5]])
    stage.truncate_and_observe(lambda x, g, k, p: (torch.tensor([1, 1]), None), logits, {}, None, None)
    commit(stage, torch.tensor([[1], [1]]), _meta())  # row 1 drew token 1, whose logit is -inf
    out = stage.compute()
    assert out.outside_R.tolist() == [False, True]
    log = _log()
    log.add_samples(np.array([7, 7]), np.array([0, 1]), out)
    p = _take_one(log)
    assert "sampled token 1 of generated token 1 is outside its recorded sampling support (2 tokens" in p.problems[0]


def test_load_hook_is_declared_as_a_vllm_plugin_and_undoable():
    """Worker processes get the load hook through vLLM's `vllm.general_plugins` entry point (the
    installed package declares it); installing it twice is one wrapper, and removing it restores
    vLLM's loader."""
    from importlib.metadata import entry_points

    pytest.importorskip("vllm")
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from moe_replay.integrations.vllm import patch

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "moe_replay_capture"]
    assert ep.load() is patch.register_plugin
    was_installed = patch.LoadHook.installed is not None
    patch.remove_load_hook()
    plain = BaseModelLoader.__dict__["load_model"]
    try:
        assert not getattr(plain, "__moe_replay_wrapped__", False)
        hook = patch.install_load_hook()
        assert patch.install_load_hook() is hook
        assert BaseModelLoader.__dict__["load_model"].__wrapped__ is plain
        patch.remove_load_hook()
        assert BaseModelLoader.__dict__["load_model"] is plain
    finally:
        if was_installed:
            patch.install_load_hook()


def test_stitch_keeps_the_typed_fields_and_refuses_mixed_weights():
    """A stitched conversation keeps its turns' sampling and weights version; turns sampled with
    different weights (two policies' routes) or different sampling parameters (scored two ways)
    are never one record."""
    import dataclasses

    from moe_replay.errors import TraceAlignmentError
    from moe_replay.trace import Sampling, stitch

    from .trace_factory import random_trace

    rng = np.random.default_rng(3)
    first = random_trace("conv#0", rng, num_tokens=20, prompt_len=8)
    first.weights_version, first.sampling = "step-4", Sampling(temperature=0.7, top_p=0.9, seed=1)
    tail = random_trace("conv#1", rng, num_tokens=40, prompt_len=30, route_start=19)
    tail.token_ids_S[:20] = first.token_ids_S
    tail.sampling, tail.weights_version = Sampling(temperature=0.7, top_p=0.9), "step-4"
    joined = stitch(first, tail)
    assert joined.sampling == tail.sampling and joined.weights_version == "step-4"
    assert joined.route_start == 0 and joined.num_route_rows == 39
    np.testing.assert_array_equal(joined.routes_TLK[:19], first.routes_TLK[:19])
    np.testing.assert_array_equal(joined.routes_TLK[19:], tail.routes_TLK)
    with pytest.raises(TraceAlignmentError, match=r"weights_version 'step-5'.*'step-4'"):
        stitch(first, dataclasses.replace(tail, weights_version="step-5"))
    with pytest.raises(TraceAlignmentError, match=r"field 'sampling'.*'temperature': 1.0"):
        stitch(first, dataclasses.replace(tail, sampling=Sampling(temperature=1.0, top_p=0.9)))


@pytest.mark.parametrize("dtype,id_dtype", [(torch.float32, torch.int32), (torch.bfloat16, torch.int64)])
def test_host_stage_in_numpy_equals_the_device_path(monkeypatch, dtype, id_dtype):
    """compute() on a host stage runs in numpy (sampler_hook._kept_numpy), on a device stage in
    torch (_kept_torch): over random truncated rows of several steps (a mixed greedy step, rows
    above max_support, a token outside its row) the two give the same tokens, sizes, ids and
    outside flags, and logprobs within 1e-6 of torch's x[token] - logsumexp(x) in fp32. A host
    step keeps references to its logit rows and sampled ids (int32 as vLLM 0.32 returns them, or
    int64): that equals a stage the rows are copied into, bit for bit."""
    from moe_replay.integrations.vllm.capture import sampler_hook

    gen = torch.Generator().manual_seed(0)
    steps = []
    for b in (5, 3, 4):
        logits = torch.randn(b, 64, generator=gen).to(dtype)
        keep = torch.rand(b, 64, generator=gen) < torch.linspace(0.05, 0.9, b).view(-1, 1)
        keep[:, 0] = True
        logits = logits.masked_fill(~keep, float("-inf"))
        tokens = [int(torch.multinomial(keep[i].float(), 1, generator=gen)) for i in range(b)]
        steps.append((logits, tokens))
    steps[1][1][2] = int(torch.nonzero(steps[1][0][2] == float("-inf"))[0])  # drawn outside its set

    def run():
        stage = SupportStage(max_support=40, want_support=True, want_logprobs=True, budget_bytes=0, min_rows=16)
        for i, (logits, tokens) in enumerate(steps):
            stage.truncate_and_observe(lambda x, g, k, p: (None, None), logits.clone(), {}, None, None)
            meta = _meta(torch.tensor([1.0, 0.0, 1.0]), all_random=False) if i == 1 else _meta()
            commit(stage, torch.tensor(tokens, dtype=id_dtype).view(-1, 1), meta)
        return stage.compute()

    host = run()
    with monkeypatch.context() as m:
        m.setattr(SupportStage, "hold_host", False)  # rows copied into a host stage (torch copy_)
        copied = run()
    for name in ("tokens_R", "sizes_R", "offsets_R1", "ids_N", "outside_R", "logprobs_R"):
        assert np.array_equal(getattr(host, name), getattr(copied, name), equal_nan=True), name
    assert host.tokens_R.dtype == np.int64
    monkeypatch.setattr(SupportStage, "hold_host", False)
    monkeypatch.setattr(sampler_hook, "_host_array", lambda *a: None)
    dev = run()
    for name in ("tokens_R", "sizes_R", "offsets_R1", "ids_N", "outside_R"):
        assert np.array_equal(getattr(host, name), getattr(dev, name)), name
    assert host.sizes_R.max() > 40 and host.outside_R.sum() == 1 and host.sizes_R[6] == 1  # the cases ran
    all_RV = torch.cat([lg for lg, _ in steps]).float()
    tok_R = torch.from_numpy(host.tokens_R)
    want_R = (all_RV.gather(1, tok_R.view(-1, 1)).view(-1) - torch.logsumexp(all_RV, 1)).numpy()
    want_R[6] = 0.0  # the greedy row: a point mass
    assert host.logprobs_R[7] == want_R[7] == float("-inf")  # the token outside its set
    fin = np.isfinite(want_R)
    assert fin.sum() == 11 and np.abs(host.logprobs_R[fin] - want_R[fin]).max() <= 1e-6
    if dtype == torch.float32:
        assert np.abs(host.logprobs_R[fin] - dev.logprobs_R[fin]).max() <= 1e-6


def test_host_stage_copies_by_address_and_falls_back_to_views():
    """A host stage copies held logit rows and sampled ids at the flush from the addresses taken at
    commit; ids of another dtype than the first step's, or not contiguous, make it read every step by
    view instead: all three give the same staged samples. A step whose sampler drew more tokens than
    it had truncated rows is refused at commit (the flush copies rows by count)."""
    gen = torch.Generator().manual_seed(1)
    steps = []
    for b in (4, 2, 3):
        logits = torch.randn(b, 32, generator=gen).masked_fill(torch.rand(b, 32, generator=gen) < 0.6, float("-inf"))
        logits[:, 5] = 1.0
        steps.append((logits, [5] * b))

    def run(ids_of):
        stage = SupportStage(max_support=64, want_support=True, want_logprobs=True, budget_bytes=0, min_rows=16)
        for i, (logits, tokens) in enumerate(steps):
            stage.truncate_and_observe(lambda x, g, k, p: (None, None), logits.clone(), {}, None, None)
            commit(stage, ids_of(i, tokens), _meta())
        return stage, stage.compute()

    plain = run(lambda i, t: torch.tensor(t, dtype=torch.int32).view(-1, 1))
    assert len(plain[0]._deferred_ptrs) == 0 and plain[0]._id_dtype is torch.int32
    mixed = run(lambda i, t: torch.tensor(t, dtype=torch.int64 if i == 1 else torch.int32).view(-1, 1))
    def every_other(i, t):  # [B, 1] with row stride 2: not contiguous; a copy by address would read the 0s
        return torch.tensor([v for x in t for v in (x, 0)], dtype=torch.int32)[::2].unsqueeze(1)

    assert not every_other(0, [5, 5]).is_contiguous()
    strided = run(every_other)
    for other in (mixed[1], strided[1]):
        for name in ("tokens_R", "sizes_R", "offsets_R1", "ids_N", "logprobs_R"):
            assert np.array_equal(getattr(plain[1], name), getattr(other, name)), name
    assert plain[1].tokens_R.tolist() == [5] * 9 and (plain[1].sizes_R > 1).all()
    stage = SupportStage(max_support=8, want_support=True, want_logprobs=True, budget_bytes=0, min_rows=4)
    stage.truncate_and_observe(lambda x, g, k, p: (None, None), steps[1][0].clone(), {}, None, None)
    with pytest.raises(CaptureHookError, match="drew 3 tokens from 2 truncated logit rows"):
        commit(stage, torch.tensor([[5], [5], [5]]), _meta())


def test_held_route_ids_join_by_address_as_by_torch_cat():
    """Eager route capture holds each layer's router ids; `land` takes their addresses, and the flush
    copies the first n_s rows of each by address, which equals torch.cat of the trimmed tensors,
    padded forwards (more rows than the step scheduled) included. A tensor without an address (not
    contiguous) or a step of another dtype sends the whole window to torch.cat."""
    from moe_replay.integrations.vllm.capture.route_hook import _join_held

    gen = torch.Generator().manual_seed(2)
    K, landed = 4, []
    for n, rows in ((5, 5), (2, 4), (3, 3)):  # the second step's forward was padded to 4 rows
        held = [torch.randint(0, 60, (rows, K), generator=gen, dtype=torch.int32) for _ in range(3)]
        landed.append((n, held, [h.data_ptr() for h in held], torch.int32))
    want = torch.cat([h[:n] for n, held, _, _ in landed for h in held]).numpy()
    got = _join_held(landed, K)
    assert got.dtype == np.int32 and got.shape == (3 * 10, K) and np.array_equal(got, want)
    wide = torch.randint(0, 60, (3, 2 * K), generator=gen, dtype=torch.int64)
    other = [(*landed[:2], (3, [wide[:, :K].contiguous()] * 3, [wide.data_ptr()] * 3, torch.int64))]
    want64 = torch.cat([h[:n] for n, held, _, _ in other[0] for h in held]).numpy()
    assert np.array_equal(_join_held(other[0], K), want64)  # the dtypes differ: torch.cat (which widens)
    landed[0][1][1] = torch.randint(0, 60, (5, 2 * K), generator=gen, dtype=torch.int32)[:, ::2]  # strided: no address
    assert not landed[0][1][1].is_contiguous()
    landed[0][2][1] = 0
    want = torch.cat([h[:n] for n, held, _, _ in landed for h in held]).numpy()
    assert np.array_equal(_join_held(landed, K), want)


def test_joined_layouts_slice_consecutive_ring_rows_once():
    """Steps taken one after the other from host rings sit back to back, so a window reads each ring
    once (step.join_rows); rows not back to back, or plain arrays, are concatenated: both give the
    same window."""
    from moe_replay.integrations.vllm.step import HostRing, StepLayout, byte_view, join_rows, take_rows

    qsl, pos, disc = HostRing(np.dtype(np.int32), 16), HostRing(np.dtype(np.int64), 16), HostRing(np.dtype(bool), 8)
    steps = [(np.array([0, 3, 5], np.int32), np.array([0, 1, 2, 0, 1]), np.array([False, True])),
             (np.array([0, 1, 2], np.int32), np.array([3, 2]), np.array([False, False]))]

    def take(q, p, d):
        return StepLayout(["a", "b"], *take_rows(((qsl, byte_view(q)), (pos, byte_view(p)), (disc, byte_view(d))),
                                                 (len(q), len(p), len(d))))

    ring = [take(*st) for st in steps]
    assert join_rows([lay._pos for lay in ring]).base is not pos.array  # a copy: the ring is rewound after
    plain = [StepLayout(["a", "b"], *st) for st in steps]
    qsl.used += 1  # a gap: the next step's query starts are not right after this one's
    apart = [ring[0], take(*steps[1])]
    assert apart[1]._qsl[1] == ring[1]._qsl[2] + 1
    for lays in (plain, apart):
        a, b = StepLayout.joined(ring), StepLayout.joined(lays)
        for name in a._fields:
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
    j = StepLayout.joined(ring)
    assert j.start_B.tolist() == [0, 3, 5, 6] and j.stop_B.tolist() == [3, 5, 6, 7]
    assert j.pos_T.tolist() == [0, 1, 2, 0, 1, 3, 2] and j.discard_B.tolist() == [False, True, False, False]
    # a ring without room starts over; a step larger than the ring is refused by name
    ring8 = HostRing(np.dtype(np.int64), 8)
    src = byte_view(np.arange(8, dtype=np.int64))
    assert take_rows(((ring8, src),), (5,))[0][1:] == (0, 5)
    got = take_rows(((ring8, src),), (4,))[0]
    assert got[1:] == (0, 4) and got[0][:4].tolist() == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="a step of 9 items exceeds the host ring"):
        take_rows(((ring8, byte_view(np.arange(9, dtype=np.int64))),), (9,))


def test_a_logits_buffer_the_sampler_reuses_is_refused():
    """A host stage holds each step's truncated logits until the flush, which is exact only while
    the sampler hands over a fresh tensor each step: one handed over again at the same address (an
    engine that reuses its logits buffer) would overwrite held rows, so the commit refuses it."""
    stage = SupportStage(max_support=8, want_support=True, want_logprobs=True, budget_bytes=1 << 16, min_rows=4)
    buf = torch.randn(2, 16)
    ids = torch.zeros(2, 1, dtype=torch.int32)
    stage.truncate_and_observe(lambda x, g, k, p: (None, None), buf, {}, None, None)
    commit(stage, ids, _meta())
    stage.truncate_and_observe(lambda x, g, k, p: (None, None), buf, {}, None, None)
    with pytest.raises(CaptureHookError, match="reuses a logits buffer"):
        commit(stage, ids, _meta())


def test_data_parallel_replies_merge_per_op():
    """Under data parallelism every engine answers each op (link._every_engine); a take keeps the
    record of the one engine that holds the key, counters add up, and ops without a rule must agree."""
    from moe_replay.integrations.vllm.errors import CaptureHookError
    from moe_replay.integrations.vllm.link import merge_engines
    from moe_replay.integrations.vllm.wire import CaptureRecord

    def rec(status, key, **kw):
        return CaptureRecord(status, key=key, **kw).to_dict()

    engine0 = [rec("ok", "a", req_id="a-1", prompt_len=3), rec("unknown", "b", known=2), rec("unknown", "c", known=2),
               rec("ok", "d", req_id="d-1"), rec("unknown", "e", known=2), rec("unknown", "f", known=2)]
    engine1 = [rec("unknown", "a", known=1), rec("ok", "b", req_id="b-1", prompt_len=5), rec("evicted", "c"),
               rec("ok", "d", req_id="d-9"), rec("unknown", "e", known=1), rec("ambiguous", "f", matches=["f-1", "f-2"])]
    a, b, c, d, e, f = (CaptureRecord.from_dict(r) for r in merge_engines("capture.take", [engine0, engine1]))
    assert f.status == "ambiguous" and f.matches == ["f-1", "f-2"]  # one engine's ambiguity is kept
    assert (a.status, a.req_id, a.prompt_len) == ("ok", "a-1", 3)
    assert (b.status, b.req_id, b.prompt_len) == ("ok", "b-1", 5)
    assert c.status == "evicted"  # one engine evicted it: more telling than another's "unknown"
    assert d.status == "ambiguous" and d.matches == ["engine 0: d-1", "engine 1: d-9"]
    assert (e.status, e.known) == ("unknown", 3)  # records held over both engines
    assert merge_engines("capture.discard", [2, 1]) == 3
    assert merge_engines("capture.uninstall", [True, False]) is False
    stats = merge_engines("capture.stats", [{"steps": 4, "route_mode": "hold", "hook_s": 0.5},
                                            {"steps": 6, "route_mode": "hold", "hook_s": 0.25}])
    assert stats["steps"] == 10 and stats["route_mode"] == "hold" and stats["hook_s"] == 0.75
    assert [s["steps"] for s in stats["engines"]] == [4, 6]
    assert merge_engines("weights.end", [{"v": 1}]) == {"v": 1}  # one engine: its value as is
    with pytest.raises(CaptureHookError, match=r"weights.end: expected the 2 data-parallel engines to reply alike"):
        merge_engines("weights.end", [{"v": 1}, {"v": 2}])


def test_data_parallel_score_takes_keep_the_engine_that_ran_each_request():
    """Scoring requests are registered on every data-parallel engine; a take keeps the result of the
    one engine that forwarded the request (cached >= 0), reports one that no engine ran as never
    scored, and makes one that two engines ran a problem of that request, never a silent pick."""
    import numpy as np

    from moe_replay.integrations.vllm.link import merge_engines
    from moe_replay.integrations.vllm.scoring import scorer  # noqa: F401  (registers the score.take merge)
    from moe_replay.integrations.vllm.wire import ScoreResult

    def res(cached, lp=(0.0,), problems=()):
        return ScoreResult("ok", logprobs_G=np.array(lp, dtype=np.float32), problems=list(problems),
                           cached=cached).to_dict()

    never = "generated token 0 was never scored"
    engine0 = [res(0, (-1.5,)), res(-1, (np.nan,), [never]), res(-1, (np.nan,), [never]), res(3, (-0.5,))]
    engine1 = [res(-1, (np.nan,), [never]), res(5, (-2.5,)), res(-1, (np.nan,), [never]), res(3, (-0.5,))]
    a, b, c, d = (ScoreResult.from_dict(r) for r in merge_engines("score.take", [engine0, engine1]))
    assert (a.cached, a.logprobs_G.tolist(), a.problems) == (0, [-1.5], [])
    assert (b.cached, b.logprobs_G.tolist(), b.problems) == (5, [-2.5], [])
    assert c.problems == [never]
    assert d.problems == ["expected one data-parallel engine to run the request, found engines [0, 1]"]
    take = merge_engines("capture.take", [[{"status": "unknown", "key": "k", "known": 1}]] * 2)  # capture's rule stays
    assert take == [{"status": "unknown", "key": "k", "known": 2}]


def test_data_parallel_rows_cut_this_ranks_rows_from_the_gathered_batch():
    """vLLM's MoE layers route the whole DP batch (every rank's tokens, rank by rank); the capture
    function keeps rank r's rows, located by the forward context's per-rank counts, and an unknown
    layout yields no rows and a reason (never another rank's routes)."""
    pytest.importorskip("vllm")
    import torch
    from vllm.forward_context import DPMetadata, override_forward_context

    from moe_replay.integrations.vllm.capture.route_hook import DataParallelRows

    ids_TK = torch.arange(16).view(8, 2)  # rank 0 routed 3 tokens, rank 1 five
    counts = torch.tensor([3, 5])
    for rank, rows in ((0, slice(0, 3)), (1, slice(3, 8))):
        cut = DataParallelRows(rank)
        with override_forward_context(SimpleNamespace(dp_metadata=DPMetadata(counts))):
            assert torch.equal(cut(ids_TK), ids_TK[rows])  # the gathered batch
            assert torch.equal(cut(ids_TK[rows]), ids_TK[rows])  # a kernel that routes own rows only
            assert cut(ids_TK[:6]).shape == (0, 2) and not cut.odd[1:]
            assert "a router routed 6 rows; expected this DP rank's" in cut.odd[0]
        with override_forward_context(SimpleNamespace(dp_metadata=DPMetadata(counts, local_sizes=[2, 2, 3, 3]))):
            sp = DataParallelRows(rank)(torch.arange(20).view(10, 2))  # SP shards gathered DP rank by DP rank
            assert torch.equal(sp, torch.arange(20).view(10, 2)[(0, 4)[rank]:(0, 4)[rank] + int(counts[rank])])
        with override_forward_context(SimpleNamespace(dp_metadata=None)):
            assert cut(ids_TK) is ids_TK  # no DP metadata (a dummy or profile run): as routed


def test_part_timings_merge_over_engines_and_name_the_rpc():
    """Capture's per-part host times (timings.py): data-parallel engines' parts add up; the client's
    view turns its own take call into client.rpc, less the worker's time inside take(); shares are
    fractions of a wall time, largest first."""
    from moe_replay.integrations.vllm.link import merge_engines
    from moe_replay.integrations.vllm.timings import PartTimes, client_view, shares

    w0 = {"parts": {"step.after_forward": {"s": 0.5, "calls": 10}, "flush.kept_sets": {"s": 0.25, "calls": 1}}, "take_s": 0.125}
    w1 = {"parts": {"step.after_forward": {"s": 0.25, "calls": 6}}, "take_s": 0.0625}
    merged = merge_engines("capture.timings", [w0, w1])
    assert merged["parts"]["step.after_forward"] == {"s": 0.75, "calls": 16}
    assert merged["parts"]["flush.kept_sets"] == {"s": 0.25, "calls": 1} and merged["take_s"] == 0.1875
    client = PartTimes()
    client.add("client.take_call", 0.25)
    client.add("client.build", 0.125)
    client.add("client.build", 0.125)
    view = client_view(merged, client)
    assert view["client.rpc"] == {"s": 0.0625, "calls": 1}  # 0.25 s call - 0.1875 s inside take()
    assert view["client.build"] == {"s": 0.25, "calls": 2} and "client.take_call" not in view
    assert view["step.after_forward"]["s"] == 0.75  # the worker's parts pass through
    sh = shares(view, wall_s=10.0)
    assert list(sh)[:2] == ["total", "step.after_forward"] and sh["step.after_forward"] == 0.075
    assert sh["total"] == pytest.approx((0.75 + 0.25 + 0.0625 + 0.25) / 10)
    client.reset()
    assert client.to_dict() == {} and client.total() == 0.0


def test_step_bracket_hands_the_step_to_the_sampler_or_to_after_unsampled():
    """The step bracket keeps each step's scheduler output for a listener that files its step in
    the sampler wrapper (capture's one hook a step), and calls that listener's after_unsampled
    when execute_model returned its output itself (no sampler runs); a listener without
    step_hooks (scoring) gets before_step, before_forward and after_forward only."""
    from types import SimpleNamespace

    from moe_replay.integrations.vllm.patch import step_bracket
    from moe_replay.integrations.vllm.runner import runner_state

    class Runner:
        def __init__(self):
            self.returns = None

        def execute_model(self, scheduler_output, dummy_run=False):
            return self.returns

    class Sampled:  # files in its sampler: takes `scheduled` there
        step_hooks = ("after_unsampled",)
        hook_s = 0.0

        def __init__(self):
            self.unsampled = []

        def after_unsampled(self, so):
            self.unsampled.append(so)

    class Plain:  # no step_hooks: the default three
        hook_s = 0.0

        def __init__(self):
            self.seen = []

        def before_step(self, so):
            self.seen.append(("before_step", so))

        def before_forward(self):
            self.seen.append(("before_forward",))

        def after_forward(self, so):
            self.seen.append(("after_forward", so))

    runner = Runner()
    sampled, plain = Sampled(), Plain()
    bracket = step_bracket(runner, sampled)
    assert step_bracket(runner, plain) is bracket
    first, second = SimpleNamespace(name="first"), SimpleNamespace(name="second")
    assert runner.execute_model(first) is None
    assert bracket.scheduled is first and sampled.unsampled == []  # kept until the sampler takes it
    runner.returns = "output"
    assert runner.execute_model(second) == "output"
    assert bracket.scheduled is None and sampled.unsampled == [second]  # no sampler follows: filed now
    assert plain.seen == [("before_step", first), ("after_forward", first),
                          ("before_step", second), ("after_forward", second)]  # no _model_forward here
    runner.returns = None  # Model Runner V2's dummy runs (warm-up, profile, an idle DP rank) go through
    assert runner.execute_model(SimpleNamespace(name="dummy"), dummy_run=True) is None  # execute_model: no step
    assert bracket.scheduled is None and len(plain.seen) == 4 and sampled.unsampled == [second]
    bracket.remove(sampled)
    bracket.remove(plain)
    assert "execute_model" not in runner.__dict__ and runner_state(runner).bracket is None
