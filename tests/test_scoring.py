"""Chunked scoring (moe_replay.replay.scoring) against the dense reference it replaced, in float64.

The reference is the former dense-mask implementation (`masked_logprobs` over a `support_mask_GV`,
kept here verbatim but for its float32 cast): softmax(logits / T) masked to the kept set, T = 0
scored unscaled. Values and gradients (through logprob, entropy and the full-vocabulary pair) must
agree on random data for several shapes, support sizes 1..V and temperatures 0 / 0.7 / 1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_replay.replay import ScoringInputError, SupportCSR, score_logits
from moe_replay.replay.host_reads import HostReads
from moe_replay.trace import SamplingSupport

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def dense_mask(support: SupportCSR, vocab: int) -> torch.Tensor:
    g = support.num_rows
    mask_GV = torch.zeros((g, vocab), dtype=torch.bool)
    row_N = torch.repeat_interleave(torch.arange(g), support.sizes_G())
    mask_GV[row_N, support.ids_N] = True
    if support.whole_G is not None:
        mask_GV[support.whole_G] = True
    return mask_GV


def reference(logits_GV, target_G, mask_GV, temperature):
    """The former masked_logprobs, dtype kept (it cast to float32)."""
    x_GV = logits_GV
    t_G = temperature.to(x_GV).reshape(-1, 1)
    x_GV = x_GV / torch.where(t_G > 0, t_G, torch.ones_like(t_G))
    if mask_GV is not None:
        x_GV = x_GV.masked_fill(~mask_GV, float("-inf"))
    logp_GV = torch.log_softmax(x_GV, dim=-1)
    logprobs_G = logp_GV.gather(1, target_G.reshape(-1, 1)).squeeze(1)
    safe_GV = logp_GV if mask_GV is None else logp_GV.masked_fill(~mask_GV, 0.0)
    entropy_G = -(safe_GV.exp() * safe_GV).sum(dim=-1)
    return logprobs_G, entropy_G


def random_case(seed: int, g: int, v: int, max_kept: int, temps=(0.0, 0.7, 1.0), whole_every: int = 0):
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.normal(0, 3, (g, v)))
    t_G = torch.tensor(rng.choice(temps, g), dtype=torch.float64)
    rows, targets, whole = [], [], []
    for i in range(g):
        size = 1 if t_G[i] == 0 else int(rng.integers(1, max_kept + 1))
        kept = np.sort(rng.choice(v, size, replace=False))
        rows.append(kept)
        targets.append(int(rng.choice(kept)))
        whole.append(bool(whole_every) and i % whole_every == 0 and t_G[i] > 0)
    support = SupportCSR.from_supports([SamplingSupport.from_rows(rows)], [g])
    whole_G = torch.tensor(whole)
    if whole_G.any():
        sizes = torch.where(whole_G, torch.zeros(g, dtype=torch.long), support.sizes_G())
        keep = torch.repeat_interleave(~whole_G, support.sizes_G())
        off = torch.zeros(g + 1, dtype=torch.long)
        off[1:] = sizes.cumsum(0)
        support = SupportCSR(off, support.ids_N[keep], whole_G)
    return logits, torch.tensor(targets), support, t_G


def check_against_reference(logits, target, support, t_G, *, full: bool, chunk_bytes=None, backend="auto"):
    weights = torch.randn(4, logits.shape[0], dtype=torch.float64)
    x_new = logits.clone().requires_grad_(True)
    s = score_logits(x_new, target, support=support, temperature=t_G, full=full, chunk_bytes=chunk_bytes, backend=backend)
    x_ref = logits.clone().requires_grad_(True)
    lp, ent = reference(x_ref, target, None if support is None else dense_mask(support, logits.shape[1]), t_G)
    outs_new, outs_ref = [s.logprobs_G, s.entropy_G], [lp, ent]
    if full:
        lp_f, ent_f = reference(x_ref, target, None, t_G)
        outs_new += [s.full_logprobs_G, s.full_entropy_G]
        outs_ref += [lp_f, ent_f]
    for a, b in zip(outs_new, outs_ref):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    sum(w @ o for w, o in zip(weights, outs_new)).backward()
    sum(w @ o for w, o in zip(weights, outs_ref)).backward()
    torch.testing.assert_close(x_new.grad, x_ref.grad, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("g,v", [(1, 2), (7, 33), (64, 257)])
@pytest.mark.parametrize("full", [False, True])
def test_matches_dense_reference_without_support(g, v, full):
    logits, target, _, t_G = random_case(g * v, g, v, 1, temps=(0.7, 1.0, 0.0))
    check_against_reference(logits, target, None, t_G, full=full)


@pytest.mark.parametrize("g,v", [(1, 2), (7, 33), (64, 257)])
@pytest.mark.parametrize("max_kept", ["one", "few", "all"])
@pytest.mark.parametrize("full", [False, True])
def test_matches_dense_reference_with_support(g, v, max_kept, full):
    kept = {"one": 1, "few": min(5, v), "all": v}[max_kept]
    logits, target, support, t_G = random_case(g + v + kept, g, v, kept, whole_every=3)
    check_against_reference(logits, target, support, t_G, full=full)


@FAST
@given(g=st.integers(1, 24), v=st.integers(2, 80), kept=st.integers(1, 80), seed=st.integers(0, 2**31),
       full=st.booleans(), whole_every=st.integers(0, 4), chunk_rows=st.integers(1, 9))
def test_matches_dense_reference_random(g, v, kept, seed, full, whole_every, chunk_rows):
    logits, target, support, t_G = random_case(seed, g, v, min(kept, v), whole_every=whole_every)
    check_against_reference(logits, target, support, t_G, full=full, chunk_bytes=chunk_rows * 2 * v * 8)


def test_rows_index_a_bigger_logits_tensor_and_unscored_rows_get_zero_grad():
    logits, target, support, t_G = random_case(3, 6, 40, 6)
    big = torch.randn(10, 40, dtype=torch.float64)
    rows = torch.tensor([9, 0, 4, 2, 7, 5])
    big[rows] = logits
    x = big.clone().requires_grad_(True)
    s = score_logits(x, target, rows_G=rows, support=support, temperature=t_G, full=True, chunk_bytes=2 * 40 * 8)
    lp, _ = reference(logits, target, dense_mask(support, 40), t_G)
    torch.testing.assert_close(s.logprobs_G, lp)
    (s.logprobs_G.sum() + s.full_entropy_G.sum()).backward()
    assert (x.grad[[1, 3, 6, 8]] == 0).all() and x.grad[rows].abs().sum() > 0


def test_bf16_logits_score_in_float32_with_a_bf16_gradient():
    logits, target, support, t_G = random_case(5, 8, 300, 20)
    x = logits.to(torch.bfloat16).requires_grad_(True)
    s = score_logits(x, target, support=support, temperature=t_G.float())
    assert s.logprobs_G.dtype == torch.float32
    lp, _ = reference(x.detach().double(), target, dense_mask(support, 300), t_G)
    torch.testing.assert_close(s.logprobs_G.double(), lp, rtol=1e-5, atol=1e-5)
    s.logprobs_G.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()


@pytest.mark.parametrize("with_support", [False, True])
def test_a_trainers_bf16_autocast_does_not_change_the_scores(with_support):
    """verl's FSDP engine scores inside torch.autocast(bf16): the statistics stay fp32 math."""
    logits, target, support, t_G = random_case(6, 8, 300, 20)
    x = logits.to(torch.bfloat16)
    sup = support if with_support else None
    plain = score_logits(x, target, support=sup, temperature=t_G.float(), backend="torch_chunked")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = score_logits(x, target, support=sup, temperature=t_G.float(), backend="torch_chunked")
    for a, b in ((plain.logprobs_G, under.logprobs_G), (plain.entropy_G, under.entropy_G)):
        assert b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- bad input: a typed error naming the row and the value, never a NaN --------------------------
