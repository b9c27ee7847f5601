"""Presets: every shipped YAML loads; unknown keys and invalid values are errors that name them."""

from __future__ import annotations

import pytest

from moe_replay.presets import load_preset, preset_from_dict, preset_names

BASE = {"name": "t", "capture": {"routes": True, "support": True}, "replay": {"routes": True, "support": True}}


def test_shipped_presets_load_and_mean_what_they_say():
    names = preset_names()
    assert {"none", "r3", "r3_support", "r3_support_multisample", "r3_support_icepop"} <= set(names)
    for name in names:
        preset = load_preset(name)
        assert preset.name == name and preset.description
    assert not load_preset("none").replay.routes
    assert load_preset("r3_support").replay.support and not load_preset("r3").replay.support
    ms = load_preset("r3_support_multisample")
    assert ms.estimator.enabled and ms.estimator.config.n == 4 and ms.estimator.force_routes
    assert [c.name for c in load_preset("r3_support_icepop").corrections] == ["icepop"]


def test_preset_from_a_path(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("name: mine\ncapture: {routes: true}\nreplay: {routes: true}\nestimator: {enabled: true, n: 8}\n")
    preset = load_preset(p)
    assert preset.name == "mine" and preset.estimator.config.n == 8


@pytest.mark.parametrize(
    "change,match",
    [
        ({"replay": {"routes": True, "suport": True}}, r"replay: unknown key\(s\) \['suport'\]; allowed: .*'support'"),
        ({"capture": {"max_support": 0}}, r"capture: .*max_support must be a positive int, got 0"),
        ({"estimator": {"enabled": True, "n": 0}}, r"estimator: .*n must be >= 1, got 0"),
        ({"estimator": {"enabled": "yes"}}, r"estimator.enabled: expected true/false, found 'yes'"),
        ({"replay": {"padding_side": "middle"}}, r"padding_side must be 'left' or 'right', got 'middle'"),
        ({"corrections": [{"name": "tis", "threshold": -1}]}, r"corrections\[0\]: .*threshold"),
        ({"corrections": [{"name": "nope"}]}, r"corrections\[0\]: .*unknown correction 'nope'.*icepop"),
        ({"trainer": {}}, r"unknown section\(s\) \['trainer'\]"),
        ({"capture": {"routes": False}}, "replay needs what it replays captured"),
    ],
)
def test_bad_presets_name_what_is_wrong(change, match):
    with pytest.raises(ValueError, match=match):
        preset_from_dict({**BASE, **change}, "test.yaml")


def test_unknown_preset_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"unknown preset 'r4'; shipped presets: \[.*'r3_support'"):
        load_preset("r4")
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_preset(tmp_path / "nope.yaml")


def test_adjusted_sampling_opt_in_is_a_replay_setting():
    """The opt-in that lets a plan score traces whose sampler's logits were shifted lives in the
    preset's replay section, so every trainer path that builds its plan from the preset gets it."""
    from moe_replay.presets import preset_from_dict

    base = {"name": "x", "capture": {"routes": True, "support": True, "logprobs": True}, "replay": {"routes": True, "support": True}}
    assert preset_from_dict(base).replay.plan.allow_adjusted_sampling is False
    opted = preset_from_dict({**base, "replay": {**base["replay"], "allow_adjusted_sampling": True}})
    assert opted.replay.plan.allow_adjusted_sampling is True
