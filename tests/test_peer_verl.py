"""verl's own rollout-correction test assertions, ported to `moe_replay.corrections` / `moe_replay.metrics`.

Source: volcengine/verl, tests/trainer/ppo/test_rollout_corr.py (the version that imports
`verl.trainer.ppo.rollout_corr_helper`, as installed here at 0.9.1). Each test names the verl test
function and the step of it whose assertion it ports. Inputs are verl's (seeded here, since verl's
test draws unseeded `torch.randn`); the mapping of verl's options to this project's corrections is
docs/corrections.md, "Porting from verl 0.9.1". `tests/test_verl_parity.py` compares numbers with the
installed helper; this file checks that verl's *own* expectations hold for this project.

Two of verl's expectations do not hold here, by this project's documented contract, and are kept
as strict xfails so a change of either side shows up:
  * verl leaves the IS weights of a rejected sequence nonzero (rejection lives in the response mask
    alone); `CorrectionResult.weights_BS` is 0 on rejected tokens (the raw ratio stays available
    in `log_ratio_BS`);
  * verl's IS summary keys (`rollout_corr/rollout_is_mean`, `_max`, `_min`, `_std`, ...) and
    `rollout_corr/rollout_rs_masked_fraction` are reported here under `moe_replay/corr/...`.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_replay.corrections import (
    GeoRSConfig,
    IcePopConfig,
    MISConfig,
    TISConfig,
    TokenVetoConfig,
    apply_corrections,
)
from moe_replay.metrics import logprob_mismatch_metrics

VERL_TEST = "volcengine/verl tests/trainer/ppo/test_rollout_corr.py"


def _bf16_like_batch(seed: int = 0, batch: int = 4, seq: int = 10, noise: float = 0.1):
    """verl's inputs: old ~ N(0, 1), rollout = old + noise * N(0, 1) (a bf16-vs-fp32 style gap)."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(batch, seq, generator=g)
    rollout = old + torch.randn(batch, seq, generator=g) * noise
    # both stay log-probabilities (the project refuses logprobs > 0): shift each row, keeping its ratios
    shift = torch.maximum(old, rollout).amax(-1, keepdim=True).clamp_min(0) + 0.01
    return old - shift, rollout - shift, torch.ones(batch, seq, dtype=torch.bool)


def _mask_mode_batch():
    """verl test_mask_mode: sequence 0 has ratio exp(-1) ~ 0.37, sequence 1 exp(0.5) ~ 1.65."""
    old = torch.tensor([[-2.0] * 5, [-2.0] * 5])
    rollout = torch.tensor([[-1.0] * 5, [-2.5] * 5])
    return old, rollout, torch.ones(2, 5, dtype=torch.bool)


# ------------------------------------------------------------------------ test_basic_rollout_correction


def test_token_level_truncation_caps_weights_at_the_threshold():
    """verl test_basic_rollout_correction, step 1 (rollout_is="token", rollout_is_threshold=2.0):
    the weights have the logprobs' shape and never exceed the threshold."""
    old, rollout, mask = _bf16_like_batch()
    res = apply_corrections([TISConfig(threshold=2.0)], old, rollout, mask)
    assert res.weights_BS.shape == old.shape
    assert float(res.weights_BS.max()) <= 2.0
    # below the cap the weight is the ratio itself (truncation, not clipping from below)
    ratio = torch.exp(old - rollout)
    below = ratio < 2.0
    torch.testing.assert_close(res.weights_BS[below], ratio[below], rtol=1e-6, atol=0)
    assert bool(res.keep_BS.all())  # truncate mode rejects nothing


def test_sequence_level_weights_are_one_per_sequence():
    """verl test_basic_rollout_correction, step 2 (rollout_is="sequence", threshold 5.0): every
    token of a sequence carries the same weight."""
    old, rollout, mask = _bf16_like_batch()
    res = apply_corrections([TISConfig(threshold=5.0, level="sequence")], old, rollout, mask)
    for i in range(old.shape[0]):
        row = res.weights_BS[i, mask[i].bool()]
        assert torch.allclose(row, row[0])
    assert float(res.weights_BS.max()) <= 5.0