def test_support_row_without_its_sampled_token_is_refused():
    logits, target, _, t_G = random_case(1, 3, 10, 1, temps=(1.0,))
    support = SupportCSR.from_supports([SamplingSupport.from_rows([[int(target[0])], [int(target[1]) ^ 1], [int(target[2])]])], [3])
    with pytest.raises(ScoringInputError, match=rf"support\[row 1\].*sampled token {int(target[1])}") as e:
        score_logits(logits, target, support=support, temperature=t_G)
    assert e.value.row == 1


def test_ids_out_of_the_vocabulary_are_refused():
    logits = torch.randn(2, 10, dtype=torch.float64)
    with pytest.raises(ScoringInputError, match=r"target_G\[row 1\].*\[0, 10\).*found 10"):
        score_logits(logits, torch.tensor([3, 10]))
    bad = SupportCSR(torch.tensor([0, 1, 3]), torch.tensor([3, 4, 12]))
    with pytest.raises(ScoringInputError, match=r"support.ids_N\[row 1\].*found 12"):
        score_logits(logits, torch.tensor([3, 4]), support=bad)


def test_greedy_temperature_with_a_stochastic_kept_set_is_refused():
    logits = torch.randn(2, 10, dtype=torch.float64)
    support = SupportCSR(torch.tensor([0, 1, 4]), torch.tensor([3, 1, 4, 5]))
    with pytest.raises(ScoringInputError, match=r"temperature\[row 1\].*temperature 0 with 3 kept ids"):
        score_logits(logits, torch.tensor([3, 4]), support=support, temperature=torch.tensor([0.0, 0.0]))
    with pytest.raises(ScoringInputError, match=r"temperature\[row 0\].*-0.5"):
        score_logits(logits, torch.tensor([3, 4]), temperature=torch.tensor([-0.5, 1.0]))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("with_support", [False, True])
