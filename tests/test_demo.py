"""The end-to-end demo on the real engine: a short run of all three arms and its report."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from moe_replay.demo import DemoConfig, run_demo

    out = tmp_path_factory.mktemp("demo")
    cfg = DemoConfig(steps=2, prompts_per_step=4, samples_per_prompt=2, max_tokens=6)
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


def test_cli_demo_writes_report_plots_and_page(tmp_path, capsys):
    from moe_replay.cli import main

    out = tmp_path / "demo"
    args = ["demo", "--out", str(out), "--steps", "1", "--prompts", "2", "--samples", "2", "--max-tokens", "4",
            "--arms", "none,r3_support"]
    assert main(args) == 0
    means = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(means) == {"none", "r3_support"} and means["r3_support"]["route_flip_rate"] == 0.0
    html = (out / "report.html").read_text()
    assert "data:image/png;base64" in html and (out / "report.json").exists()
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
