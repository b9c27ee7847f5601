"""Mismatch metrics against hand-computed numbers, masking semantics and numerical safety.

Base case (B=2, S=3, the last token of sequence 1 is padding):
    rollout probs  [[0.5, 0.8, 0.1], [0.4, 0.25, -]]
    train probs    [[1.0, 0.2, 0.1], [0.2, 0.5,  -]]
    ratios ρ = p_train / p_rollout = [[2, 0.25, 1], [0.5, 2, -]]
"""

from __future__ import annotations

import ast
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_replay import metrics as M
from moe_replay.metrics import (
    logprob_mismatch_metrics,
    mismatch_metrics,
    normalized_ess,
    route_flip_metrics,
    support_coverage_metrics,
)

LN2 = math.log(2.0)
NAN = float("nan")


def base_case(pad_value: float = NAN):
    rollout = torch.tensor([[0.5, 0.8, 0.1], [0.4, 0.25, 1.0]], dtype=torch.float64).log()
    train = torch.tensor([[1.0, 0.2, 0.1], [0.2, 0.5, 1.0]], dtype=torch.float64).log()
    rollout[1, 2] = pad_value
    train[1, 2] = pad_value
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()
    return train, rollout, mask


def approx(x, rel=1e-9, abs=1e-12):
    return pytest.approx(x, rel=rel, abs=abs)


# ----------------------------------------------------------------------------- logprob metrics


def test_logprob_metrics_hand_computed():
    train, rollout, mask = base_case()
    m = logprob_mismatch_metrics(train, rollout, mask)
    rho = [2.0, 0.25, 1.0, 0.5, 2.0]
    lr = [math.log(r) for r in rho]

    # k1 (verl's sign): mean of log π_rollout - log π_train = -mean(lr) = -log(0.5)/5
    assert m["rollout_corr/kl"] == approx(LN2 / 5)
    # k3: mean(ρ - 1 - lr) = (0.75 + ln 2) / 5
    assert m["rollout_corr/k3_kl"] == approx((0.75 + LN2) / 5)
    assert m["rollout_corr/k3_kl"] == approx(sum(r - 1 - l for r, l in zip(rho, lr)) / 5)
    # per-sequence ppl = (Π p)^(-1/n), then averaged over the 2 sequences
    assert m["rollout_corr/training_ppl"] == approx((0.02 ** (-1 / 3) + 0.1 ** (-1 / 2)) / 2)
    assert m["rollout_corr/rollout_ppl"] == approx((0.04 ** (-1 / 3) + 0.1 ** (-1 / 2)) / 2)
    assert m["rollout_corr/training_log_ppl"] == approx((-math.log(0.02) / 3 - math.log(0.1) / 2) / 2)
    assert m["rollout_corr/rollout_log_ppl"] == approx((-math.log(0.04) / 3 - math.log(0.1) / 2) / 2)
    # d = mean rollout lp - mean train lp per sequence = [ln2/3, 0]
    assert m["rollout_corr/log_ppl_diff"] == approx(LN2 / 6)
    assert m["rollout_corr/log_ppl_abs_diff"] == approx(LN2 / 6)
    assert m["rollout_corr/log_ppl_diff_max"] == approx(LN2 / 3)
    assert m["rollout_corr/log_ppl_diff_min"] == approx(0.0)
    assert m["rollout_corr/ppl_ratio"] == approx((2 ** (1 / 3) + 1) / 2)
    # chi2: mean ρ² - 1 = (4 + 1/16 + 1 + 1/4 + 4)/5 - 1
    assert m["rollout_corr/chi2_token"] == approx(0.8625)
    # sequence ratios Π ρ = [0.5, 1]: (0.25 + 1)/2 - 1
    assert m["rollout_corr/chi2_seq"] == approx(-0.375)
    # ESS = (Σw)² / (n Σw²)
    assert m["moe_replay/is_ess_token"] == approx(5.75**2 / (5 * 9.3125))
    assert m["moe_replay/is_ess_seq"] == approx(1.5**2 / (2 * 1.25))
    ess0 = 3.25**2 / (3 * (4 + 1 / 16 + 1))
    ess1 = 2.5**2 / (2 * (0.25 + 4))
    assert m["moe_replay/is_ess_token_per_seq"] == approx((ess0 + ess1) / 2)
    # |lr| sorted: 0, ln2, ln2, ln2, 2 ln2
    assert m["moe_replay/abs_logprob_diff_mean"] == approx(LN2)
    assert m["moe_replay/abs_logprob_diff_max"] == approx(2 * LN2)
    assert m["moe_replay/abs_logprob_diff_p50"] == approx(LN2)
    assert m["moe_replay/abs_logprob_diff_p90"] == approx(1.6 * LN2)  # position 3.6 of 0..4
    assert m["moe_replay/abs_logprob_diff_p99"] == approx(1.96 * LN2)
    p_train, p_rollout = [1.0, 0.2, 0.1, 0.2, 0.5], [0.5, 0.8, 0.1, 0.4, 0.25]
    assert m["moe_replay/prob_pearson"] == approx(statistics.correlation(p_train, p_rollout))
    assert m["moe_replay/response_tokens"] == 5
    assert m["moe_replay/nonfinite_token_fraction"] == 0.0


