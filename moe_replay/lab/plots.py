"""The lab report's plots (`moe-replay lab`), one PNG each, drawn like the demo's (report/plots.py: a bare
Figure on an Agg canvas, no pyplot state), from the dict `run_lab` returns (lab.json).

Each plot reads only what lab.json holds: arms.<arm>.phantom_clip_fraction,
arms.<arm>.grad_cos_to_reference {value, ci95}, estimator.var {n: variance}.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ..report.plots import _figure, _save, arm_colors, plot_variance

LAB_PLOTS = {
    "lab_phantom_clip": "phantom-clip fraction per arm (first minibatch, identical weights)",
    "lab_grad_cos": "gradient cosine to the on-policy reference per arm, with its 95% bootstrap interval",
    "lab_variance": "variance of π_old vs the replicas n averaged (log-log), with the 1/n line",
}
"""Plot name (also the PNG file stem) -> what it shows."""


def grad_cos_points(lab: dict) -> dict[str, tuple[float, float, float]]:
    """Arm -> (cosine, interval low, interval high) from lab.json (nan where a value is missing)."""
    out = {}
    for name, arm in lab["arms"].items():
        g = arm.get("grad_cos_to_reference") or {}
        lo, hi = (g.get("ci95") or [None, None])[:2]
        out[name] = tuple(math.nan if v is None else float(v) for v in (g.get("value"), lo, hi))
    return out


def plot_phantom_clip(lab: dict, path: Path) -> Path:
    colors = arm_colors(lab)
    names = list(lab["arms"])
    ys = [float(lab["arms"][n]["phantom_clip_fraction"]) for n in names]
    fig, ax = _figure(max(6.0, 1.1 * len(names) + 2.0))
    bars = ax.bar(np.arange(len(names)), ys, color=[colors[n] for n in names])
    for bar, y in zip(bars, ys):  # the value on each bar: a 0 has no bar to see
        ax.annotate(f"{100 * y:.2f}%", (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(np.arange(len(names)), names, rotation=20, ha="right", fontsize=9)
    ax.set_ylim(0, max(ys + [1e-3]) * 1.2)
    ax.set_ylabel("fraction of kept tokens clipped")
    ax.set_title("Phantom clipping per arm (first minibatch, identical weights)", fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_grad_cos(lab: dict, path: Path) -> Path:
    colors = arm_colors(lab)
    pts = grad_cos_points(lab)
    names = list(pts)
    fig, ax = _figure(max(6.0, 1.1 * len(names) + 2.0))
    x = np.arange(len(names))
    for i, name in enumerate(names):
        cos, lo, hi = pts[name]
        err = [[cos - lo], [hi - cos]] if math.isfinite(lo) and math.isfinite(hi) else None
        ax.errorbar([x[i]], [cos], yerr=err, fmt="o", ms=7, capsize=5, lw=1.6, color=colors[name])
    finite = [v for p in pts.values() for v in p if math.isfinite(v)]
    if finite:  # cosines sit near 1: start the axis below the lowest interval, as its label says
        bottom = max(-1.0, min(finite) - 0.1 * max(1.0 - min(finite), 1e-3))
        ax.set_ylim(bottom, 1.0 + 0.05 * (1.0 - bottom))
        ax.set_ylabel(f"cosine to the reference (axis from {bottom:.3g})")
    else:
        ax.set_ylabel("cosine to the reference")
    ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
    ax.set_xticks(x, names, rotation=20, ha="right", fontsize=9)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_title("Gradient cosine to the on-policy reference, 95% bootstrap interval", fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


LAB_PLOTTERS: dict[str, Any] = {
    "lab_phantom_clip": plot_phantom_clip,
    "lab_grad_cos": plot_grad_cos,
    "lab_variance": plot_variance,
}


def render_lab_plots(lab: dict, out_dir: Path) -> dict[str, Path]:
    """Every plot of LAB_PLOTS as out_dir/<name>.png; returns name -> path."""
    return {name: LAB_PLOTTERS[name](lab, Path(out_dir) / f"{name}.png") for name in LAB_PLOTS}