def test_non_finite_logits_are_refused_by_row_and_value(value, with_support):
    logits = torch.randn(4, 10, dtype=torch.float64)
    logits[2, 4] = value
    support = SupportCSR(torch.tensor([0, 1, 2, 4, 5]), torch.tensor([1, 2, 3, 4, 5])) if with_support else None
    with pytest.raises(ScoringInputError, match=rf"logits\[row 2\].*{value} at token 4"):
        score_logits(logits, torch.tensor([1, 2, 3, 5]), support=support)


def test_non_finite_logits_outside_the_kept_set_are_not_read():
    logits = torch.randn(2, 10, dtype=torch.float64)
    logits[0, 7] = float("nan")
    support = SupportCSR(torch.tensor([0, 2, 3]), torch.tensor([1, 2, 5]))
    s = score_logits(logits, torch.tensor([1, 5]), support=support)
    assert torch.isfinite(s.logprobs_G).all() and s.logprobs_G[1] == 0


def test_a_kept_id_listed_twice_is_refused_by_row_and_id():
    """{3, 3} would score log p(3) = log 1/2 where the kept set {3} gives 0."""
    logits = torch.zeros(3, 10, dtype=torch.float64)
    dup = SupportCSR(torch.tensor([0, 1, 4, 5]), torch.tensor([2, 7, 3, 7, 4]))  # row 1 holds 7 twice, unsorted
    with pytest.raises(ScoringInputError, match=r"support.ids_N\[row 1\].*distinct kept token ids.*token 7 kept 2 times") as e:
        score_logits(logits, torch.tensor([2, 3, 4]), support=dup)
    assert e.value.row == 1
    fine = SupportCSR(torch.tensor([0, 1, 3, 4]), torch.tensor([2, 7, 3, 4]))  # unsorted but distinct: scored
    s = score_logits(logits, torch.tensor([2, 3, 4]), support=fine)
    torch.testing.assert_close(s.logprobs_G, torch.tensor([0.0, -np.log(2), 0.0], dtype=torch.float64))