def test_quantiles_match_torch_quantile():
    x = torch.rand(1001, dtype=torch.float64)
    qs = (0.0, 0.13, 0.5, 0.9, 0.99, 1.0)
    assert torch.allclose(M._quantiles(x, qs), torch.quantile(x, torch.tensor(qs, dtype=torch.float64)))


def test_applied_is_weights_use_verl_ess():
    train, rollout, mask = base_case()
    w = torch.tensor([[1.5, 0.25, 1.0], [0.5, 1.5, 123.0]])  # TIS at 1.5; padding value ignored
    m = logprob_mismatch_metrics(train, rollout, mask, is_weights_BS=w)
    mean_w = 4.75 / 5
    expected = 1.0 / (sum((x / (mean_w + 1e-8)) ** 2 for x in (1.5, 0.25, 1.0, 0.5, 1.5)) / 5)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == approx(expected, rel=1e-7)


def test_padding_is_ignored_whatever_it_holds():
    ref = logprob_mismatch_metrics(*base_case(NAN))
    for pad in (0.0, -1e9, float("inf"), float("-inf")):
        got = logprob_mismatch_metrics(*base_case(pad))
        assert got.keys() == ref.keys()
        for k in ref:
            assert got[k] == approx(ref[k]), k


def test_bf16_and_float32_inputs_accepted():
    train, rollout, mask = base_case(0.0)
    ref = logprob_mismatch_metrics(train, rollout, mask)
    got = logprob_mismatch_metrics(train.float(), rollout.float(), mask.bool())
    assert got["rollout_corr/kl"] == pytest.approx(ref["rollout_corr/kl"], rel=1e-6)
    got16 = logprob_mismatch_metrics(train.bfloat16(), rollout.bfloat16(), mask)
    assert got16["rollout_corr/kl"] == pytest.approx(ref["rollout_corr/kl"], rel=0.1)


def test_nonfinite_tokens_are_excluded_and_counted():
    train, rollout, mask = base_case(0.0)
    train2 = torch.cat([train, torch.tensor([[float("-inf")], [0.0]], dtype=torch.float64)], 1)
    rollout2 = torch.cat([rollout, torch.tensor([[-1.0], [0.0]], dtype=torch.float64)], 1)
    mask2 = torch.cat([mask, torch.tensor([[True], [False]])], 1)
    m = logprob_mismatch_metrics(train2, rollout2, mask2)
    ref = logprob_mismatch_metrics(train, rollout, mask)
    assert m["moe_replay/nonfinite_token_fraction"] == approx(1 / 6)
    assert m["rollout_corr/kl"] == approx(ref["rollout_corr/kl"])
    assert m["moe_replay/response_tokens"] == 5


@pytest.mark.parametrize("side", ["train", "rollout"])
@pytest.mark.parametrize("value", [0.5, float("inf")])
def test_positive_logprobs_are_refused_by_position_and_value(side, value):
    """Probabilities, NLLs or logits passed as logprobs: refused, not measured."""
    train, rollout, mask = base_case(0.0)
    bad = train if side == "train" else rollout
    bad[1, 0] = value
    match = rf"{side}_logprobs_BS\[row 1, col 0\]': expected a logprob <= 0 .*found {value}"
    with pytest.raises(M.LogprobInputError, match=match) as e:
        logprob_mismatch_metrics(train, rollout, mask)
    assert (e.value.row, e.value.col) == (1, 0) and isinstance(e.value, ValueError)


