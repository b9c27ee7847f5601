"""The end-to-end demo on the real engine: a short run of all three arms, the engine-noise section on a
tiny setting, and its report."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


TINY_NOISE = dict(prompts=4, samples_per_prompt=4, studied=8, score_batch=4, replicas=16)
"""The noise section at ~20 s on 2 loaded cores: 16 rollouts, 8 studied, 16 replicas each in 2 batches a
round (32 engine batches); estimates 16 / 8 / 4 / 2 at n = 1 / 2 / 4 / 8."""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from moe_replay.demo import DemoConfig, NoiseSection, run_demo

    out = tmp_path_factory.mktemp("demo")
    cfg = DemoConfig(steps=2, prompts_per_step=4, samples_per_prompt=2, max_tokens=6, noise=NoiseSection(**TINY_NOISE))
    rep = run_demo(cfg, out)
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(rep))
    return rep


def test_report_has_every_arm_and_the_required_keys(report):
    assert set(report["arms"]) == {"none", "r3_support", "r3_support_multisample"}
    for arm in report["arms"].values():
        assert {"route_flip_rate", "k3_kl", "max_abs_logprob_diff", "reward"} <= set(arm["mean"])
        assert len(arm["steps"]) == 2
        for step in arm["steps"]:
            assert set(step["route_agreement_per_layer"]) == {"0", "1"}
            hist = step["abs_logprob_diff_hist"]
            assert len(hist["edges"]) == len(hist["counts"]) + 1 and sum(hist["counts"]) > 0
    assert report["wall_s"] > 0


def test_the_page_explains_every_column_of_a_real_report(report, tmp_path):
    """Every column the page or the terminal prints for a real run has a glossary entry (a new metric
    without one fails here), and each step's histogram holds all of its generated tokens."""
    from moe_replay.report import render_report
    from moe_replay.report.glossary import undocumented
    from moe_replay.report.html import table_columns

    columns = table_columns(report)
    assert {"k3_kl_vs_pi_old", "kl", "chi2_token", "wall_s", "tokens"} <= set(columns)
    assert {"n", "pi_old_abs_diff", "pi_old_var", "pi_old_variance_ratio", "inverse_n", "phantom_clip_fraction"} <= set(columns)
    assert undocumented(columns) == []
    for arm in report["arms"].values():
        for step in arm["steps"]:
            assert sum(step["abs_logprob_diff_hist"]["counts"]) == step["tokens"] > 0
    page = render_report(report, tmp_path)["html"].read_text(encoding="utf-8")
    assert "no glossary entry" not in page and '<h2 id="glossary">' in page


def test_replay_removes_route_flips_and_lowers_kl(report):
    arms = report["arms"]
    none = arms["none"]["mean"]
    assert none["route_flip_rate"] > 0, "a bf16 engine and an fp32 trainer should disagree on some routes"
    for name in ("r3_support", "r3_support_multisample"):
        mean = arms[name]["mean"]
        assert mean["route_flip_rate"] == 0.0
        assert mean["free_route_flip_rate"] > 0  # the trainer's router would have flipped: replay did work
        assert mean["k3_kl"] < none["k3_kl"] / 2


def test_multisample_pi_old_is_the_engine_score_on_a_deterministic_cpu_engine(report):
    steps = report["arms"]["r3_support_multisample"]["steps"]
    same_arm = report["arms"]["r3_support"]["steps"]
    for s, r in zip(steps, same_arm):
        # π_old re-scored on the engine under forced routes + support equals its rollout logprobs,
        # up to the bf16 engine's prefill-vs-decode floor: <= 1e-6 nats per token (docs/findings.md),
        # which moves k3 by at most max|δ|·mean|1 - e^d| ~ 1e-7 here (seen: 2.6e-9). A wrong route or
        # support moves a token by > 1e-2 nats and k3 by far more.
        assert s["k3_kl_vs_pi_old"] == pytest.approx(s["k3_kl"], rel=0, abs=1e-7)
        assert s["k3_kl"] == pytest.approx(r["k3_kl"], rel=1e-6)


