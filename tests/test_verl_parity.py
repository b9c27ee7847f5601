"""Parity with the real verl 0.9.1 ``rollout_corr_helper`` on identical tensors.

Random ragged batches (B=16 rows of up to S=256 tokens, two rows fully masked, 1% outlier tokens
with |lr| up to 12, and for the "extreme" batches 0.5% tokens with |lr| in [25, 60]), 5 seeds, in
float32 and float64. Every metric and correction mode both projects have is compared; where the
two differ on purpose the test pins the difference (docs/corrections.md, "Where we differ"):

* fully masked rows: verl averages them into its per-sequence metrics as "no mismatch"
  (mean logprob 0, ppl 1); the project leaves them out. So the project's batch equals verl's
  batch without those rows, and differs from verl's batch with them;
* k3_kl clamps exp at ±20 in the project (verl: unclamped, inf past lr ≈ 88 in float32);
* rejection on sequence statistics: verl clamps each token's log-ratio at ±20 before summing
  (while its sequence IS weight sums the raw ones); the project decides on the raw sum, so they
  can differ only on rows holding a token with |lr| > 20.
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
    apply_corrections,
)
from moe_replay.metrics import logprob_mismatch_metrics

# Installed by the project's `verl` extra (scripts/bootstrap.py); a missing verl is a failure,
# not a skip, so the parity cannot go quietly untested.
import verl.trainer.ppo.rollout_corr_helper as verl_rc  # noqa: E402

SEEDS = range(5)
DTYPES = [torch.float32, torch.float64]
EMPTY_ROWS = [3, 11]
OFFPOLICY_KEYS = [
    "kl", "k3_kl", "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
    "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq",
]  # fmt: skip


def ragged_batch(seed: int, dtype: torch.dtype, extreme: bool = False, B: int = 16, S: int = 256):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, S + 1, (B,), generator=g)
    lengths[EMPTY_ROWS] = 0
    mask = torch.arange(S)[None, :] < lengths[:, None]
    rollout = -torch.rand(B, S, generator=g, dtype=torch.float64) * 4 - 0.01
    lr = torch.randn(B, S, generator=g, dtype=torch.float64) * 0.2
    out = torch.rand(B, S, generator=g) < 0.01
    lr = torch.where(out, (torch.rand(B, S, generator=g, dtype=torch.float64) * 2 - 1) * 12, lr)
    if extreme:
        far = torch.rand(B, S, generator=g) < 0.005
        sign = torch.where(torch.rand(B, S, generator=g) < 0.5, -1.0, 1.0).double()
        lr = torch.where(far, sign * (25 + 35 * torch.rand(B, S, generator=g, dtype=torch.float64)), lr)
    rollout = rollout - lr.clamp(min=0)  # both sides stay log-probabilities (<= 0) at the same log-ratios
    train = rollout + lr
    return train.to(dtype), rollout.to(dtype), mask


def tol(dtype: torch.dtype) -> dict:
    # verl's masked means divide by (n + 1e-8) and it reduces in the input dtype; the project
    # reduces in float64
    return {"rel": 1e-7, "abs": 1e-9} if dtype == torch.float64 else {"rel": 2e-5, "abs": 1e-6}


def rows(*ts: torch.Tensor, keep: torch.Tensor) -> list[torch.Tensor]:
    return [t[keep] for t in ts]


def big_token_rows(train, rollout, mask) -> torch.Tensor:
    return (((train - rollout).abs() > 20) & mask).any(-1)


# ----------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_offpolicy_metrics_match_verl(seed, dtype):
    train, rollout, mask = ragged_batch(seed, dtype)
    ours = logprob_mismatch_metrics(train, rollout, mask)
    nonempty = mask.any(-1)
    t, r, m = rows(train, rollout, mask, keep=nonempty)
    verl = verl_rc.compute_offpolicy_metrics(t, r, m.to(dtype))
    assert set(OFFPOLICY_KEYS) == set(verl)
    for k in OFFPOLICY_KEYS:
        assert ours[f"rollout_corr/{k}"] == pytest.approx(verl[k], **tol(dtype)), k
    # with the empty rows, verl counts them as "no mismatch" (ppl 1, log-ppl diff 0)
    verl_all = verl_rc.compute_offpolicy_metrics(train, rollout, mask.to(dtype))
    n, n_ok = len(mask), int(nonempty.sum())
    assert verl_all["log_ppl_abs_diff"] == pytest.approx(verl["log_ppl_abs_diff"] * n_ok / n, **tol(dtype))
    assert verl_all["rollout_ppl"] == pytest.approx((verl["rollout_ppl"] * n_ok + (n - n_ok)) / n, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_extreme_ratios_metrics(seed, dtype):
    train, rollout, mask = ragged_batch(seed, dtype, extreme=True)
    ours = logprob_mismatch_metrics(train, rollout, mask)
    nonempty = mask.any(-1)
    verl = verl_rc.compute_offpolicy_metrics(*rows(train, rollout, mask.to(dtype), keep=nonempty))
    for k in ("kl", "training_log_ppl", "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff", "chi2_token", "chi2_seq"):
        assert ours[f"rollout_corr/{k}"] == pytest.approx(verl[k], **tol(dtype)), k
    # k3 on purpose: exp clamped at +20 (finite), verl's is the unclamped exp (e^60 here)
    assert math.isfinite(ours["rollout_corr/k3_kl"]) and ours["rollout_corr/k3_kl"] < verl["k3_kl"]
    assert all(math.isfinite(v) for v in ours.values() if not math.isnan(v))


# ----------------------------------------------------------------------------- IS weights


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_weights_and_ess_match_verl(seed, dtype, level):
    train, rollout, mask = ragged_batch(seed, dtype, extreme=True)
    w_verl, m_verl = verl_rc.compute_rollout_correction_weights(train - rollout, mask.to(dtype), level, 2.0)
    ours = apply_corrections([TISConfig(threshold=2.0, level=level)], train, rollout, mask)
    torch.testing.assert_close(ours.weights_BS, w_verl.float(), rtol=1e-6, atol=0)
    assert torch.equal(ours.keep_BS, mask)
    ess = logprob_mismatch_metrics(train, rollout, mask, is_weights_BS=w_verl)
    assert ess["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(m_verl["rollout_is_eff_sample_size"], **tol(dtype))
    if level == "token":  # verl's sequence-level max/min are of the unclamped sequence ratios, not the weights
        for k in ("rollout_is_mean", "rollout_is_max", "rollout_is_min", "rollout_is_std"):
            assert ess[f"rollout_corr/{k}"] == pytest.approx(m_verl[k], **tol(dtype)), k
        for k in ("rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low"):
            assert ours.metrics[f"rollout_corr/{k}"] == pytest.approx(m_verl[k], rel=1e-6, abs=1e-9), k
    assert ours.metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0  # TIS truncates, rejects nothing


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_icepop_matches_verl_lo_hi_is_threshold(seed, dtype):
    """verl's ``rollout_is_threshold="lo_hi"`` bounds π_train/π_rollout (no inversion) and keeps
    out-of-band tokens in the response mask with weight 0: the project's default normaliser."""
    train, rollout, mask = ragged_batch(seed, dtype, extreme=True)
    w_verl, m_verl = verl_rc.compute_rollout_correction_weights(train - rollout, mask.to(dtype), "token", "0.5_5.0")
    ours = apply_corrections([IcePopConfig(low=0.5, high=5.0)], train, rollout, mask)
    torch.testing.assert_close(ours.weights_BS, w_verl.float(), rtol=1e-6, atol=0)
    assert torch.equal(ours.keep_BS, mask)  # every response token stays in the denominator
    oob = ours.metrics["moe_replay/corr/icepop/low_fraction"] + ours.metrics["moe_replay/corr/icepop/high_fraction"]
    assert oob == pytest.approx(m_verl["rollout_is_oob_ratio"], rel=1e-6)
    assert oob > 0.004  # the batch does exercise the band
    ess = logprob_mismatch_metrics(train, rollout, mask, is_weights_BS=w_verl)
    assert ess["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(m_verl["rollout_is_eff_sample_size"], **tol(dtype))


# ----------------------------------------------------------------------------- rejection (k1 "lo_hi" = π_rollout/π_train)


def verl_mask(train, rollout, mask, rs: str, threshold: str) -> tuple[torch.Tensor, dict]:
    dtype = train.dtype
    new_mask, metrics = verl_rc.compute_rollout_rejection_mask(train - rollout, mask.to(dtype), rs, threshold)
    return new_mask.bool(), metrics


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_token_k1_lo_hi_is_icepop_with_inverted_bounds(seed, dtype):
    train, rollout, mask = ragged_batch(seed, dtype, extreme=True)
    lo, hi = 0.6, 1.8  # asymmetric, so an un-inverted port would show
    v_mask, v_metrics = verl_mask(train, rollout, mask, "token_k1", f"{lo}_{hi}")
    port = IcePopConfig(low=1 / hi, high=1 / lo, weight=False, rejected="drop")
    ours = apply_corrections([port], train, rollout, mask)
    assert torch.equal(ours.keep_BS, v_mask)
    assert ours.metrics["moe_replay/corr/token_masked_fraction"] == pytest.approx(v_metrics["rollout_rs_masked_fraction"], rel=1e-6)
    assert ours.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(v_metrics["rollout_rs_masked_fraction"], rel=1e-6)
    naive = apply_corrections([IcePopConfig(low=lo, high=hi, weight=False, rejected="drop")], train, rollout, mask)
    assert not torch.equal(naive.keep_BS, v_mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("extreme", [False, True])
def test_seq_mean_k1_is_geo_rs_with_inverted_bounds(seed, dtype, extreme):
    train, rollout, mask = ragged_batch(seed, dtype, extreme=extreme)
    lo, hi = 0.97, 1.05
    v_mask, _ = verl_mask(train, rollout, mask, "seq_mean_k1", f"{lo}_{hi}")
    ours = apply_corrections([GeoRSConfig(low=1 / hi, high=1 / lo)], train, rollout, mask)
    same = ~big_token_rows(train, rollout, mask)  # verl clamps tokens at ±20 before averaging
    assert torch.equal(ours.keep_BS[same], v_mask[same])
    assert 0 < int(ours.keep_BS.any(-1).sum()) < int(mask.any(-1).sum())  # both outcomes occur


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_seq_mis_preset_is_two_sided_mis(seed, dtype):
    """verl's Seq-MIS (``decoupled_seq_is_rs``: sequence IS at 2 + ``seq_sum_k1`` at "0.5_2.0")
    equals ``mis`` with ``low``; the one-sided ``mis`` keeps the Π ρ < 0.5 rows."""
    train, rollout, mask = ragged_batch(seed, dtype)
    cfg = verl_rc.RolloutCorrectionConfig.decoupled_seq_is_rs()
    v_w, v_mask, _ = verl_rc.compute_rollout_correction_and_rejection_mask(
        train, rollout, mask.to(dtype), rollout_is=cfg.rollout_is, rollout_is_threshold=cfg.rollout_is_threshold,
        rollout_rs=cfg.rollout_rs, rollout_rs_threshold=cfg.rollout_rs_threshold,
    )  # fmt: skip
    v_mask = v_mask.bool()
    ours = apply_corrections([MISConfig(threshold=2.0, low=0.5)], train, rollout, mask)
    assert torch.equal(ours.keep_BS, v_mask)
    effective = v_w.batch["rollout_is_weights"] * v_mask  # verl weights rejected rows, then masks them
    torch.testing.assert_close(ours.weights_BS, effective.float(), rtol=1e-6, atol=0)
    one_sided = apply_corrections([MISConfig(threshold=2.0)], train, rollout, mask)
    assert (one_sided.keep_BS & ~v_mask).any()


# ----------------------------------------------------------------------------- composition order


@pytest.mark.parametrize("dtype", DTYPES)
def test_order_geo_rs_then_icepop_equals_verl_and_the_reverse_does_not(dtype):
    """verl computes the IS weights and the RS mask independently, each over every response token:
    ``[geo_rs, icepop]`` reproduces that; ``[icepop, geo_rs]`` averages over in-band tokens only."""
    lo, hi = 0.97, 1.05
    reverse_differs = 0
    for seed in SEEDS:
        train, rollout, mask = ragged_batch(seed, dtype)
        v_w, v_mask, _ = verl_rc.compute_rollout_correction_and_rejection_mask(
            train, rollout, mask.to(dtype), rollout_is="token", rollout_is_threshold="0.5_5.0",
            rollout_rs="seq_mean_k1", rollout_rs_threshold=f"{lo}_{hi}",
        )  # fmt: skip
        v_mask = v_mask.bool()
        geo, ice = GeoRSConfig(low=1 / hi, high=1 / lo), IcePopConfig(low=0.5, high=5.0)
        ours = apply_corrections([geo, ice], train, rollout, mask)
        assert torch.equal(ours.keep_BS, v_mask)
        torch.testing.assert_close(ours.weights_BS, (v_w.batch["rollout_is_weights"] * v_mask).float(), rtol=1e-6, atol=0)
        reverse = apply_corrections([ice, geo], train, rollout, mask)
        reverse_differs += int((reverse.keep_BS != v_mask).any(-1).sum())
    assert reverse_differs > 0


# ----------------------------------------------------------------------------- the install itself


def test_verl_install_keeps_the_project_pins_and_stays_on_cpu():
    """verl comes in with --no-deps (its metadata pins transformers<5.11): what it needs is the
    `verl` extra's pins, the project's own pins still hold, and its import starts no CUDA."""
    import subprocess
    import sys
    import sysconfig
    import tomllib
    from importlib.metadata import version
    from pathlib import Path

    from packaging.requirements import Requirement

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("verl", "hf", "megatron"):
        for req in map(Requirement, extras[name]):
            assert req.specifier.contains(version(req.name), prereleases=True), (name, str(req), version(req.name))
    assert not Path(sysconfig.get_paths()["purelib"], "tests", "__init__.py").exists()  # verl's stray package
    code = (
        "import sys, torch, verl.trainer.ppo.rollout_corr_helper\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'nvidia', 'triton', 'wandb', 'datasets'))\n"
        "print(torch.cuda.is_initialized(), bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False []"
