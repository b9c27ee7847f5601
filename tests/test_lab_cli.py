"""`moe-replay lab`: the quick lab as a command (lab.json + a self-contained HTML report), its
refusals before anything slow starts, and the report's tables and plots checked against the JSON
(a saved quick-lab result renders without an engine; one tiny run goes through the real engine)."""

from __future__ import annotations

import json
import math
from html.parser import HTMLParser
from pathlib import Path

import pytest

from moe_replay.cli import main

ROOT = Path(__file__).resolve().parent.parent
SAVED = ROOT / "benchmarks" / "results" / "lab-cpu-2026-11-27.json"
PLOT_FILES = ["lab_grad_cos.png", "lab_phantom_clip.png", "lab_variance.png"]


class _Tagged(HTMLParser):
    """(data-key, data-value, shown text) of every element carrying data-key."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, str, str]] = []
        self._open: list[list] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self._open.append([a.get("data-key"), a.get("data-value"), ""] if "data-key" in a else None)

    def handle_endtag(self, tag):
        item = self._open.pop() if self._open else None
        if item is not None:
            self.found.append((item[0], item[1], item[2].strip()))

    def handle_data(self, data):
        for item in self._open:
            if item is not None:
                item[2] += data


def tagged(html: str) -> list[tuple[str, str, str]]:
    p = _Tagged()
    p.feed(html)
    return p.found


def at(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


def check_page_against_json(html: str, lab: dict) -> int:
    """Every tagged number equals the JSON's value at its path, shown as tables.fmt prints it; the
    per-arm table holds every arm's headline numbers. Returns how many values were checked."""
    from moe_replay.report.tables import fmt

    found = tagged(html)
    for key, value, shown in found:
        want = at(lab, key)
        assert json.loads(value) == want, key
        if isinstance(want, float):
            assert shown == fmt(want), (key, shown)
        elif want is None:  # null: not computable, shown as such
            assert shown == "n/a", (key, shown)
    keys = {k for k, _, _ in found}
    for arm in lab["arms"]:
        for metric in ("phantom_clip_fraction", "k3_kl", "flip_rate", "grad_cos_to_reference.value",
                       "grad_cos_to_reference.ci95"):
            assert f"arms.{arm}.{metric}" in keys, (arm, metric)
    for target in lab["targets"]:
        assert f"targets.{target}.met" in keys
    for n in lab["estimator"]["var"]:
        assert f"estimator.var.{n}" in keys
    return len(found)