def test_rounding_above_zero_and_anything_on_padding_are_accepted():
    train, rollout, mask = base_case(0.0)
    train[0, 0] = 0.5 * M.LOGPROB_TOL  # log p of a certain token, one float32 rounding above 0
    rollout[1, 2] = 3.0  # padding
    assert logprob_mismatch_metrics(train, rollout, mask)["moe_replay/response_tokens"] == 5


def test_every_response_token_non_finite_is_refused():
    """Nothing left to measure: a typed error naming the first position, not a quiet empty average."""
    train, rollout, mask = base_case(0.0)
    train.fill_(NAN)
    match = r"train_logprobs_BS\[row 0, col 0\]'.*at least one.*found nan.*all 5 response tokens"
    with pytest.raises(M.LogprobInputError, match=match):
        logprob_mismatch_metrics(train, rollout, mask)
    train, rollout, mask = base_case(0.0)
    rollout[mask.bool()] = float("-inf")
    with pytest.raises(M.LogprobInputError, match=r"rollout_logprobs_BS\[row 0, col 0\]'.*found -inf"):
        logprob_mismatch_metrics(train, rollout, mask)


def test_huge_log_ratios_stay_finite():
    g = torch.Generator().manual_seed(0)
    train = -torch.rand(4, 16, generator=g, dtype=torch.float64) * 3
    rollout = train.clone()
    rollout[0, :] = -1e4  # trainer vastly more confident: lr = +1e4
    rollout[1, :] = 0.0
    train[1, :] = -1e4  # trainer vastly less confident: lr = -1e4
    mask = torch.ones(4, 16, dtype=torch.bool)
    m = logprob_mismatch_metrics(train, rollout, mask)
    for k, v in m.items():
        assert math.isfinite(v), (k, v)
    assert m["rollout_corr/chi2_token"] > 1e10  # saturated at exp(2*20), not inf


def test_empty_mask_and_shape_errors():
    train, rollout, mask = base_case(0.0)
    with pytest.raises(ValueError, match="no token"):
        logprob_mismatch_metrics(train, rollout, torch.zeros_like(mask))
    with pytest.raises(ValueError, match=r"\[2, 2\]"):
        logprob_mismatch_metrics(train[:, :2], rollout, mask)
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        logprob_mismatch_metrics(train[0], rollout[0], mask[0])


def test_identical_policies_give_zero_mismatch():
    train = -torch.rand(3, 7, dtype=torch.float64)
    m = logprob_mismatch_metrics(train, train.clone(), torch.ones(3, 7, dtype=torch.bool))
    assert m["rollout_corr/kl"] == 0.0 and m["rollout_corr/k3_kl"] == 0.0
    assert m["rollout_corr/chi2_token"] == approx(0.0) and m["rollout_corr/chi2_seq"] == approx(0.0)
    assert m["rollout_corr/ppl_ratio"] == approx(1.0)
    assert m["moe_replay/is_ess_token"] == approx(1.0)
    assert m["moe_replay/prob_pearson"] == approx(1.0)


def test_normalized_ess_is_overflow_free():
    assert normalized_ess(torch.tensor([1000.0, 1000.0])).item() == approx(1.0)
    assert normalized_ess(torch.tensor([1000.0, 0.0, 0.0, 0.0])).item() == approx(0.25)
    assert math.isnan(normalized_ess(torch.tensor([1.0]), torch.tensor([False])).item())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-30, 0), min_size=6, max_size=6),
    st.lists(st.floats(-30, 0), min_size=6, max_size=6),
    st.lists(st.booleans(), min_size=6, max_size=6).filter(any),
)
def test_property_ess_in_unit_interval_and_padding_irrelevant(tl, rl, mk):
    train = torch.tensor(tl, dtype=torch.float64).reshape(2, 3)
    rollout = torch.tensor(rl, dtype=torch.float64).reshape(2, 3)
    mask = torch.tensor(mk).reshape(2, 3)
    m = logprob_mismatch_metrics(train, rollout, mask)
    assert 0.0 < m["moe_replay/is_ess_token"] <= 1.0 + 1e-9
    assert m["rollout_corr/k3_kl"] >= -1e-12
    assert m["moe_replay/abs_logprob_diff_p50"] <= m["moe_replay/abs_logprob_diff_p99"] + 1e-12
    garbage = torch.where(mask, train, torch.full_like(train, NAN))
    m2 = logprob_mismatch_metrics(garbage, torch.where(mask, rollout, torch.full_like(rollout, 7.0)), mask)
    for k in m:
        if not math.isnan(m[k]):
            assert m2[k] == approx(m[k]), k


