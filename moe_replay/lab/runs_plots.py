"""The long runs' curve plot (benchmarks/lab.py --full --plot PATH): one PNG, a row per noise level
and a column per curve (reward smoothed as the collapse rule smooths it, vllm-kl, entropy, clip
fraction), one line per arm (seeds averaged), a collapsed run's line dashed. Drawn like the demo's
plots (a bare Figure on an Agg canvas, report/plots.py); reads only the dict run_long_lab returns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .collapse import COLLAPSE_RULE, parse_level, smoothed
from ..report.plots import _COLORS, _save

PANELS = (("reward", "reward (trailing mean, 10 steps)"), ("vllm_kl", "vllm-kl (k3, trainer vs engine)"),
          ("entropy", "entropy (full vocabulary)"), ("clip_fraction", "PPO clip fraction"))
"""Curve key -> column title."""


def _mean_curve(runs: dict[str, Any], key: str) -> np.ndarray | None:
    ys = [np.asarray(r["curves"][key], dtype=np.float64) for r in runs.values() if key in r["curves"]]
    if not ys:
        return None
    n = min(len(y) for y in ys)
    y = np.nanmean(np.stack([y[:n] for y in ys]), axis=0)
    return smoothed(y, COLLAPSE_RULE.window) if key == "reward" else y


def plot_long_runs(result: dict[str, Any], path: str | Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    arms = list(result["runs"])
    levels = sorted({lv for a in arms for lv in result["runs"][a]}, key=parse_level)
    fig = Figure(figsize=(3.4 * len(PANELS), 2.4 * len(levels) + 0.9), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(levels), len(PANELS), squeeze=False)
    for i, lv in enumerate(levels):
        for j, (key, title) in enumerate(PANELS):
            ax = axes[i][j]
            for k, arm in enumerate(arms):
                runs = result["runs"][arm].get(lv) or {}
                y = _mean_curve(runs, key) if runs else None
                if y is None or not len(y):
                    continue
                x = np.arange(len(y)) + (COLLAPSE_RULE.window - 1 if key == "reward" else 0)
                collapsed = any(r.get("collapsed") for r in runs.values())
                ax.plot(x, y, color=_COLORS[k % len(_COLORS)], lw=1.2, ls="--" if collapsed else "-",
                        label=arm + (" (collapsed)" if collapsed else ""))
            if key == "vllm_kl":
                ax.set_yscale("symlog", linthresh=1e-4)
            ax.set_title(f"{title}\nnoise level {lv}" if i == 0 else f"noise level {lv}", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if i == len(levels) - 1:
                ax.set_xlabel("GRPO step", fontsize=8)
    handles, labels = [], []
    for row in axes:
        for ax in row:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
    fig.legend(handles, labels, loc="outside lower center", ncols=min(4, max(1, len(labels))), fontsize=8, frameon=False)
    fig.suptitle("Long GRPO runs under the engine-noise instrument (vLLM-CPU; not a GPU result)", fontsize=10)
    return _save(fig, Path(path))