def test_saved_lab_result_renders_a_page_whose_numbers_are_the_jsons(tmp_path):
    pytest.importorskip("matplotlib")
    from moe_replay.lab.html import LAB_LABEL, render_lab_report

    lab = json.loads(SAVED.read_text())
    paths = render_lab_report(lab, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == PLOT_FILES
    html = paths["html"].read_text()
    assert LAB_LABEL.lower() in html.lower()[: html.find("<h2>")]  # at the top, before any section
    assert html.count("data:image/png;base64,") == 3 and "<script" not in html and "http" not in html
    assert check_page_against_json(html, lab) > 7 * 6
    # the saved run met all three targets (docs/lab.md): the page says so, target by target
    mets = {k: v for k, v, _ in tagged(html) if k.endswith(".met")}
    assert mets == {"targets.phantom_clip_r3_support_le_tenth_of_none.met": "true",
                    "targets.grad_cos_r3_support_ge_none.met": "true", "targets.variance_ratio_n4_le_half.met": "true"}
    assert "<b>NO</b>" not in html and "<b>yes</b>" in html
    # a missed target reads NO: the same run with r3_support's clipping at none's
    missed = json.loads(SAVED.read_text())
    missed["targets"]["phantom_clip_r3_support_le_tenth_of_none"]["met"] = False
    page = render_lab_report(missed, tmp_path / "missed")["html"].read_text()
    assert {k: v for k, v, _ in tagged(page) if k.endswith(".met")}["targets.phantom_clip_r3_support_le_tenth_of_none.met"] == "false"
    assert "<b>NO</b>" in page
    # every column of the per-arm table has a glossary row
    from moe_replay.report.glossary import LAB_GLOSSARY
    from moe_replay.lab.html import LAB_ARM_COLUMNS

    assert all(k in LAB_GLOSSARY and f"<code>{k}</code>" in html for k in LAB_ARM_COLUMNS)


def test_plot_helpers_read_the_json():
    from moe_replay.lab.plots import grad_cos_points
    from moe_replay.report.plots import variance_points

    lab = {"arms": {"a": {"grad_cos_to_reference": {"value": 0.9, "ci95": [0.8, 0.95]}},
                    "b": {"grad_cos_to_reference": {"value": None, "ci95": [None, None]}}},
           "estimator": {"var": {"8": 1e-7, "1": 4e-6, "2": 2e-6}}}
    pts = grad_cos_points(lab)
    assert pts["a"] == (0.9, 0.8, 0.95) and all(math.isnan(v) for v in pts["b"])
    n, var = variance_points(lab)
    assert n.tolist() == [1, 2, 8] and var.tolist() == [4e-6, 2e-6, 1e-7]  # sorted by n, not by key text


def test_plots_draw_a_missing_interval_and_a_zero_variance(tmp_path):
    pytest.importorskip("matplotlib")
    from moe_replay.lab.plots import render_lab_plots

    lab = {"arms": {"none": {"phantom_clip_fraction": 0.0, "grad_cos_to_reference": {"value": 1.0, "ci95": [None, None]}}},
           "estimator": {"var": {"1": 0.0, "2": 0.0}}}
    paths = render_lab_plots(lab, tmp_path)
    assert sorted(p.name for p in paths.values()) == PLOT_FILES and all(p.stat().st_size > 1000 for p in paths.values())


def test_terminal_table_prints_each_arms_headline_numbers():
    import io

    from moe_replay.lab.html import LAB_LABEL, print_lab_table
    from moe_replay.report.tables import fmt

    lab = json.loads(SAVED.read_text())
    buf = io.StringIO()
    print_lab_table(lab, file=buf)
    text = buf.getvalue()
    assert LAB_LABEL in " ".join(text.split())
    for name, arm in lab["arms"].items():
        line = next(ln for ln in text.splitlines() if f" {name} " in ln)
        ci = arm["grad_cos_to_reference"]["ci95"]
        for v in (arm["phantom_clip_fraction"], arm["k3_kl"], arm["grad_cos_to_reference"]["value"]):
            assert fmt(v) in line, (name, v, line)
        assert f"[{fmt(ci[0])}, {fmt(ci[1])}]" in line


def test_out_an_existing_file_is_refused(tmp_path, capsys):
    f = tmp_path / "lab.txt"
    f.write_text("keep me")
    assert main(["lab", "--out", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-replay lab: error: --out ") and str(f) in err and "found a file" in err
    assert f.read_text() == "keep me" and err.count("\n") == 1


@pytest.mark.parametrize("arms,found", [("none,r3_suport", "'r3_suport'"), (",", "','")])
def test_a_bad_arm_is_refused_naming_the_known_ones(tmp_path, capsys, arms, found):
    out = tmp_path / "lab"
    assert main(["lab", "--out", str(out), "--arms", arms]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-replay lab: error: --arms: expected comma-separated arms among none, tis, mis, icepop, r3, ")
    assert found in err and "r3_support_multisample" in err and "Traceback" not in err
    assert not out.exists()  # refused before anything was written


def test_bad_numbers_are_refused_before_anything_starts(tmp_path, capsys):
    assert main(["lab", "--out", str(tmp_path / "a"), "--variance-repeats", "1"]) == 2
    assert "variance_repeats must be >= 2" in capsys.readouterr().err
    assert main(["lab", "--out", str(tmp_path / "b"), "--scale", "-1"]) == 2
    assert "EngineNoise.scale must be a finite number >= 0, got -1.0" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.vllm
@pytest.mark.slow  # 60 s on 2 cores at a load of 2, 114 s at a load of 5-9 (engine start and 3 trainer passes)
def test_cli_lab_tiny_run_writes_json_and_a_page_of_its_numbers(tmp_path, capsys, monkeypatch):
    pytest.importorskip("vllm")
    pytest.importorskip("matplotlib")
    import moe_replay.lab.engine as vlab

    stages: list[tuple[int, int]] = []
    real_run_lab = vlab.run_lab

    def run_lab(cfg, progress):  # the progress bar's calls, seen on their way to it
        def seen(done, total, what):
            stages.append((done, total))
            progress(done, total, what)
        return real_run_lab(cfg, progress=seen)

    monkeypatch.setattr(vlab, "run_lab", run_lab)
    out = tmp_path / "lab"
    args = ["lab", "--out", str(out), "--rollouts", "4", "--tokens", "4", "--arms", "none,r3_support",
            "--variance-repeats", "2", "--variance-rollouts", "2", "--boot", "50"]
    assert main(args) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    lab = json.loads((out / "lab.json").read_text())
    assert summary["lab_json"] == str(out / "lab.json") and summary["html"] == str(out / "report.html")
    assert summary["targets_met"] == {k: t["met"] for k, t in lab["targets"].items()}
    assert list(lab["arms"]) == ["none", "r3_support"] and lab["setup"]["rollouts"] == 4
    # the bar's total is the stages the run reports: model, engine, rollouts, π_old, 4 n x 2 repeats, reference, 2 arms
    assert stages == [(i, 15) for i in range(1, 16)]
    assert lab["arms"]["r3_support"]["flip_rate"] == 0.0  # replay: the trainer ran the engine's experts
    assert lab["noise"]["calibration"]["measured"]["file"] == "benchmarks/results/noise-calibration-cpu-2026-11-27.json"
    assert sorted(p.name for p in out.glob("*.png")) == PLOT_FILES
    html = (out / "report.html").read_text()
    assert check_page_against_json(html, lab) > 2 * 6
    assert "Traceback" not in captured.err