# ----------------------------------------------------------------------------- route flips

# T=5 tokens, L=2 layers (global ids 3 and 7), K=2. Token 4 is masked out (and would flip).
TRAIN_ROUTES = torch.tensor(
    [
        [[1, 2], [3, 4]],  # t0: L3 same;             L7 {3,4} vs {3,9} flip, overlap 1/2
        [[2, 1], [3, 5]],  # t1: L3 same set, order;  L7 {3,5} vs {3,9} flip, overlap 1/2
        [[0, 1], [4, 3]],  # t2: L3 {0,1} vs {1,3} flip, overlap 1/2; L7 same set, order
        [[4, 5], [6, 7]],  # t3: identical
        [[1, 2], [1, 2]],  # t4: masked
    ]
)
TRACE_ROUTES = torch.tensor(
    [
        [[1, 2], [3, 9]],
        [[1, 2], [3, 9]],
        [[1, 3], [3, 4]],
        [[4, 5], [6, 7]],
        [[8, 9], [8, 9]],
    ]
)
ROUTE_MASK = torch.tensor([True, True, True, True, False])


def test_route_flip_hand_computed():
    m = route_flip_metrics(TRAIN_ROUTES, TRACE_ROUTES, ROUTE_MASK, layer_ids=[3, 7])
    assert m["moe_replay/route_flip_rate"] == approx(3 / 8)
    assert m["moe_replay/route_flip_token_rate"] == approx(3 / 4)
    assert m["moe_replay/route_order_mismatch_rate"] == approx(2 / 8)
    assert m["moe_replay/route_expert_overlap"] == approx(6.5 / 8)
    assert m["moe_replay/route_flip_rate/layer_3"] == approx(1 / 4)
    assert m["moe_replay/route_flip_rate/layer_7"] == approx(2 / 4)
    assert m["moe_replay/route_flip_rate_max_layer"] == approx(2 / 4)
    assert m["moe_replay/route_order_mismatch_rate/layer_3"] == approx(1 / 4)
    assert m["moe_replay/route_order_mismatch_rate/layer_7"] == approx(1 / 4)
    assert m["moe_replay/route_tokens"] == 4
    assert "moe_replay/route_flip_rate/layer_0" not in m


def test_route_flip_batched_shape_and_default_layer_ids():
    flat = route_flip_metrics(TRAIN_ROUTES, TRACE_ROUTES, ROUTE_MASK)
    batched = route_flip_metrics(TRAIN_ROUTES[None], TRACE_ROUTES[None], ROUTE_MASK[None])
    assert flat == batched
    assert flat["moe_replay/route_flip_rate/layer_1"] == approx(2 / 4)
    nomask = route_flip_metrics(TRAIN_ROUTES[:4], TRACE_ROUTES[:4])
    assert nomask["moe_replay/route_flip_rate"] == approx(3 / 8)


def test_route_flip_errors():
    with pytest.raises(ValueError, match="trace_routes shape"):
        route_flip_metrics(TRAIN_ROUTES, TRACE_ROUTES[:4])
    with pytest.raises(ValueError, match="layer_ids has 3"):
        route_flip_metrics(TRAIN_ROUTES, TRACE_ROUTES, layer_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="mask has shape"):
        route_flip_metrics(TRAIN_ROUTES, TRACE_ROUTES, ROUTE_MASK[:3])
    with pytest.raises(ValueError, match="no token"):
        route_flip_metrics(TRAIN_ROUTES, TRACE_ROUTES, torch.zeros(5, dtype=torch.bool))


# ----------------------------------------------------------------------------- support coverage

PROBS_TV = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
SUPPORT_TV = torch.tensor([[True, True, False, False], [False, False, False, True]])
OFFSETS_T1 = torch.tensor([0, 2, 3])
IDS_N = torch.tensor([0, 1, 3])