def test_geometric_rejection_is_a_pure_mask_over_whole_sequences():
    """verl test_basic_rollout_correction, step 3 (rollout_is=None, rollout_rs="geometric", bounds
    [0.5, 1.5]): no IS weights, only a mask, and its masked-fraction metric. Here `geo_rs` alone
    leaves weight 1 on kept tokens; a sequence is kept or rejected as a whole."""
    old, rollout, mask = _bf16_like_batch(seed=1, noise=0.5)
    res = apply_corrections([GeoRSConfig(low=0.5, high=1.5)], old, rollout, mask)
    assert set(res.weights_BS[res.keep_BS].unique().tolist()) <= {1.0}
    assert bool((res.keep_BS.all(-1) | ~res.keep_BS.any(-1)).all())  # per sequence: all or nothing
    gm = torch.exp((old - rollout).mean(-1))
    torch.testing.assert_close(res.keep_BS.all(-1), (gm >= 0.5) & (gm <= 1.5))
    frac = res.metrics["moe_replay/corr/geo_rs/token_masked_fraction"]
    assert 0.0 <= frac <= 1.0 and frac == pytest.approx(1 - float(res.keep_BS.float().mean()))


def test_token_veto_rejects_the_sequence_through_the_mask():
    """verl test_basic_rollout_correction, step 4 (token IS at 2.0 + token veto at 1e-4): the
    sequence holding a token with ratio ~3e-7 is removed from the loss mask entirely, the other
    sequence keeps every token and its weights are those of truncation alone."""
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(2, 5, generator=g) - 20.0
    rollout = old.clone()
    rollout[0, 2] = old[0, 2] + 15.0
    mask = torch.ones(2, 5, dtype=torch.bool)
    res = apply_corrections([TISConfig(threshold=2.0), TokenVetoConfig(threshold=1e-4)], old, rollout, mask)
    assert int(res.keep_BS[0].sum()) == 0, "vetoed sequence leaves the loss mask"
    assert int(res.keep_BS[1].sum()) == 5, "the normal sequence keeps its mask"
    tis_only = apply_corrections([TISConfig(threshold=2.0)], old, rollout, mask)
    assert torch.equal(res.weights_BS[1], tis_only.weights_BS[1])
    assert res.metrics["moe_replay/corr/token_veto/seq_masked_fraction"] == pytest.approx(0.5)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "by contract CorrectionResult.weights_BS is 0 on rejected tokens; verl keeps the safety-bounded "
    "ratio in rollout_is_weights and rejects through the response mask only (asserts "
    "weights_veto[0].sum() > 0 and weights[0, :] > 0 for the rejected sequence). The ratio is kept "
    "here in log_ratio_BS"))
def test_rejected_sequences_keep_nonzero_is_weights():
    """verl test_basic_rollout_correction step 4 ("Weights should be non-zero (not zeroed by veto)")
    and test_mask_mode ("Weights should remain as safety-bounded ratios (not zeroed)")."""
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(2, 5, generator=g) - 20.0
    rollout = old.clone()
    rollout[0, 2] = old[0, 2] + 15.0
    veto = apply_corrections([TISConfig(threshold=2.0), TokenVetoConfig(threshold=1e-4)], old, rollout, torch.ones(2, 5, dtype=torch.bool))
    old_m, rollout_m, mask_m = _mask_mode_batch()
    masked = apply_corrections([TISConfig(threshold=2.0), MISConfig(level="token", threshold=2.0, low=0.5, weight=False)],
                               old_m, rollout_m, mask_m)
    assert float(veto.weights_BS[0].sum()) > 0
    assert bool((masked.weights_BS[0] > 0).all())


def test_no_correction_leaves_mask_and_still_reports_mismatch():
    """verl test_basic_rollout_correction, step 5 (rollout_is=None, rollout_rs=None): the mask
    comes back unchanged (verl: weights None; here: the neutral weight 1 on every response token)
    and the mismatch metrics are still computed."""
    old, rollout, mask = _bf16_like_batch()
    mask[1, 7:] = 0
    res = apply_corrections([], old, rollout, mask)
    assert torch.equal(res.keep_BS, mask.bool())
    assert torch.equal(res.weights_BS, mask)
    assert "rollout_corr/kl" in logprob_mismatch_metrics(old, rollout, mask)


# ------------------------------------------------------------------ test_metrics_completeness / mismatch

# verl 0.9.1's compute_offpolicy_metrics names; the test file spells the same quantities with a
# "mismatch_" prefix (mismatch_training_ppl, ...), the installed helper without it.
OFFPOLICY_KEYS = [
    "training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
    "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio",
]  # fmt: skip
IS_KEYS = [
    "rollout_is_mean", "rollout_is_max", "rollout_is_min", "rollout_is_std", "rollout_is_eff_sample_size",
    "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low",
]  # fmt: skip