def test_only_hand_built_supports_are_checked_for_duplicates(monkeypatch):
    from moe_replay.replay import scoring_job

    calls = []
    monkeypatch.setattr(scoring_job, "_check_distinct", lambda *a: calls.append(a))
    logits, target, _, t_G = random_case(2, 4, 12, 3, temps=(1.0,))
    built = SupportCSR.from_supports([SamplingSupport.from_rows([[int(t)] for t in target])], [4])
    assert built.ids_distinct and built.to("cpu").ids_distinct
    score_logits(logits, target, support=built)
    assert calls == []  # SamplingSupport rows are strictly increasing: checked once, on the trace
    score_logits(logits, target, support=SupportCSR(built.offsets_G1, built.ids_N))
    assert len(calls) == 1


def test_an_empty_kept_set_is_refused_unless_the_row_keeps_the_vocabulary():
    logits = torch.zeros(2, 10, dtype=torch.float64)
    empty = SupportCSR(torch.tensor([0, 1, 1]), torch.tensor([2]))
    with pytest.raises(ScoringInputError, match=r"support\[row 1\].*sampled token 5.*a kept set of 0 ids") as e:
        score_logits(logits, torch.tensor([2, 5]), support=empty)
    assert e.value.row == 1
    whole = SupportCSR(empty.offsets_G1, empty.ids_N, whole_G=torch.tensor([False, True]))
    s = score_logits(logits, torch.tensor([2, 5]), support=whole)
    torch.testing.assert_close(s.logprobs_G, torch.tensor([0.0, -np.log(10)], dtype=torch.float64))


@pytest.mark.parametrize("with_support", [False, True])
@pytest.mark.parametrize("full", [False, True])
def test_no_scored_rows_give_empty_scores_and_a_zero_gradient(with_support, full):
    """A batch without generated tokens is legal: [0] scores, not a KeyError."""
    none_G = torch.zeros(0, dtype=torch.long)
    support = SupportCSR(torch.zeros(1, dtype=torch.long), none_G) if with_support else None
    x = torch.randn(3, 10, dtype=torch.bfloat16, requires_grad=True)  # rows exist, none is scored
    s = score_logits(x, none_G, rows_G=none_G, support=support, full=full)
    outs = [s.logprobs_G, s.entropy_G] + ([s.full_logprobs_G, s.full_entropy_G] if full else [])
    assert all(o.shape == (0,) and o.dtype == torch.float32 for o in outs)
    assert (s.full_logprobs_G is None) == (not full)
    sum(o.sum() for o in outs).backward()
    assert x.grad.shape == x.shape and x.grad.dtype == x.dtype and not x.grad.any()
    lone = score_logits(torch.zeros(0, 10, dtype=torch.float64), none_G, support=support, entropy=False)
    assert lone.logprobs_G.shape == (0,) and lone.logprobs_G.dtype == torch.float64 and lone.entropy_G is None


# -- vocabulary-parallel logits (Megatron tensor parallelism), on two gloo ranks --------------------
def _shard_worker(rank: int, world: int, init: str, cases: list, out: dict, backend: str) -> None:
    import torch.distributed as dist

    from moe_replay.replay import VocabShard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for c, case in enumerate(cases):
            logits, bounds = case["logits"], case["bounds"]
            lo, hi = bounds[rank], bounds[rank + 1]
            x = logits[:, lo:hi].clone().requires_grad_(True)
            s = score_logits(x, case["target"], support=case["support"], temperature=case["t_G"], full=True,
                             shard=VocabShard(lo, logits.shape[1]), chunk_bytes=3 * 2 * (hi - lo) * 8, backend=backend)
            w = case["weights"]
            (w[0] @ s.logprobs_G + w[1] @ s.entropy_G + w[2] @ s.full_logprobs_G + w[3] @ s.full_entropy_G).backward()
            out[(c, rank)] = [t.detach() for t in (s.logprobs_G, s.entropy_G, s.full_logprobs_G, s.full_entropy_G)] + [x.grad]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["torch_chunked", "torch_compiled"])