def test_support_coverage_hand_computed_bool_and_csr():
    logits = PROBS_TV.log() + 3.0  # unnormalised: the metric log-softmaxes
    expected = {
        "moe_replay/support_coverage_mean": (0.8 + 0.4) / 2,
        "moe_replay/support_coverage_min": 0.4,
        "moe_replay/support_neg_log_coverage_mean": -(math.log(0.8) + math.log(0.4)) / 2,
        "moe_replay/support_size_mean": 1.5,
    }
    by_mask = support_coverage_metrics(logits, support_TV=SUPPORT_TV)
    by_csr = support_coverage_metrics(logits, support_offsets_T1=OFFSETS_T1, support_ids_N=IDS_N.numpy())
    for k, v in expected.items():
        assert by_mask[k] == pytest.approx(v, rel=1e-6), k
        assert by_csr[k] == pytest.approx(v, rel=1e-6), k
    first = support_coverage_metrics(logits, support_TV=SUPPORT_TV, row_mask_T=torch.tensor([True, False]))
    assert first["moe_replay/support_coverage_mean"] == pytest.approx(0.8, rel=1e-6)


def test_support_coverage_chunked_csr_matches_mask(monkeypatch):
    monkeypatch.setattr(M, "_SUPPORT_CHUNK_ROWS", 3)
    g = torch.Generator().manual_seed(1)
    T, V = 10, 17
    logits = torch.randn(T, V, generator=g)
    keep = torch.rand(T, V, generator=g) < 0.3
    keep[4] = False  # an empty row: coverage 0
    sizes = keep.sum(-1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    ids = keep.nonzero()[:, 1]
    a = support_coverage_metrics(logits, support_TV=keep)
    b = support_coverage_metrics(logits, support_offsets_T1=offsets, support_ids_N=ids)
    assert a == pytest.approx(b, rel=1e-6)
    assert a["moe_replay/support_coverage_min"] == 0.0
    assert math.isfinite(a["moe_replay/support_neg_log_coverage_mean"])


def test_support_coverage_errors():
    with pytest.raises(ValueError, match="either support_TV"):
        support_coverage_metrics(PROBS_TV.log())
    with pytest.raises(ValueError, match="either support_TV"):
        support_coverage_metrics(
            PROBS_TV.log(), support_TV=SUPPORT_TV, support_offsets_T1=OFFSETS_T1, support_ids_N=IDS_N
        )
    with pytest.raises(ValueError, match=r"in \[0, 4\)"):
        support_coverage_metrics(PROBS_TV.log(), support_offsets_T1=OFFSETS_T1, support_ids_N=torch.tensor([0, 1, 9]))
    with pytest.raises(ValueError, match="rise from 0"):
        support_coverage_metrics(PROBS_TV.log(), support_offsets_T1=torch.tensor([0, 2, 2]), support_ids_N=IDS_N)
    with pytest.raises(ValueError, match="expected \\[2, 4\\]"):
        support_coverage_metrics(PROBS_TV.log(), support_TV=SUPPORT_TV[:, :3])


# ----------------------------------------------------------------------------- all in one


def test_mismatch_metrics_merges_everything():
    train, rollout, mask = base_case()
    m = mismatch_metrics(
        train,
        rollout,
        mask,
        train_routes=TRAIN_ROUTES,
        trace_routes=TRACE_ROUTES,
        route_mask=ROUTE_MASK,
        layer_ids=[3, 7],
        train_logits_TV=PROBS_TV.log(),
        support_TV=SUPPORT_TV,
    )
    verl_keys = {
        "rollout_corr/kl",
        "rollout_corr/k3_kl",
        "rollout_corr/training_ppl",
        "rollout_corr/training_log_ppl",
        "rollout_corr/rollout_ppl",
        "rollout_corr/rollout_log_ppl",
        "rollout_corr/log_ppl_diff",
        "rollout_corr/log_ppl_abs_diff",
        "rollout_corr/log_ppl_diff_max",
        "rollout_corr/log_ppl_diff_min",
        "rollout_corr/ppl_ratio",
        "rollout_corr/chi2_token",
        "rollout_corr/chi2_seq",
    }
    assert verl_keys <= m.keys()
    assert "rollout_corr/rollout_is_eff_sample_size" not in m  # only with the applied weights
    assert all(k.startswith(("rollout_corr/", "moe_replay/")) for k in m)
    assert all(isinstance(v, float) for v in m.values())
    assert m["moe_replay/route_flip_rate"] == approx(3 / 8)
    assert m["moe_replay/support_coverage_mean"] == pytest.approx(0.6, rel=1e-6)
    with pytest.raises(ValueError, match="both train_routes and trace_routes"):
        mismatch_metrics(train, rollout, mask, train_routes=TRAIN_ROUTES)


def test_core_modules_import_only_torch_numpy_stdlib():
    """The core rule: metrics and corrections import torch (+ numpy/stdlib, sibling modules) only."""
    root = Path(M.__file__).parent
    for name in ("metrics.py", "corrections.py", "kl_penalty.py"):
        tree = ast.parse((root / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level > 0:  # relative: a sibling core module
                    assert node.module in ("registry", "metrics", "errors"), (name, node.module)
                    continue
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                assert top in ("torch", "numpy") or top in sys.stdlib_module_names, (name, top)


# ----------------------------------------------------------------------------- issue 16 defects


def test_chi2_seq_is_not_saturated_at_exp20():
    """verl clamps Σ lr (not 2 Σ lr) at ±20 before exp(2·), so Σ lr = 15 gives e^30, not e^20."""
    train = torch.tensor([[5.0, 5.0, 5.0], [0.0, 0.0, 0.0], [0.0, 12.0, 13.0]], dtype=torch.float64) - 20.0
    rollout = torch.full((3, 3), -20.0, dtype=torch.float64)
    m = logprob_mismatch_metrics(train, rollout, torch.ones(3, 3, dtype=torch.bool))
    # Σ lr = [15, 0, 25]; the last one is clamped at 20 as verl's SAFETY_BOUND
    assert m["rollout_corr/chi2_seq"] == approx((math.exp(30) + 1 + math.exp(40)) / 3 - 1)


def test_k3_has_no_lower_dead_zone():
    """Only the exp of k3 = ρ - 1 - lr is clamped; lr = -30 reports ≈ 29, not the clamp's 19."""
    train = torch.tensor([[-31.0]], dtype=torch.float64)
    m = logprob_mismatch_metrics(train, torch.tensor([[-1.0]], dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool))
    assert m["rollout_corr/k3_kl"] == approx(math.exp(-30) - 1 + 30, rel=1e-8)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), 200.0, True])
