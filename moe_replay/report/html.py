"""One self-contained HTML page for a demo report: inline CSS, PNGs embedded as base64 data URIs,
no scripts and no external resources (it opens offline and can be mailed as one file)."""

from __future__ import annotations

import base64
import html
import json
import math
import numbers
from pathlib import Path
from typing import Any

from .plots import PLOTS, arm_colors
from .schema import MEAN_KEYS
from .tables import fmt

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1000px;
       color: #222; line-height: 1.4; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
.meta { color: #666; font-size: 0.9em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.7em; } th { background: #f4f4f4; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.swatch { display: inline-block; width: 0.8em; height: 0.8em; margin-right: 0.4em; border-radius: 2px; }
figure { margin: 1.2em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _cell(value: Any) -> str:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return f'<td class="num">{_e(fmt(value))}</td>'
    if isinstance(value, (dict, list)):
        return f"<td><code>{_e(json.dumps(value, default=str))}</code></td>"
    return f"<td>{_e(value)}</td>"


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def mean_keys(report: dict) -> list[str]:
    """The required means first, then every other mean key any arm has, in first-seen order."""
    keys = list(MEAN_KEYS)
    for arm in report["arms"].values():
        keys += [k for k in arm["mean"] if k not in keys]
    return keys


def build_html(report: dict, pngs: dict[str, Path]) -> str:
    """The page as a string; `pngs` maps plot name (see plots.PLOTS) -> PNG file to embed."""
    colors = arm_colors(report)
    arms = report["arms"]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>moe_replay demo report</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>moe_replay demo report</h1>",
        f'<p class="meta">moe_replay {_e(report["moe_replay_version"])} · wall time {_e(fmt(float(report["wall_s"])))} s'
        f" · {len(arms)} arm{'s' if len(arms) != 1 else ''}</p>",
    ]

    parts.append("<h2>Arms</h2>")
    rows = [
        [f'<td><span class="swatch" style="background:{colors[name]}"></span>{_e(name)}</td>',
         _cell(arm["preset"]), _cell(arm["description"]), _cell(len(arm["steps"]))]
        for name, arm in arms.items()
    ]
    parts.append(_table(["arm", "preset", "description", "steps"], rows))

    parts.append("<h2>Per-arm means</h2>")
    keys = mean_keys(report)
    rows = [[f"<td>{_e(name)}</td>"] + [_cell(arm["mean"].get(k, math.nan)) for k in keys] for name, arm in arms.items()]
    parts.append(_table(["arm", *keys], rows))

    parts.append("<h2>Plots</h2>")
    for name, path in pngs.items():
        data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
        caption = PLOTS.get(name, name)
        parts.append(
            f'<figure><img alt="{_e(caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_e(caption)}</figcaption></figure>"
        )

    parts.append("<h2>Setup</h2>")
    parts.append(_table(["setting", "value"], [[f"<td>{_e(k)}</td>", _cell(v)] for k, v in report["setup"].items()]))

    parts.append("<h2>Per-step metrics</h2>")
    for name, arm in arms.items():
        steps = sorted(arm["steps"], key=lambda s: s["step"])
        cols = ["step"] + [k for k in steps[0] if k != "step" and isinstance(steps[0][k], numbers.Real)
                           and not isinstance(steps[0][k], bool)]
        rows = [[_cell(s.get(c, math.nan)) for c in cols] for s in steps]
        parts.append(f"<h3>{_e(name)}</h3>" + _table(cols, rows))

    parts.append("</body></html>")
    return "\n".join(parts)