def test_vocab_parallel_shards_normalise_across_ranks(tmp_path, backend):
    """Two ranks holding columns [0, 23) and [23, 50): same scores as one rank, gradients split by column
    (targets off a rank's columns take the compiled kernel's no-target branch)."""
    import torch.multiprocessing as mp

    g, v = 9, 50
    cases = []
    for with_support in (False, True):
        logits, target, support, t_G = random_case(11, g, v, 30, whole_every=4)
        cases.append({"logits": logits, "target": target, "support": support if with_support else None, "t_G": t_G,
                      "weights": torch.randn(4, g, dtype=torch.float64), "bounds": [0, 23, v]})
    out = mp.Manager().dict()
    mp.spawn(_shard_worker, args=(2, f"file://{tmp_path}/init", cases, out, backend), nprocs=2, join=True)

    for c, case in enumerate(cases):
        x = case["logits"].clone().requires_grad_(True)
        s = score_logits(x, case["target"], support=case["support"], temperature=case["t_G"], full=True, backend="torch_chunked")
        ref = [s.logprobs_G, s.entropy_G, s.full_logprobs_G, s.full_entropy_G]
        sum(w @ o for w, o in zip(case["weights"], ref)).backward()
        for rank in (0, 1):  # every rank returns the same, fully normalised scores
            for a, b in zip(out[(c, rank)][:4], ref):
                torch.testing.assert_close(a, b.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(torch.cat([out[(c, 0)][4], out[(c, 1)][4]], 1), x.grad, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("with_support", [False, True])
@pytest.mark.parametrize("entropy", [True, False])
def test_gradient_of_the_logprob_alone(with_support, entropy):
    """No entropy term in the loss (the common policy-gradient case takes a one-buffer backward);
    entropy=False does not compute it at all."""
    logits, target, support, t_G = random_case(21, 12, 90, 10, whole_every=3)
    support = support if with_support else None
    x_new, x_ref = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    s = score_logits(x_new, target, support=support, temperature=t_G, entropy=entropy, full=True, chunk_bytes=5 * 2 * 90 * 8)
    assert (s.entropy_G is None and s.full_entropy_G is None) != entropy
    s.logprobs_G.sum().backward()
    mask = None if support is None else dense_mask(support, 90)
    lp, _ = reference(x_ref, target, mask, t_G)
    lp.sum().backward()
    torch.testing.assert_close(s.logprobs_G, lp.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s.full_logprobs_G, reference(logits, target, None, t_G)[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x_new.grad, x_ref.grad, rtol=1e-9, atol=1e-10)


# -- the compiled backend (torch.compile of the per-chunk full-vocabulary math) ----------------------
@pytest.mark.parametrize("with_support", [False, True])
@pytest.mark.parametrize("full", [False, True])
def test_compiled_backend_matches_the_dense_reference(with_support, full):
    """float64, 3-row chunks over 10 rows (a last chunk of one row), whole-vocabulary rows mixed with
    kept sets, temperatures 0 / 0.7 / 1: values and gradients as the reference."""
    logits, target, support, t_G = random_case(31, 10, 301, 40, whole_every=3)
    check_against_reference(logits, target, support if with_support else None, t_G, full=full,
                            chunk_bytes=3 * 2 * 301 * 8, backend="torch_compiled")


def test_compiled_backend_equals_eager_on_bf16_rows_of_a_bigger_tensor():
    """bf16 logits scored through rows_G (non-contiguous rows: the gathered path) and contiguous ones
    (written straight into the gradient): compiled and eager agree to float32 rounding."""
    logits, target, support, t_G = random_case(41, 12, 2000, 50, whole_every=4)
    big = torch.randn(20, 2000, dtype=torch.float64)
    for rows in (torch.arange(12), torch.tensor([19, 0, 4, 2, 7, 5, 11, 13, 3, 17, 8, 1])):
        big[rows] = logits
        results = []
        for backend in ("torch_chunked", "torch_compiled"):
            x = big.to(torch.bfloat16).requires_grad_(True)
            s = score_logits(x, target, rows_G=rows, support=support, temperature=t_G.float(), full=True,
                             chunk_bytes=5 * 2 * 2000 * 4, backend=backend)
            (s.logprobs_G.sum() + s.entropy_G.sum() + 0.5 * s.full_logprobs_G.sum() - s.full_entropy_G.sum()).backward()
            results.append([s.logprobs_G, s.entropy_G, s.full_logprobs_G, s.full_entropy_G, x.grad.float()])
        for a, b in zip(*results):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5)
        assert results[1][4].abs().sum() > 0


def test_auto_backend_compiles_large_full_vocabulary_work_only(monkeypatch):
    from moe_replay.replay import scoring, scoring_compiled

    logits, target, _, t_G = random_case(51, 8, 500, 1)
    small = scoring._prepare(logits, target, None, None, t_G, False, None, None)
    assert scoring_compiled.auto_backend(small) == "torch_chunked"  # 4,000 logits: eager
    monkeypatch.setattr(scoring_compiled, "COMPILE_MIN_ELEMENTS", 4000)
    assert scoring_compiled.auto_backend(small) == "torch_compiled"
    csr = SupportCSR.from_supports([SamplingSupport.from_rows([[int(t)] for t in target])], [8])
    sparse = scoring._prepare(logits, target, None, csr, t_G, False, None, None)
    assert scoring_compiled.auto_backend(sparse) == "torch_chunked"  # support only: no full-vocabulary pass
    check_against_reference(logits, target, None, t_G, full=True)  # through "auto", compiled


def test_auto_backend_stays_eager_and_warns_where_compiling_fails(monkeypatch):
    """A machine without a working compiler: one warning naming the error, eager scores, equal values."""
    from moe_replay.replay import SCORING_BACKENDS, scoring_compiled

    def broken():
        raise RuntimeError("no C++ compiler: g++ not found")

    monkeypatch.setattr(scoring_compiled, "_COMPILE_PROBE", {})
    monkeypatch.setattr(scoring_compiled, "COMPILE_MIN_ELEMENTS", 1)
    monkeypatch.setattr(SCORING_BACKENDS.get("torch_compiled"), "kernels", broken)
    logits, target, support, t_G = random_case(61, 6, 50, 5)
    with pytest.warns(RuntimeWarning, match="torch.compile unusable here.*g\\+\\+ not found"):
        check_against_reference(logits, target, support, t_G, full=True)
    assert isinstance(scoring_compiled._COMPILE_PROBE["error"], RuntimeError)
    check_against_reference(logits, target, support, t_G, full=True)  # decided once: no second warning needed


def test_default_chunks_are_not_cut_below_the_byte_floor():
    """Small work runs as one chunk (every chunk pays each eager op's fixed cost); large work is still
    cut so the extra peak stays near 1/4 of the logits, and the cap still bounds a chunk."""
    from moe_replay.replay import scoring, scoring_job

    floor_rows = scoring_job.CHUNK_BYTES_FLOOR // (2 * 512 * 4)  # fp32: two [C, V] buffers
    logits, target = torch.randn(64, 512), torch.randint(0, 512, (64,))
    small = scoring._prepare(logits, target, None, None, 1.0, False, None, None)
    assert small.chunk_rows == 64 and len(small.chunks()) == 1  # the logits/4 rule alone gave 8 rows
    g = 16 * floor_rows  # the fraction rule is above the floor here
    big = scoring._prepare(torch.empty(g, 512), torch.zeros(g, dtype=torch.long), None, None, 1.0, False, None, None)
    assert big.chunk_rows == g * 512 * 4 // 4 // (2 * 512 * 4) < g
    wide_v = 151_936
    wide = scoring._prepare(torch.empty(2048, wide_v), torch.zeros(2048, dtype=torch.long), None, None, 1.0, False, None, None)
    assert wide.chunk_rows == scoring_job.CHUNK_BYTES_CAP // (2 * wide_v * 4)
    explicit = scoring._prepare(logits, target, None, None, 1.0, False, None, 2 * 512 * 4 * 3)
    assert explicit.chunk_rows == 3  # an explicit chunk_bytes is taken as given


def test_support_loops_range_over_kept_entries_not_dense_rows():
    """The support loops take ranges of at most chunk_bytes / SUPPORT_ENTRY_BYTES kept entries, whole
    rows each (a row holding more is a range alone): at V = 151,936 the 65,536 kept entries of 2,048
    rows are one range where the dense loops would take 10."""
    from moe_replay.replay import scoring, scoring_job

    wide_v, g = 151_936, 2048
    target = torch.zeros(g, dtype=torch.long)
    sup = SupportCSR(torch.arange(0, 32 * (g + 1), 32), torch.arange(32).repeat(g), ids_distinct=True)
    wide = scoring._prepare(torch.empty(g, wide_v), target, None, sup, 1.0, False, None, None)
    assert len(wide.chunks()) == 10 and wide.support_chunks() == [(0, g)]

    sizes = [1, 3, 9, 2, 2, 1, 4]  # a budget of 4 entries: row 2 alone (9), the others packed up to 4
    off = torch.tensor([0, *np.cumsum(sizes)])
    ids = torch.cat([torch.arange(n) for n in sizes])
    job = scoring._prepare(torch.randn(len(sizes), 16), torch.zeros(len(sizes), dtype=torch.long), None,
                           SupportCSR(off, ids), 1.0, False, None, 4 * scoring_job.SUPPORT_ENTRY_BYTES)
    ranges = job.support_chunks()
    assert ranges == [(0, 2), (2, 3), (3, 5), (5, 6), (6, 7)]
    assert all(int(off[r1] - off[r0]) <= 4 or r1 - r0 == 1 for r0, r1 in ranges)


@pytest.mark.parametrize("with_support", [False, True])
def test_a_zero_upstream_gradient_gives_a_zero_gradient(with_support):
    """A loss that weights every scored token by 0 (a fully masked micro-batch) asks backward for no row:
    the gradient is zeros, with or without a support (without one there are no support ranges at all)."""
    logits, target, support, t_G = random_case(5, 6, 40, 4)
    x = logits.clone().requires_grad_(True)
    s = score_logits(x, target, support=support if with_support else None, temperature=t_G)
    (s.logprobs_G * 0).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("whole_every", [0, 5])
@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("rows", [False, True])
def test_host_reads_per_call_do_not_grow_with_rows_or_chunks(full, rows, whole_every):
    """A forward + backward reads the device a fixed number of times whatever G and however many
    chunks or support ranges the call takes (the checks read together, the loops planned from sizes
    the host knows): 2 reads for the checks, 1 for the finite check, 1 for the backward's plan. Rows
    kept whole among supported ones (whole_every) add the dense rows' index list, 2 reads a pass
    (nonzero, its host copy); a dense loop over rows_G one host copy of rows_G; several support
    ranges one host copy of the offsets. The CSR is hand-built (its ids are checked for duplicates) and the temperature a tensor
    (its unit-scale flag is read with the checks)."""
    counts, ops = {}, {}
    for g, chunk_bytes in ((16, None), (64, None), (256, 4096)):  # one range (twice); many dense chunks and support ranges
        logits, target, support, t_G = random_case(7, g, 64, 9, temps=(0.7, 1.0), whole_every=whole_every)
        support = SupportCSR(support.offsets_G1, support.ids_N, support.whole_G)  # hand-built: ids_distinct False
        x_XV = torch.cat([torch.zeros(3, 64, dtype=logits.dtype), logits]).requires_grad_(True)
        rows_G = torch.arange(g) + 3 if rows else None
        with HostReads() as reads:
            s = score_logits(x_XV if rows else x_XV[3:], target, rows_G=rows_G, support=support, temperature=t_G,
                             full=full, chunk_bytes=chunk_bytes, backend="torch_chunked")
            loss = s.logprobs_G.sum() + s.entropy_G.sum()
            if full:
                loss = loss + s.full_logprobs_G.sum() + s.full_entropy_G.sum()
            loss.backward()
        assert x_XV.grad is not None and bool(torch.isfinite(x_XV.grad).all())
        counts[g], ops[g] = dict(reads.reads), reads.ops
    assert ops[16] == ops[64], ops  # one range: the same ops at 4x the rows (a launch count that does not grow with G)
    partial = 2 * 2 if whole_every and not full else 0  # forward and backward each read the dense rows' list
    host_rows = 1 if rows and (full or whole_every) else 0  # a dense loop's slices of the logits, through rows_G
    assert sum(counts[16].values()) == 4 + partial + host_rows, counts
    others = lambda c: {k: v for k, v in c.items() if k != "numpy"}  # noqa: E731
    assert others(counts[256]) == others(counts[16]), counts  # the same reads, not more, at 16x the rows
    assert counts[256].get("numpy", 0) == counts[16].get("numpy", 0) + 1, counts  # + the offsets' host copy
    assert not any("bool mask" in k for c in counts.values() for k in c), counts


def test_checks_read_together_still_raise_the_first_bad_field():
    """The checks' flags come back in one read; the error is still the first failing check's, in the
    order the fields are checked (rows, targets, temperatures, offsets, then the kept ids)."""
    logits = torch.zeros(3, 10, dtype=torch.float64)
    sup = SupportCSR(torch.tensor([0, 1, 2, 3]), torch.tensor([1, 2, 30]))  # row 2 keeps id 30 of 10
    with pytest.raises(ScoringInputError, match=r"target_G\[row 0\]"):  # the target before the temperature
        score_logits(logits, torch.tensor([11, 2, 3]), support=sup, temperature=torch.tensor([1.0, -1.0, 1.0]))
    with pytest.raises(ScoringInputError, match=r"temperature\[row 1\].*-1.0"):  # before the kept ids
        score_logits(logits, torch.tensor([1, 2, 3]), support=sup, temperature=torch.tensor([1.0, -1.0, 1.0]))
    with pytest.raises(ScoringInputError, match=r"support.offsets_G1.*first 0, last 2"):
        score_logits(logits, torch.tensor([1, 2, 3]), support=SupportCSR(torch.tensor([0, 1, 3, 2]), torch.tensor([1, 2, 3])))
    with pytest.raises(ScoringInputError, match=r"support.ids_N\[row 2\].*found 30"):  # the id before the missing target
        score_logits(logits, torch.tensor([1, 2, 3]), support=sup)
    unsorted = SupportCSR(torch.tensor([0, 2, 3, 4]), torch.tensor([4, 1, 2, 3]))  # row 0 not ascending, but distinct
    s = score_logits(logits, torch.tensor([1, 2, 3]), support=unsorted)
    torch.testing.assert_close(s.logprobs_G, torch.tensor([-np.log(2), 0.0, 0.0], dtype=torch.float64))
    with pytest.raises(ScoringInputError, match=r"support\[row 1\].*sampled token 5"):  # cleared the duplicate flag, then the next check
        score_logits(logits, torch.tensor([1, 5, 3]), support=unsorted)