def test_mismatch_metric_keys_are_all_present():
    """verl test_mismatch_metrics (and the mismatch half of test_metrics_completeness): all eleven
    mismatch metrics are returned, under `rollout_corr/` as verl's trainer logs them."""
    g = torch.Generator().manual_seed(3)
    old = torch.randn(4, 12, generator=g) - 2.0
    rollout = torch.randn(4, 12, generator=g) - 1.5
    old, rollout = old.clamp(max=-1e-3), rollout.clamp(max=-1e-3)
    m = logprob_mismatch_metrics(old, rollout, torch.ones(4, 12, dtype=torch.bool))
    missing = [k for k in OFFPOLICY_KEYS if f"rollout_corr/{k}" not in m]
    assert not missing, missing
    assert all(math.isfinite(m[f"rollout_corr/{k}"]) for k in OFFPOLICY_KEYS)
    # the weights actually applied give verl's ESS key
    w = apply_corrections([TISConfig(threshold=2.5)], old, rollout, torch.ones(4, 12, dtype=torch.bool)).weights_BS
    assert "rollout_corr/rollout_is_eff_sample_size" in logprob_mismatch_metrics(old, rollout, torch.ones(4, 12, dtype=torch.bool),
                                                                                 is_weights_BS=w)


def test_is_and_rejection_metric_keys_use_verls_names():
    """verl test_metrics_completeness (expected_is_metrics, rollout_is="token" at 2.5) and
    test_mask_mode ("Should have rollout_rs_masked_fraction metric")."""
    old, rollout, mask = _bf16_like_batch(noise=0.2, batch=3, seq=8)
    w = apply_corrections([TISConfig(threshold=2.5)], old, rollout, mask)
    metrics = {**w.metrics, **logprob_mismatch_metrics(old, rollout, mask, is_weights_BS=w.weights_BS)}
    om, rm, mm = _mask_mode_batch()
    rs = apply_corrections([MISConfig(level="token", threshold=2.0, low=0.5, weight=False)], om, rm, mm)
    missing = [k for k in IS_KEYS if f"rollout_corr/{k}" not in metrics]
    missing += [k for k in ["rollout_rs_masked_fraction"] if f"rollout_corr/{k}" not in rs.metrics]
    assert not missing, missing


# --------------------------------------------------------------------------------------- test_mask_mode


def test_mask_mode_rejects_via_mask_and_keeps_true_ratios():
    """verl test_mask_mode (token IS at 2.0 + token rejection in [0.5, 2.0]): sequence 0 (ratio
    0.368) is rejected through the mask, sequence 1 (ratio 1.649) is accepted with weight 1.649,
    half the tokens are masked; the true ratio of the rejected sequence is kept (here in
    `log_ratio_BS`, see the xfail above for the weights themselves)."""
    old, rollout, mask = _mask_mode_batch()
    res = apply_corrections([TISConfig(threshold=2.0), MISConfig(level="token", threshold=2.0, low=0.5, weight=False)],
                            old, rollout, mask)
    assert bool((res.keep_BS[0] == 0).all()), "first sequence rejected via the mask"
    assert bool((res.keep_BS[1] == 1).all()), "second sequence accepted"
    assert float(res.weights_BS[1, 0]) == pytest.approx(1.649, abs=0.01)
    assert float(torch.exp(res.log_ratio_BS[0, 0])) == pytest.approx(0.368, abs=0.01)
    assert res.metrics["moe_replay/corr/mis/token_masked_fraction"] == pytest.approx(0.5, abs=0.01)
    assert res.metrics["moe_replay/corr/token_masked_fraction"] == pytest.approx(0.5, abs=0.01)


def test_icepop_zeroes_out_of_band_weights_and_keeps_the_mask():
    """verl's IcePop (rollout_is="token", rollout_is_threshold="0.5_5.0"; rollout_corr_helper.
    compute_rollout_correction_weights: "lower_upper" zeroes weights outside [lower, upper] and
    leaves the response mask), on test_mask_mode's batch: sequence 0 (0.368 < 0.5) gets weight 0
    and stays in the loss denominator, sequence 1 keeps 1.649."""
    old, rollout, mask = _mask_mode_batch()
    res = apply_corrections([IcePopConfig(low=0.5, high=5.0)], old, rollout, mask)
    assert torch.equal(res.weights_BS[0], torch.zeros(5))
    torch.testing.assert_close(res.weights_BS[1], torch.full((5,), math.exp(0.5)))
    assert torch.equal(res.keep_BS, mask.bool())  # verl's response mask is unchanged
    assert res.metrics["moe_replay/corr/icepop/low_fraction"] == pytest.approx(0.5)
    assert res.metrics["moe_replay/corr/icepop/high_fraction"] == 0.0