@pytest.mark.mrv2
def test_cli_demo_writes_report_plots_and_page(tmp_path, capsys):
    """--no-noise: no engine-noise section anywhere (report, summary line, page, plots). On the session's runner
    (bf16 rollouts, weights synced every step: the MRV2 session runs it on Model Runner V2)."""
    from moe_replay.cli import main

    out = tmp_path / "demo"
    args = ["demo", "--out", str(out), "--steps", "1", "--prompts", "2", "--samples", "2", "--max-tokens", "4",
            "--arms", "none,r3_support", "--no-noise"]
    assert main(args) == 0
    means = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(means) == {"none", "r3_support"} and means["r3_support"]["route_flip_rate"] == 0.0
    html = (out / "report.html").read_text()
    assert "data:image/png;base64" in html and (out / "report.json").exists()
    assert "engine_noise" not in json.loads((out / "report.json").read_text()) and 'id="engine_noise"' not in html
    assert sorted(p.name for p in out.glob("*.png")) == ["k3_kl.png", "logprob_diff_hist.png", "reward.png", "route_agreement.png"]


def test_cli_demo_bad_settings_exit_2(tmp_path, capsys):
    from moe_replay.cli import main

    assert main(["demo", "--out", str(tmp_path), "--steps", "0"]) == 2
    assert "steps must be >= 1, got 0" in capsys.readouterr().err
    assert main(["demo", "--out", str(tmp_path), "--arms", "none=r4"]) == 2
    assert "unknown preset 'r4'" in capsys.readouterr().err


def test_unsupported_family_for_a_replay_preset_is_named(tmp_path, capsys):
    from moe_replay.cli import main

    assert main(["demo", "--out", str(tmp_path), "--family", "deepseek_v3"]) == 2
    err = capsys.readouterr().err
    assert "arm 'r3_support': preset 'r3_support' replays routes" in err and "--family" in err


def test_noise_section_multisample_pi_old_differs_from_the_rollout_and_its_variance_falls(report, tmp_path):
    """Under the engine-noise instrument the re-scores disagree: π_old is no longer the rollout's
    logprobs (on the clean CPU engine they agree to <= 1e-6 nats per token, the bf16 prefill-vs-decode
    floor, test above), and averaging n replicas lowers its variance."""
    from moe_replay.report import render_report

    sec = report["engine_noise"]
    assert "not a GPU result" in sec["label"] and sec["noise"]["scale"] == 1.0
    assert sec["traces_marked_noisy"] == 16 == sec["setup"]["rollouts"]  # every rollout says it is perturbed
    assert set(sec["rescoring_noise_stats"]["variant_steps"]) == {"0", "1"}  # the placements ran both variants
    est = sec["estimator"]
    assert est["estimates"] == {"1": 16, "2": 8, "4": 4, "8": 2}
    for n in ("1", "2", "4", "8"):
        assert est["pi_old_abs_diff"][n] > 1e-5, f"n = {n}: π_old equals the rollout's logprobs: no noise reached the re-scores"
    assert 0 < est["var"]["4"] < est["var"]["1"], est["var"]
    assert est["variance_ratio"]["4"] == pytest.approx(est["var"]["4"] / est["var"]["1"])
    clip = sec["phantom_clip"]
    assert clip["n"] == 4 and 0 <= clip["estimate"] <= 1 and 0 <= clip["rollout_logprobs"] <= 1 and clip["tokens"] == est["tokens"]

    paths = render_report(report, tmp_path)
    page = paths["html"].read_text(encoding="utf-8")
    assert '<h2 id="engine_noise">' in page and "not a GPU result" in page and paths["pi_old_variance"].exists()
    assert page.index('<h2 id="engine_noise">') < page.index("<h2>Setup</h2>")
