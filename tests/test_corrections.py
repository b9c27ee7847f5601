"""Off-policy corrections against hand-computed cases, composition, masking, detachment, errors.

Base case (B=2, S=3; the last token of sequence 1 is padding), as ratios ρ = π_train / π_rollout:
    seq 0: [2.0, 0.25, 1.0]    Π ρ = 0.5   geometric mean 0.5^(1/3) ≈ 0.794   mean(-lr) = ln2/3
    seq 1: [1.0, 4.0,  pad]    Π ρ = 4     geometric mean 2                   mean(-lr) = -ln2
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_replay.corrections import (
    CORRECTIONS,
    CorrectionConfig,
    BatchSkipConfig,
    GeoRSConfig,
    GSPOConfig,
    IcePopConfig,
    MISConfig,
    OPSMConfig,
    TISConfig,
    TokenVetoConfig,
    aggregate_loss,
    apply_corrections,
    build_correction,
    masked_mean,
    register_correction,
    reinforce_loss,
)
from moe_replay.errors import RegistryError
from moe_replay.metrics import LogprobInputError

NAN = float("nan")
MASK = torch.tensor([[True, True, True], [True, True, False]])


def base_case(pad: float = NAN, requires_grad: bool = False):
    ratios = torch.tensor([[2.0, 0.25, 1.0], [1.0, 4.0, 1.0]])
    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -3.0, 0.0]])
    train = rollout + ratios.log()
    train[1, 2] = pad
    rollout[1, 2] = pad
    return train.requires_grad_(requires_grad), rollout


def run(corrections, pad=NAN, **kw):
    train, rollout = base_case(pad)
    return apply_corrections(corrections, train, rollout, MASK, **kw)


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-5, atol=1e-6)


def keep_of(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


# ----------------------------------------------------------------------------- each correction


def test_no_corrections_is_identity_on_response_tokens():
    r = run([])
    close(r.weights_BS, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert torch.equal(r.keep_BS, MASK.bool())
    assert r.metrics["moe_replay/corr/token_masked_fraction"] == 0.0
    assert r.metrics["moe_replay/corr/kept_tokens"] == 5


def test_tis_token():
    r = run([TISConfig(threshold=1.5)])
    close(r.weights_BS, [[1.5, 0.25, 1.0], [1.0, 1.5, 0.0]])  # min(ρ, 1.5)
    assert torch.equal(r.keep_BS, MASK.bool())
    assert r.metrics["moe_replay/corr/tis/truncated_fraction"] == pytest.approx(2 / 5)
    assert r.metrics["moe_replay/corr/weight_max"] == pytest.approx(1.5)
    assert r.metrics["moe_replay/corr/weight_mean"] == pytest.approx(5.25 / 5)
    assert r.metrics["moe_replay/corr/weight_ess"] == pytest.approx(5.25**2 / (5 * (2.25 + 0.0625 + 1 + 1 + 2.25)))


def test_tis_sequence():
    r = run([TISConfig(threshold=1.5, level="sequence")])
    close(r.weights_BS, [[0.5, 0.5, 0.5], [1.5, 1.5, 0.0]])  # min(Π ρ, 1.5) = [0.5, 1.5]
    assert r.metrics["moe_replay/corr/tis/truncated_fraction"] == pytest.approx(1 / 2)


def test_mis_sequence_masks_whole_sequence_and_keeps_ratio():
    r = run([MISConfig(threshold=2.0)])
    assert torch.equal(r.keep_BS, keep_of([[1, 1, 1], [0, 0, 0]]))  # Π ρ = 4 > 2 rejects seq 1
    close(r.weights_BS, [[0.5, 0.5, 0.5], [0.0, 0.0, 0.0]])
    assert r.metrics["moe_replay/corr/mis/token_masked_fraction"] == pytest.approx(2 / 5)
    assert r.metrics["moe_replay/corr/mis/seq_masked_fraction"] == pytest.approx(1 / 2)
    assert r.metrics["moe_replay/corr/seq_rejected_fraction"] == pytest.approx(1 / 2)
    pure = run([MISConfig(threshold=2.0, weight=False)])
    close(pure.weights_BS, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])


def test_mis_token():
    r = run([MISConfig(threshold=1.5, level="token")])
    assert torch.equal(r.keep_BS, keep_of([[0, 1, 1], [1, 0, 0]]))  # 2.0 and 4.0 exceed 1.5
    close(r.weights_BS, [[0.0, 0.25, 1.0], [1.0, 0.0, 0.0]])


def test_icepop_default_bounds():
    r = run([IcePopConfig(rejected="drop")])  # [0.5, 5]: only 0.25 is out
    assert torch.equal(r.keep_BS, keep_of([[1, 0, 1], [1, 1, 0]]))
    close(r.weights_BS, [[2.0, 0.0, 1.0], [1.0, 4.0, 0.0]])
    assert r.metrics["moe_replay/corr/icepop/low_fraction"] == pytest.approx(1 / 5)
    assert r.metrics["moe_replay/corr/icepop/high_fraction"] == 0.0
    assert r.metrics["moe_replay/corr/icepop/token_masked_fraction"] == pytest.approx(1 / 5)
    assert r.metrics["moe_replay/corr/icepop/seq_masked_fraction"] == pytest.approx(1 / 2)


def test_icepop_tight_bounds_and_pure_rejection():
    r = run([IcePopConfig(low=0.5, high=3.0, weight=False, rejected="drop")])
    assert torch.equal(r.keep_BS, keep_of([[1, 0, 1], [1, 0, 0]]))
    close(r.weights_BS, [[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert r.metrics["moe_replay/corr/icepop/high_fraction"] == pytest.approx(1 / 5)


def test_opsm_needs_negative_advantage_and_drift():
    # mean(-lr) = [ln2/3 ≈ 0.231, -ln2]
    r = run([OPSMConfig(delta=0.1)], advantages=torch.tensor([-1.0, -1.0]))
    assert torch.equal(r.keep_BS, keep_of([[0, 0, 0], [1, 1, 0]]))
    close(r.weights_BS, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])  # pure masking, no weight
    positive = run([OPSMConfig(delta=0.1)], advantages=torch.tensor([1.0, -1.0]))
    assert torch.equal(positive.keep_BS, MASK.bool())
    loose = run([OPSMConfig(delta=0.3)], advantages=torch.tensor([-1.0, -1.0]))
    assert torch.equal(loose.keep_BS, MASK.bool())
    # [B, S] advantages (GRPO broadcast) reduce to the per-sequence value
    per_token = run([OPSMConfig(delta=0.1)], advantages=torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, 99.0]]))
    assert torch.equal(per_token.keep_BS, r.keep_BS)


def test_opsm_without_advantages_fails():
    with pytest.raises(ValueError, match="needs advantages"):
        run(["opsm"])
    with pytest.raises(ValueError, match=r"advantages must be \[B\]"):
        run(["opsm"], advantages=torch.zeros(3))


def test_gspo_sequence_ratio():
    r = run([GSPOConfig()])
    g0 = 0.5 ** (1 / 3)
    close(r.weights_BS, [[g0, g0, g0], [2.0, 2.0, 0.0]])  # exp(mean lr) = (Π ρ)^(1/|y|)
    capped = run([GSPOConfig(max_weight=1.5)])
    close(capped.weights_BS, [[g0, g0, g0], [1.5, 1.5, 0.0]])
    assert torch.equal(r.keep_BS, MASK.bool())


def test_geo_rs():
    both = run([GeoRSConfig(low=0.8, high=1.5)])  # 0.794 < 0.8 and 2 > 1.5
    assert not both.keep_BS.any()
    assert both.metrics["moe_replay/corr/geo_rs/low_fraction"] == pytest.approx(1 / 2)
    assert both.metrics["moe_replay/corr/geo_rs/high_fraction"] == pytest.approx(1 / 2)
    assert both.metrics["moe_replay/corr/seq_rejected_fraction"] == 1.0
    assert both.metrics["moe_replay/corr/weight_mean"] == 0.0
    assert run([GeoRSConfig(low=0.7, high=2.5)]).keep_BS.equal(MASK.bool())
    one = run([GeoRSConfig(low=0.7, high=1.5)])
    assert torch.equal(one.keep_BS, keep_of([[1, 1, 1], [0, 0, 0]]))
    close(one.weights_BS, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])


def test_token_veto():
    r = run([TokenVetoConfig(threshold=0.3)])  # ρ = 0.25 < 0.3 vetoes all of seq 0
    assert torch.equal(r.keep_BS, keep_of([[0, 0, 0], [1, 1, 0]]))
    assert run([TokenVetoConfig(threshold=0.2)]).keep_BS.equal(MASK.bool())


def test_veto_ignores_padding_even_when_padding_looks_vetoable():
    train, rollout = base_case(pad=0.0)
    train = train.detach().clone()
    train[1, 2] = -50.0  # padding with ρ = e^-50 must not veto seq 1
    r = apply_corrections([TokenVetoConfig(threshold=0.2)], train, rollout, MASK)
    assert torch.equal(r.keep_BS, MASK.bool())


# ----------------------------------------------------------------------------- composition


def test_composition_order_matters_icepop_then_veto():
    icepop = IcePopConfig(weight=False, rejected="drop")
    veto = TokenVetoConfig(threshold=0.3)
    first = run([icepop, veto])  # IcePop removes the 0.25 token; the veto no longer sees it
    assert torch.equal(first.keep_BS, keep_of([[1, 0, 1], [1, 1, 0]]))
    assert first.metrics["moe_replay/corr/token_veto/token_masked_fraction"] == 0.0
    second = run([veto, icepop])  # the veto fires first and takes the whole sequence
    assert torch.equal(second.keep_BS, keep_of([[0, 0, 0], [1, 1, 0]]))
    assert second.metrics["moe_replay/corr/token_veto/token_masked_fraction"] == pytest.approx(3 / 5)
    assert second.metrics["moe_replay/corr/icepop/token_masked_fraction"] == 0.0


def test_composition_sequence_stats_use_surviving_tokens():
    r = run([IcePopConfig(weight=False), GSPOConfig()])  # zero-weighted tokens leave the statistics too
    s0 = math.sqrt(2.0)  # seq 0 after IcePop keeps ρ = [2, 1]: exp(mean log) = √2
    close(r.weights_BS, [[s0, 0.0, s0], [2.0, 2.0, 0.0]])
    reverse = run([GSPOConfig(), IcePopConfig(weight=False)])
    g0 = 0.5 ** (1 / 3)
    close(reverse.weights_BS, [[g0, 0.0, g0], [2.0, 2.0, 0.0]])


def test_composition_weights_multiply_masks_and():
    r = run([TISConfig(threshold=3.0), MISConfig(threshold=2.0, weight=False), IcePopConfig(low=0.5, high=5.0, rejected="drop")])
    # TIS: [2, .25, 1 | 1, 3]; MIS rejects seq 1 (Π ρ = 4); IcePop rejects .25 and multiplies by ρ
    assert torch.equal(r.keep_BS, keep_of([[1, 0, 1], [0, 0, 0]]))
    close(r.weights_BS, [[4.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    assert r.metrics["moe_replay/corr/token_masked_fraction"] == pytest.approx(3 / 5)
    assert r.metrics["moe_replay/corr/seq_masked_fraction"] == 1.0


def test_build_from_names_and_mappings_and_duplicate_keys():
    r = run(["tis", {"name": "icepop", "low": 0.3, "high": 3.0}, {"name": "icepop", "low": 0.5, "high": 5.0}])
    assert "moe_replay/corr/icepop/low_fraction" in r.metrics
    assert "moe_replay/corr/icepop.2/low_fraction" in r.metrics
    assert build_correction("gspo") == GSPOConfig()
    assert build_correction({"name": "geo_rs", "low": 0.9, "high": 1.1}) == GeoRSConfig(low=0.9, high=1.1)


# ----------------------------------------------------------------------------- losses and denominators


def test_masked_mean_and_aggregation_denominators_count_kept_only():
    loss = torch.tensor([[1.0, 2.0, 3.0], [6.0, 5.0, NAN]])
    keep = keep_of([[1, 0, 1], [1, 0, 0]])
    assert aggregate_loss(loss, keep, "token-mean").item() == pytest.approx(10 / 3)  # (1+3+6)/3
    assert aggregate_loss(loss, keep, "seq-mean-token-mean").item() == pytest.approx(4.0)  # (2 + 6)/2
    assert aggregate_loss(loss, keep, "seq-mean-token-sum").item() == pytest.approx(5.0)  # (4 + 6)/2
    # a fully rejected sequence drops out of the sequence denominator
    keep2 = keep_of([[0, 0, 0], [1, 1, 0]])
    assert aggregate_loss(loss, keep2, "seq-mean-token-mean").item() == pytest.approx(5.5)
    assert masked_mean(loss, torch.zeros(2, 3, dtype=torch.bool)).item() == 0.0
    close(masked_mean(loss, keep, dim=-1), [2.0, 6.0])
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'sum'"):
        aggregate_loss(loss, keep, "sum")


def test_weights_are_detached_and_gradient_flows_only_through_policy_logprobs():
    train, rollout = base_case(pad=0.0, requires_grad=True)
    r = apply_corrections([IcePopConfig(rejected="drop")], train, rollout, MASK)
    assert not r.weights_BS.requires_grad
    assert r.weights_BS.grad_fn is None
    adv = torch.tensor([1.0, -2.0])
    # the same tensor is the policy: if weights carried grad, d(w·logπ) would add a w·logπ term
    loss = reinforce_loss(train, adv, r)
    loss.backward()
    w = torch.tensor([[2.0, 0.0, 1.0], [1.0, 4.0, 0.0]])
    a = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    expected_grad = -(w * a) * r.keep_BS / 4  # 4 kept tokens in the denominator
    close(train.grad, expected_grad.tolist())


def test_reinforce_loss_value_uses_kept_denominator():
    train, rollout = base_case(pad=0.0)
    r = apply_corrections([IcePopConfig(weight=False, rejected="drop")], train, rollout, MASK)
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, NAN]])
    # -(1·-1 + 1·-3 + 1·-4 + 1·-5) / 4 with advantages 1
    assert reinforce_loss(lp, torch.ones(2), r).item() == pytest.approx(13 / 4)


# ----------------------------------------------------------------------------- numerical safety


def test_huge_and_infinite_log_ratios_stay_finite():
    rollout = torch.tensor([[0.0, -1e4, -1.0, float("-inf")], [-1.0, 0.0, -1.0, -1.0]])
    train = torch.tensor([[-1e4, 0.0, float("-inf"), -1.0], [-1.0, 0.0, -1.0, -1.0]])
    mask = torch.ones(2, 4, dtype=torch.bool)
    singles = (["tis"], ["mis"], ["icepop"], ["gspo"], ["geo_rs"], ["token_veto"])
    for corr in (*singles, [{"name": "tis", "level": "sequence"}]):
        r = apply_corrections(corr, train, rollout, mask)
        assert torch.isfinite(r.weights_BS).all(), corr
        assert all(math.isfinite(v) for v in r.metrics.values()), (corr, r.metrics)
    gspo = apply_corrections(["gspo"], train, rollout, mask)
    assert gspo.weights_BS.max() <= math.exp(20) * 1.0001
    veto = apply_corrections(["token_veto"], train, rollout, mask)
    assert not veto.keep_BS[0].any() and veto.keep_BS[1].all()


def test_nan_log_ratio_is_rejected_and_counted():
    train = torch.tensor([[float("-inf"), -1.0, NAN]])
    rollout = torch.tensor([[float("-inf"), -1.0, -1.0]])
    r = apply_corrections([], train, rollout, torch.ones(1, 3, dtype=torch.bool))
    assert torch.equal(r.keep_BS, keep_of([[0, 1, 0]]))
    assert r.metrics["moe_replay/corr/nonfinite_token_fraction"] == pytest.approx(2 / 3)
    assert torch.isfinite(r.weights_BS).all()


# ----------------------------------------------------------------------------- registry and configs


def test_registry_lists_all_corrections():
    assert CORRECTIONS.names() == ["batch_skip", "geo_rs", "gspo", "icepop", "mis", "opsm", "tis", "token_veto"]
    assert TISConfig.name == "tis" and TokenVetoConfig.name == "token_veto"


def test_registry_second_registration_fails():
    with pytest.raises(RegistryError, match="'tis' is already registered"):

        @register_correction("tis")
        @dataclasses.dataclass(frozen=True)
        class Another(CorrectionConfig):
            pass


def test_registry_miss_lists_supported_names():
    supported = "batch_skip, geo_rs, gspo, icepop, mis, opsm, tis, token_veto"
    with pytest.raises(RegistryError, match=f"unknown correction 'tiss'; supported: {supported}"):
        run(["tiss"])
    with pytest.raises(KeyError):  # RegistryError is also a KeyError
        build_correction("nope")


def test_build_correction_errors():
    with pytest.raises(ValueError, match=r"no field\(s\) \['C'\]; its fields: \['threshold', 'level'\]"):
        build_correction({"name": "tis", "C": 2.0})
    with pytest.raises(ValueError, match="has no 'name'"):
        build_correction({"threshold": 2.0})
    with pytest.raises(ValueError, match="got int"):
        build_correction(3)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: TISConfig(threshold=0.0), r"TISConfig.threshold must be a finite number > 0, got 0.0"),
        (lambda: TISConfig(threshold=-2), r"got -2"),
        (lambda: TISConfig(threshold=float("inf")), r"got inf"),
        (lambda: TISConfig(threshold=True), r"got True"),
        (lambda: TISConfig(level="seq"), r"TISConfig.level must be one of 'token', 'sequence', got 'seq'"),
        (lambda: MISConfig(threshold=float("nan")), r"MISConfig.threshold .* got nan"),
        (lambda: MISConfig(weight="yes"), r"MISConfig.weight must be a bool, got 'yes'"),
        (lambda: IcePopConfig(low=5.0, high=0.5), r"low < high, got low=5.0, high=0.5"),
        (lambda: IcePopConfig(low=0.0), r"IcePopConfig.low .* got 0.0"),
        (lambda: OPSMConfig(delta=-1e-3), r"OPSMConfig.delta must be a finite number >= 0, got -0.001"),
        (lambda: GSPOConfig(max_weight=0), r"GSPOConfig.max_weight .* got 0"),
        (lambda: GeoRSConfig(low=1.1, high=1.0), r"GeoRSConfig needs low < high, got low=1.1, high=1.0"),
        (lambda: TokenVetoConfig(threshold=2.0), r"TokenVetoConfig.threshold must be in \(0, 1\], got 2.0"),
    ],
)
def test_config_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_input_validation():
    train, rollout = base_case(pad=0.0)
    with pytest.raises(ValueError, match=r"rollout_logprobs_BS has shape \[2, 2\], expected \[2, 3\]"):
        apply_corrections([], train, rollout[:, :2], MASK)
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        apply_corrections([], train[0], rollout[0], MASK[0])
    with pytest.raises(ValueError, match="log_clamp"):
        apply_corrections([], train, rollout, MASK, log_clamp=1000.0)


# ----------------------------------------------------------------------------- properties

lr_lists = st.lists(st.floats(-60.0, 60.0), min_size=8, max_size=8)
mask_lists = st.lists(st.booleans(), min_size=8, max_size=8).filter(any)  # an empty batch is refused


def tensors(lrs, mk):
    lr = torch.tensor(lrs).reshape(2, 4)
    rollout = torch.full((2, 4), -62.0)  # below -max(lr): both sides stay logprobs (<= 0)
    return rollout + lr, rollout, torch.tensor(mk).reshape(2, 4)


@settings(max_examples=80, deadline=None)
@given(lr_lists, mask_lists, st.floats(0.01, 100.0))
def test_property_tis_weights_never_exceed_c(lrs, mk, c):
    train, rollout, mask = tensors(lrs, mk)
    r = apply_corrections([TISConfig(threshold=c)], train, rollout, mask)
    assert (r.weights_BS <= c * (1 + 1e-5)).all()
    assert torch.equal(r.keep_BS, mask)


@settings(max_examples=80, deadline=None)
@given(lr_lists, mask_lists, st.floats(0.05, 0.9), st.floats(1.1, 20.0))
def test_property_icepop_kept_ratios_inside_bounds(lrs, mk, low, high):
    train, rollout, mask = tensors(lrs, mk)
    r = apply_corrections([IcePopConfig(low=low, high=high)], train, rollout, mask)
    assert torch.equal(r.keep_BS, mask)  # the paper's normaliser: every response token stays in 1/|y|
    kept = r.weights_BS[r.weights_BS > 0]
    assert (kept >= low * (1 - 1e-5)).all() and (kept <= high * (1 + 1e-5)).all()


@settings(max_examples=60, deadline=None)
@given(lr_lists, mask_lists, st.lists(st.floats(-1e6, 1e6) | st.just(NAN), min_size=8, max_size=8))
def test_property_masked_tokens_never_counted(lrs, mk, garbage):
    train, rollout, mask = tensors(lrs, mk)
    g = torch.tensor(garbage).reshape(2, 4)
    dirty_train = torch.where(mask, train, g)
    specs = ["tis", "icepop", "geo_rs", "token_veto", "gspo", {"name": "mis", "threshold": 5.0}]
    clean = apply_corrections(specs, train, rollout, mask, advantages=torch.tensor([-1.0, 1.0]))
    dirty = apply_corrections(specs, dirty_train, rollout, mask, advantages=torch.tensor([-1.0, 1.0]))
    assert torch.equal(clean.keep_BS, dirty.keep_BS)
    assert not (dirty.keep_BS & ~mask).any()
    torch.testing.assert_close(clean.weights_BS, dirty.weights_BS)
    assert clean.metrics == pytest.approx(dirty.metrics, nan_ok=True)
    assert all(math.isfinite(v) for v in dirty.metrics.values())


# ----------------------------------------------------------------------------- issue 16 defects


def test_veto_fires_below_exp_minus_log_clamp():
    """Decisions read the raw log-ratio: a threshold below e^-log_clamp is not a dead zone."""
    rollout = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    train = torch.tensor([[-13.0, -1.0], [-1.0, -1.0]])  # ρ = e^-12 ≈ 6e-6 < 1e-4
    r = apply_corrections([TokenVetoConfig(threshold=1e-4)], train, rollout, torch.ones(2, 2, dtype=torch.bool), log_clamp=5.0)
    assert torch.equal(r.keep_BS, keep_of([[0, 0], [1, 1]]))
    ice = apply_corrections([IcePopConfig(low=1e-3, high=2.0, rejected="drop")], train, rollout, torch.ones(2, 2, dtype=torch.bool), log_clamp=5.0)
    assert torch.equal(ice.keep_BS, keep_of([[0, 1], [1, 1]]))


def test_opsm_per_token_advantages_mask_per_token():
    """DeepSeek-V3.2's mask is per token: only the drifted sequence's A_{i,t} < 0 tokens go."""
    adv = torch.tensor([[-1.0, 2.0, -3.0], [-1.0, -1.0, 0.0]])
    r = run([OPSMConfig(delta=0.1)], advantages=adv)  # seq 0 drifted (mean -lr = ln2/3 > 0.1)
    assert torch.equal(r.keep_BS, keep_of([[0, 1, 0], [1, 1, 0]]))


@pytest.mark.parametrize("bad", [NAN, float("inf")])
def test_nonfinite_advantages_are_refused(bad):
    with pytest.raises(ValueError, match=r"advantages .* finite .* \[0, 1\]"):
        run(["opsm"], advantages=torch.tensor([[-1.0, bad, -1.0], [1.0, 1.0, NAN]]))
    with pytest.raises(ValueError, match=r"advantages .* finite .* \[1\]"):
        run(["opsm"], advantages=torch.tensor([-1.0, bad]))


def test_empty_batch_is_refused():
    train, rollout = base_case(pad=0.0)
    with pytest.raises(ValueError, match="response_mask_BS selects no token"):
        apply_corrections(["tis"], train, rollout, torch.zeros(2, 3, dtype=torch.bool))


def test_infinite_logprob_is_nonfinite_not_weight_c():
    """A rollout logprob of -inf is a broken sample: rejected and counted, as the metrics do."""
    train = torch.tensor([[-1.0, -1.0, -2.0]])
    rollout = torch.tensor([[float("-inf"), -1.0, -1.0]])
    r = apply_corrections([TISConfig(threshold=2.0)], train, rollout, torch.ones(1, 3, dtype=torch.bool))
    assert torch.equal(r.keep_BS, keep_of([[0, 1, 1]]))
    close(r.weights_BS, [[0.0, 1.0, math.exp(-1.0)]])
    assert r.metrics["moe_replay/corr/nonfinite_token_fraction"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("side", ["train", "rollout"])
def test_positive_logprobs_are_refused_by_position_and_value(side):
    train, rollout = base_case(pad=0.0)
    (train if side == "train" else rollout)[0, 2] = 1.25  # e.g. a negative log-likelihood
    match = rf"{side}_logprobs_BS\[row 0, col 2\]': expected a logprob <= 0 .*found 1.25"
    with pytest.raises(LogprobInputError, match=match) as e:
        apply_corrections(["tis"], train, rollout, MASK)
    assert (e.value.row, e.value.col) == (0, 2)
    train, rollout = base_case(pad=7.0)  # padding may hold anything
    apply_corrections(["tis"], train, rollout, MASK)


def test_all_nan_train_logprobs_are_refused_not_a_zero_loss():
    """Every token rejected as non-finite would make reinforce_loss exactly 0 with nothing said."""
    train, rollout = base_case()
    train = torch.full_like(train, NAN)
    match = r"train_logprobs_BS\[row 0, col 0\]'.*at least one.*found nan.*all 5 response tokens"
    with pytest.raises(LogprobInputError, match=match):
        apply_corrections(["tis"], train, rollout, MASK)
    train, rollout = base_case()
    train[0] = NAN  # one sequence: rejected and counted, the rest trains
    r = apply_corrections(["tis"], train, rollout, MASK)
    assert r.metrics["moe_replay/corr/nonfinite_token_fraction"] == pytest.approx(3 / 5)


def test_reinforce_loss_refuses_positive_or_nan_policy_logprobs_on_loss_tokens():
    r = run([])
    with pytest.raises(LogprobInputError, match=r"policy_logprobs_BS\[row 1, col 1\]': expected a logprob <= 0 .*found 0.5"):
        reinforce_loss(torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.5, 0.0]]), torch.ones(2), r)
    with pytest.raises(LogprobInputError, match=r"policy_logprobs_BS\[row 0, col 2\]': expected a finite logprob .*found nan"):
        reinforce_loss(torch.tensor([[-1.0, -2.0, NAN], [-4.0, -5.0, 0.0]]), torch.ones(2), r)
    with pytest.raises(ValueError, match=r"policy_logprobs_BS shape \[2, 2\] != result.keep_BS shape \[2, 3\]"):
        reinforce_loss(torch.zeros(2, 2), torch.ones(2), r)


def test_icepop_paper_normaliser_keeps_rejected_tokens_in_denominator():
    """Ring-1T / verl: out-of-band tokens get weight 0 and stay in 1/|y|; 'drop' takes them out."""
    paper = run([IcePopConfig()])
    assert IcePopConfig().rejected == "zero_weight"
    assert torch.equal(paper.keep_BS, MASK.bool())
    close(paper.weights_BS, [[2.0, 0.0, 1.0], [1.0, 4.0, 0.0]])
    assert paper.metrics["moe_replay/corr/loss_tokens"] == 5
    assert paper.metrics["moe_replay/corr/kept_tokens"] == 4
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, NAN]])
    # -(2·-1 + 0 + 1·-3 + 1·-4 + 4·-5) / 5 tokens in the denominator
    assert reinforce_loss(lp, torch.ones(2), paper).item() == pytest.approx(29 / 5)
    drop = run([IcePopConfig(rejected="drop")])
    assert torch.equal(drop.keep_BS, keep_of([[1, 0, 1], [1, 1, 0]]))
    assert reinforce_loss(lp, torch.ones(2), drop).item() == pytest.approx(29 / 4)


# ----------------------------------------------------------------------------- batch skip, two-sided MIS


def test_batch_skip_below_threshold_changes_nothing_and_reports_vllm_kl():
    from moe_replay.metrics import logprob_mismatch_metrics

    train, rollout = base_case(pad=0.0)
    k3 = logprob_mismatch_metrics(train.double(), rollout.double(), MASK)["rollout_corr/k3_kl"]
    assert k3 == pytest.approx((1 - math.log(2) + 0.25 - 1 + math.log(4) + 0 + 0 + 3 - math.log(4)) / 5)
    r = apply_corrections([BatchSkipConfig(threshold=k3 * 1.01), "tis"], train, rollout, MASK)
    assert r.metrics["moe_replay/corr/batch_skip/vllm_kl"] == pytest.approx(k3, rel=1e-6)
    assert r.metrics["moe_replay/corr/batch_skip/skipped"] == 0.0
    assert torch.equal(r.keep_BS, MASK.bool()) and not r.skip_update
    torch.testing.assert_close(r.weights_BS, run(["tis"]).weights_BS)


def test_batch_skip_above_threshold_skips_the_update():
    r = run([BatchSkipConfig(threshold=0.1), "tis"])  # vllm-kl ≈ 0.511 here
    assert r.metrics["moe_replay/corr/batch_skip/skipped"] == 1.0
    assert not r.keep_BS.any() and (r.weights_BS == 0).all() and r.skip_update
    assert r.metrics["moe_replay/corr/token_masked_fraction"] == 1.0
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, 0.0]], requires_grad=True)
    loss = reinforce_loss(lp, torch.ones(2), r)
    loss.backward()
    assert loss.item() == 0.0 and (lp.grad == 0).all()
    assert BatchSkipConfig().threshold == 0.1
    with pytest.raises(ValueError, match="BatchSkipConfig.threshold must be a finite number > 0, got 0"):
        BatchSkipConfig(threshold=0)


def test_batch_skip_preset_is_opt_in():
    from moe_replay.presets import load_preset, preset_names

    names = [c.name for c in load_preset("r3_support_batch_skip").corrections]
    assert names == ["batch_skip", "tis"]
    others = [n for n in preset_names() if n != "r3_support_batch_skip"]
    assert all("batch_skip" not in [c.name for c in load_preset(n).corrections] for n in others)


def test_mis_two_sided_like_verls_seq_mis():
    r = run([MISConfig(threshold=2.0, low=0.6)])  # Π ρ = [0.5, 4]: both sequences out
    assert not r.keep_BS.any()
    one_sided = run([MISConfig(threshold=5.0, low=0.6)])
    assert torch.equal(one_sided.keep_BS, keep_of([[0, 0, 0], [1, 1, 0]]))
    with pytest.raises(ValueError, match="MISConfig needs low < threshold, got low=2.0, threshold=2.0"):
        MISConfig(threshold=2.0, low=2.0)
