"""Report renderer: a synthetic demo report -> PNG plots + one self-contained HTML page; schema
errors name the missing key; the arm table prints; importing the package pulls in no matplotlib."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_replay.cli import main
from moe_replay.report import PLOTS, ReportSchemaError, print_arm_table, render_report, validate_report

REPO = Path(__file__).resolve().parents[1]
ARMS = {
    # name: (preset, flip rate, k3-KL scale, |Δ logprob| scale, reward drift)
    "none": ("none", 0.08, 3e-3, 0.3, -0.01),
    "r3_support": ("r3_support", 0.0, 2e-5, 0.01, 0.01),
    "r3_support_multisample": ("r3_support_multisample", 0.0, 0.0, 0.003, 0.012),
}


def synthetic_report(steps: int = 6, layers: tuple[int, ...] = (1, 2, 3, 5), seed: int = 0) -> dict:
    """A report shaped like the demo's: three arms, per-step metrics, per-layer agreement and
    |Δ logprob| histograms on log bins with a first bin of exact zeros."""
    rng = np.random.default_rng(seed)
    edges = [0.0] + list(np.logspace(-6, 1, 29))
    arms = {}
    for name, (preset, flip, kl, diff, drift) in ARMS.items():
        recs = []
        for s in range(steps):
            draws = np.abs(rng.normal(0, diff, 4000)) * (rng.random(4000) > (0.6 if flip == 0 else 0.1))
            counts, _ = np.histogram(np.clip(draws, 0, 9.99), bins=edges)
            recs.append({
                "step": s,
                "route_flip_rate": float(flip * rng.uniform(0.8, 1.2)),
                "k3_kl": float(kl * rng.uniform(0.5, 2.0)) if kl else 0.0,
                "max_abs_logprob_diff": float(draws.max()),
                "mean_abs_logprob_diff": float(draws.mean()),
                "reward": float(0.2 + drift * s + rng.normal(0, 0.01)),
                "wall_s": float(rng.uniform(1, 2)),
                "route_agreement_per_layer": {str(l): float(1 - flip * rng.uniform(0.5, 1.5)) for l in layers},
                "abs_logprob_diff_hist": {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]},
                "tokens": 4000,
            })
        mean = {k: float(np.mean([r[k] for r in recs])) for k in ("route_flip_rate", "k3_kl", "max_abs_logprob_diff", "reward", "wall_s")}
        arms[name] = {"preset": preset, "description": f"arm {name} <b>not bold</b>", "mean": mean, "steps": recs}
    return {
        "moe_replay_version": "0.1.0", "wall_s": 12.5,
        "setup": {"family": "qwen3_moe", "engine_dtype": "bfloat16", "trainer_dtype": "float32", "steps": steps,
                  "prompts_per_step": 4, "samples_per_prompt": 4, "max_tokens": 24, "estimator_n": 4},
        "arms": arms,
    }


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    report = synthetic_report()
    out = tmp_path_factory.mktemp("report")
    return report, out, render_report(report, out)


def test_render_writes_pngs_and_self_contained_html(rendered):
    report, out, paths = rendered
    assert set(paths) == set(PLOTS) | {"html"}
    for name in PLOTS:
        data = paths[name].read_bytes()
        assert paths[name].parent == out and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    page = paths["html"].read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") == len(PLOTS)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "external resource in the page"
    assert "http" not in page.lower()
    assert "<script" not in page.lower()
    for arm in report["arms"]:
        assert arm in page
    assert "&lt;b&gt;not bold&lt;/b&gt;" in page, "descriptions must be HTML-escaped"
    assert "route_flip_rate" in page and "qwen3_moe" in page


def test_render_any_arm_set_and_zero_only_metrics(tmp_path):
    report = synthetic_report(steps=2, layers=(0,))
    report["arms"] = {"only": report["arms"]["r3_support_multisample"]}  # k3-KL all exactly 0
    paths = render_report(report, tmp_path / "one")
    assert all(p.exists() for p in paths.values())


def test_render_report_does_not_touch_pyplot_state(tmp_path):
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "from tests.test_report import synthetic_report\n"
        "from moe_replay.report import render_report\n"
        "render_report(synthetic_report(steps=2), %r)\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot was imported'\n"
    ) % (str(REPO), str(tmp_path))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda r: r.pop("arms"), "report['arms']: missing key 'arms'"),
        (lambda r: r.pop("wall_s"), "missing key 'wall_s'"),
        (lambda r: r["arms"]["none"]["mean"].pop("k3_kl"), "report['arms']['none']['mean']['k3_kl']: missing key 'k3_kl'"),
        (lambda r: r["arms"]["r3_support"]["steps"][2].pop("reward"), "report['arms']['r3_support']['steps'][2]['reward']"),
        (lambda r: r["arms"]["none"]["steps"][0]["abs_logprob_diff_hist"].pop("counts"), "missing key 'counts'"),
        (lambda r: r["arms"]["none"]["steps"][1]["abs_logprob_diff_hist"]["counts"].pop(), "len(edges) == len(counts) + 1"),
        (lambda r: r["arms"]["none"]["steps"][1].__setitem__("k3_kl", "0.1"), "expected a number, found str"),
        (lambda r: r["arms"]["none"]["steps"][0]["route_agreement_per_layer"].__setitem__("mlp", 1.0), "layer ids"),
        (lambda r: r["arms"].clear(), "at least one arm"),
        (lambda r: r["arms"]["none"]["steps"][1]["abs_logprob_diff_hist"].__setitem__("edges", [0.0] + [1.0] * 29), "increasing"),
    ],
)
def test_schema_errors_name_the_key(mutate, needle):
    report = synthetic_report(steps=3)
    mutate(report)
    with pytest.raises(ReportSchemaError) as exc:
        validate_report(report)
    assert needle in str(exc.value)


def test_validate_accepts_extra_keys():
    report = synthetic_report(steps=2)
    report["extra"] = {"anything": [1, 2]}
    report["arms"]["none"]["steps"][0]["custom_metric"] = 3.5
    assert validate_report(copy.deepcopy(report)) == report


def test_print_arm_table(capsys):
    print_arm_table(synthetic_report(steps=2))
    out = capsys.readouterr().out
    for title in ("route-flip rate", "k3-KL", "max |Δ logprob|", "reward", "none", "r3_support_multisample"):
        assert title in out


def test_cli_report(tmp_path, capsys):
    src = tmp_path / "run" / "report.json"
    src.parent.mkdir()
    src.write_text(json.dumps(synthetic_report(steps=2)))
    assert main(["report", str(src), "--out", str(tmp_path / "html")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert Path(printed["html"]) == tmp_path / "html" / "report.html" and Path(printed["html"]).exists()
    assert main(["report", str(src)]) == 0  # default: next to the JSON
    assert (src.parent / "report.html").exists() and (src.parent / "k3_kl.png").exists()


def test_cli_report_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    bad = synthetic_report(steps=2)
    del bad["arms"]["none"]["steps"][1]["route_agreement_per_layer"]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert main(["report", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert "report['arms']['none']['steps'][1]['route_agreement_per_layer']: missing key" in err and "Traceback" not in err
    (tmp_path / "junk.json").write_text("{not json")
    assert main(["report", str(tmp_path / "junk.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_import_moe_replay_pulls_no_plotting_or_rich():
    code = (
        "import sys, moe_replay, moe_replay.cli, moe_replay.report, moe_replay.report.inspect, moe_replay.report.bench\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'rich', 'tqdm'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_render_accepts_numpy_scalars_in_process(tmp_path):
    """The demo may hand its dict over before any JSON round trip: numpy ints and floats are numbers."""
    report = synthetic_report(steps=2)
    report["setup"]["layers"] = np.arange(3)
    for arm in report["arms"].values():
        arm["mean"] = {k: np.float32(v) for k, v in arm["mean"].items()}
        for s in arm["steps"]:
            s["step"] = np.int64(s["step"])
            s["k3_kl"] = np.float64(s["k3_kl"])
            s["abs_logprob_diff_hist"]["counts"] = list(np.asarray(s["abs_logprob_diff_hist"]["counts"], dtype=np.int64))
    paths = render_report(report, tmp_path)
    assert "k3_kl" in paths["html"].read_text(encoding="utf-8")


def test_arm_table_without_rich(monkeypatch, capsys):
    """rich is optional: without it the same table prints as aligned text."""
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.setitem(sys.modules, "rich.console", None)
    monkeypatch.setitem(sys.modules, "rich.table", None)
    print_arm_table(synthetic_report(steps=2))
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ["arm", "preset", "route-flip"] and lines[2].startswith("---")
    assert any(line.startswith("r3_support_multisample") for line in lines)


def test_glossary_covers_every_column_the_tables_print():
    """The page's and the terminal's columns come from the code (html.table_columns); each needs an
    entry with a unit and a meaning, and an unknown column is reported (the check can fail)."""
    from moe_replay.demo.loop import MEAN_KEYS as DEMO_MEAN_KEYS
    from moe_replay.report.glossary import lookup, undocumented
    from moe_replay.report.html import table_columns
    from moe_replay.report.schema import MEAN_KEYS, STEP_KEYS

    report = synthetic_report(steps=2)
    for arm in report["arms"].values():
        arm["mean"].update({k: 0.5 for k in DEMO_MEAN_KEYS})
    columns = table_columns(report)
    assert {"arm", "preset", "step", "wall_s", *MEAN_KEYS, *STEP_KEYS, *DEMO_MEAN_KEYS} <= set(columns)
    assert undocumented(columns) == []
    assert all(lookup(k).unit and lookup(k).meaning for k in columns)
    report["arms"]["none"]["steps"][0]["new_metric"] = 1.0
    assert "new_metric" in undocumented(table_columns(report))
    assert lookup("moe_replay/corr/tis/token_masked_fraction").title == "tis: tokens masked"


def test_page_explains_itself(tmp_path):
    """Human headers (raw keys kept in the glossary), units, signs, n/a for unmeasured metrics, the
    per-step wall time's unit, why token counts differ, and coinciding lines named."""
    report = synthetic_report(steps=3)
    report["arms"]["r3_support_multisample"]["mean"]["k3_kl_vs_pi_old"] = 1e-9
    for arm in report["arms"].values():
        arm["mean"]["kl"] = -2e-4
    ms, r3 = report["arms"]["r3_support_multisample"], report["arms"]["r3_support"]
    for a, b in zip(ms["steps"], r3["steps"]):
        a["reward"] = b["reward"]  # the two replay arms drew the same completions
    hist = ms["steps"][0]["abs_logprob_diff_hist"]["counts"]
    fullest = hist.index(max(hist))
    hist[fullest] -= 7  # 7 fewer tokens generated in this arm
    ms["steps"][0]["tokens"] -= 7
    page = render_report(report, tmp_path)["html"].read_text(encoding="utf-8")
    assert '<th title="route_flip_rate">route-flip rate</th>' in page
    assert '<th title="wall_s">wall time per step (s)</th>' in page
    assert "<code>k3_kl_vs_pi_old</code>" in page and "<code>kl</code>" in page
    assert page.count('title="not measured in this arm">n/a</td>') == 2  # k3_kl_vs_pi_old of none and r3_support
    assert "either sign" in page and "negative" in page
    assert "Token counts differ between arms" in page and "end-of-sequence" in page and "r3_support_multisample 11,993" in page
    assert "Outside the histogram" not in page
    hist[fullest] -= 3  # 3 tokens the step generated are not in its histogram
    page = render_report(report, tmp_path)["html"].read_text(encoding="utf-8")
    assert "Outside the histogram&#x27;s bins (non-finite or beyond its last edge): r3_support_multisample 3 of 11,993" in page
    assert "arms r3_support and r3_support_multisample coincide" in page.replace("Arms", "arms")
    glossary = page[page.index('id="glossary"'):]
    from moe_replay.report.html import table_columns

    for key in table_columns(report):
        assert f"<code>{key}</code>" in glossary, key


def test_coinciding_lines_are_found_and_named():
    from moe_replay.report.plots import coincide_note, coinciding

    report = synthetic_report(steps=4)
    assert coinciding(report, "reward") == []
    arms = report["arms"]
    for a, b in zip(arms["none"]["steps"], arms["r3_support_multisample"]["steps"]):
        b["reward"] = a["reward"]
    assert coinciding(report, "reward") == [["none", "r3_support_multisample"]]
    assert coincide_note(coinciding(report, "reward")) == "arms none and r3_support_multisample coincide"
    arms["r3_support_multisample"]["steps"][2]["reward"] += 0.05  # 0.4% of the span is the tolerance
    assert coinciding(report, "reward") == []