def test_log_clamp_is_validated(bad):
    train, rollout, mask = base_case(0.0)
    with pytest.raises(ValueError, match=r"log_clamp must be .* got"):
        logprob_mismatch_metrics(train, rollout, mask, log_clamp=bad)


def test_ess_under_verls_key_only_for_applied_weights():
    """Without the applied weights the raw-ratio ESS has its own key; verl's key means applied weights."""
    train, rollout, mask = base_case()
    m = logprob_mismatch_metrics(train, rollout, mask)
    assert "rollout_corr/rollout_is_eff_sample_size" not in m
    assert m["moe_replay/is_ess_token"] == approx(5.75**2 / (5 * 9.3125))
    w = torch.tensor([[1.5, 0.25, 1.0], [0.5, 1.5, 0.0]])
    mw = logprob_mismatch_metrics(train, rollout, mask, is_weights_BS=w)
    assert mw["moe_replay/is_ess_token"] == m["moe_replay/is_ess_token"]
    assert "rollout_corr/rollout_is_eff_sample_size" in mw


@pytest.mark.parametrize("bad", [NAN, float("inf"), -0.5])
def test_bad_is_weights_are_refused(bad):
    train, rollout, mask = base_case()
    w = torch.tensor([[1.5, 0.25, 1.0], [0.5, bad, 0.0]])
    with pytest.raises(ValueError, match=r"is_weights_BS .* finite and >= 0 .* position \[1, 1\]"):
        logprob_mismatch_metrics(train, rollout, mask, is_weights_BS=w)
    w_pad = torch.tensor([[1.5, 0.25, 1.0], [0.5, 1.5, bad]])  # padding may hold anything
    logprob_mismatch_metrics(train, rollout, mask, is_weights_BS=w_pad)
