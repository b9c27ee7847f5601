"""The demo report's plots, one PNG each, drawn with matplotlib's Agg canvas.

matplotlib is imported inside the functions (it is an optional dependency) and pyplot is never
used: each figure is a bare `Figure` on a `FigureCanvasAgg`, so rendering changes no global
backend or state of the calling process (the demo calls this in-process).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

PLOTS = {
    "route_agreement": "route agreement per MoE layer (1 - route flip rate), mean over steps",
    "logprob_diff_hist": "|Δ logprob| between engine and trainer per token, all steps",
    "k3_kl": "k3-KL between the engine's and the trainer's token distributions, per step",
    "reward": "mean reward per step",
}
"""Plot name (also the PNG file stem) -> what it shows."""

_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
_LINES = [("-", "o", 4.0), ("--", "s", 7.0), (":", "^", 10.0), ("-.", "D", 5.5), ((0, (5, 1, 1, 1)), "v", 8.5)]
"""(line style, marker, marker size) per arm: where two arms' lines coincide, the later arm's dashes
and its larger hollow markers still show around the earlier one's."""

COINCIDE_TOL = 0.004
"""Two per-step series coincide when they differ by at most this fraction of the axis span at every
step (0.4% of the span is under a line width of a 4.2-inch plot): drawn on one another, one would
hide the other, so the plot and the page name them."""


def arm_colors(report: dict) -> dict[str, str]:
    """One fixed color per arm, in report order, shared by every plot and the HTML tables."""
    return {arm: _COLORS[i % len(_COLORS)] for i, arm in enumerate(report["arms"])}


def arm_lines(report: dict) -> dict[str, tuple[Any, str, float]]:
    """One fixed (line style, marker, marker size) per arm, in report order, for the per-step plots."""
    return {arm: _LINES[i % len(_LINES)] for i, arm in enumerate(report["arms"])}


def coinciding(report: dict, key: str, *, log: bool = False) -> list[list[str]]:
    """Groups (in report order) of two or more arms whose per-step `key` lines would lie on one
    another: same steps, and at every step within COINCIDE_TOL of the axis span (on a log axis,
    of log10 values; non-positive values there compare exactly)."""
    series = {name: _per_step(arm, key) for name, arm in report["arms"].items()}

    def shown(y: np.ndarray) -> np.ndarray:
        if not log:
            return y
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(y > 0, np.log10(np.where(y > 0, y, 1.0)), -np.inf)

    values = {name: shown(y) for name, (_, y) in series.items()}
    finite = np.concatenate([v[np.isfinite(v)] for v in values.values()])
    span = float(finite.max() - finite.min()) if len(finite) else 0.0
    tol = COINCIDE_TOL * span if span > 0 else 0.0
    groups: list[list[str]] = []
    placed: set[str] = set()
    names = list(series)
    for i, a in enumerate(names):
        if a in placed:
            continue
        group = [a]
        for b in names[i + 1:]:
            if b in placed or not np.array_equal(series[a][0], series[b][0]):
                continue
            va, vb = values[a], values[b]
            both = np.isfinite(va) & np.isfinite(vb)
            same_nonfinite = np.array_equal(va[~both], vb[~both], equal_nan=True)
            if same_nonfinite and bool(np.all(np.abs(va[both] - vb[both]) <= tol)):
                group.append(b)
        if len(group) > 1:
            groups.append(group)
            placed.update(group)
    return groups


def coincide_note(groups: list[list[str]]) -> str:
    """'arms r3_support and r3_support_multisample coincide' (one clause per group), or ''."""
    clauses = []
    for g in groups:
        names = ", ".join(g[:-1]) + f" and {g[-1]}"
        clauses.append(f"arms {names} coincide")
    return "; ".join(clauses)


def _figure(width: float = 7.5, height: float = 4.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _legend(fig, ax) -> None:
    """Legend below the axes, one row per three arms, so it never covers data."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        # long labels (arm names + notes) wrap to fewer columns so the legend stays inside the figure
        ncols = min(3, len(handles)) if max(len(x) for x in labels) <= 28 else min(2, len(handles))
        fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=9, frameon=False)


def layer_agreement(arm: dict) -> dict[int, float]:
    """Mean over steps of each MoE layer's route agreement (steps lacking a layer are skipped)."""
    sums: dict[int, list[float]] = {}
    for step in arm["steps"]:
        for layer, value in step["route_agreement_per_layer"].items():
            sums.setdefault(int(layer), []).append(float(value))
    return {layer: float(np.nanmean(v)) for layer, v in sorted(sums.items())}


def plot_route_agreement(report: dict, path: Path) -> Path:
    arms = report["arms"]
    colors = arm_colors(report)
    per_arm = {name: layer_agreement(arm) for name, arm in arms.items()}
    layers = sorted({layer for d in per_arm.values() for layer in d})
    fig, ax = _figure(min(12.0, max(7.5, 2.0 + 0.12 * len(layers) * max(len(arms), 1))))
    x = np.arange(len(layers))
    width = 0.8 / max(len(arms), 1)
    lo = 1.0
    for i, (name, d) in enumerate(per_arm.items()):
        ys = np.array([d.get(layer, math.nan) for layer in layers])
        ax.bar(x - 0.4 + width * (i + 0.5), ys, width, label=name, color=colors[name])
        if np.isfinite(ys).any():
            lo = min(lo, float(np.nanmin(ys)))
    # agreement sits near 1 for every arm; start the axis just below the lowest bar so the
    # differences are visible (the axis label says where it starts)
    bottom = min(max(0.0, 1.0 - 1.25 * (1.0 - lo)), 0.99)
    ax.set_ylim(bottom, 1.0 + (1.0 - bottom) * 0.04)
    ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
    step = max(1, math.ceil(len(layers) / 32))  # at most ~32 tick labels
    ax.set_xticks(x[::step], [str(layer) for layer in layers][::step], fontsize=8 if len(layers) > 16 else 10)
    ax.set_xlim(-0.6, len(layers) - 0.4)
    ax.set_xlabel("MoE layer id")
    ax.set_ylabel(f"route agreement (axis from {bottom:.3g})")
    ax.set_title("Route agreement per MoE layer (1 - flip rate), mean over steps")
    ax.grid(axis="y", alpha=0.3)
    _legend(fig, ax)
    return _save(fig, path)


def summed_histogram(arm: dict) -> tuple[np.ndarray, np.ndarray]:
    """(edges [n + 1], counts [n]) summed over an arm's steps (the schema checks the edges agree)."""
    edges = np.asarray(arm["steps"][0]["abs_logprob_diff_hist"]["edges"], dtype=np.float64)
    counts = np.zeros(len(edges) - 1, dtype=np.int64)
    for step in arm["steps"]:
        counts += np.asarray(step["abs_logprob_diff_hist"]["counts"], dtype=np.int64)
    return edges, counts


def _displayable_edges(edges: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Edges usable on a log axis: a first edge <= 0 (the bin of exact zeros / underflow) and an
    infinite last edge (overflow) are drawn one decade beyond their neighbour; notes say so."""
    shown, notes = edges.astype(np.float64).copy(), []
    positive = shown[np.isfinite(shown) & (shown > 0)]
    if len(positive) == 0:
        return shown, notes
    if shown[0] <= 0:
        shown[0] = positive.min() / 10
        notes.append(f"first bin [{edges[0]:g}, {edges[1]:.3g}) drawn from {shown[0]:.1g}")
    if not np.isfinite(shown[-1]):
        shown[-1] = positive.max() * 10
        notes.append(f"last bin [{edges[-2]:.3g}, ∞) drawn to {shown[-1]:.1g}")
    return shown, notes


def plot_logprob_diff_hist(report: dict, path: Path) -> Path:
    colors = arm_colors(report)
    fig, ax = _figure()
    notes: list[str] = []
    any_log = any_count = False
    for name, arm in report["arms"].items():
        edges, counts = summed_histogram(arm)
        shown, arm_notes = _displayable_edges(edges)
        notes += [n for n in arm_notes if n not in notes]
        total = counts.sum()
        frac = counts / total if total else counts.astype(np.float64)
        any_log = any_log or bool((shown > 0).all())
        any_count = any_count or bool(total)
        label = f"{name} (n={int(total):,})"
        ax.stairs(frac, shown, label=label, color=colors[name], lw=1.8)
        ax.stairs(frac, shown, color=colors[name], alpha=0.12, fill=True)
    if any_log:
        ax.set_xscale("log")
    if any_count:
        ax.set_yscale("log")
    ax.set_xlabel("|Δ logprob| of the sampled token (engine vs trainer)")
    ax.set_ylabel("fraction of tokens")
    ax.set_title("|Δ logprob| per token, all steps" + (f"\n({'; '.join(notes)})" if notes else ""), fontsize=11)
    ax.grid(alpha=0.3, which="major")
    _legend(fig, ax)
    return _save(fig, path)


def _per_step(arm: dict, key: str) -> tuple[np.ndarray, np.ndarray]:
    steps = sorted(arm["steps"], key=lambda s: s["step"])
    return np.array([s["step"] for s in steps]), np.array([float(s[key]) for s in steps])


def plot_k3_kl(report: dict, path: Path) -> Path:
    colors, lines = arm_colors(report), arm_lines(report)
    fig, ax = _figure()
    series = {name: _per_step(arm, "k3_kl") for name, arm in report["arms"].items()}
    positive = np.concatenate([y[np.isfinite(y) & (y > 0)] for _, y in series.values()])
    floor = positive.min() / 10 if len(positive) else None
    clipped = 0
    for name, (x, y) in series.items():
        label = name
        if floor is not None:
            low = np.isfinite(y) & (y < floor)
            if low.any():  # exact zeros cannot sit on a log axis: hollow triangles on the floor, dotted
                clipped += int(low.sum())
                label += f" (< {floor:.2g} at {int(low.sum())} step{'s' if low.sum() > 1 else ''})"
                ax.plot(x[low], np.full(int(low.sum()), floor), ls="none", marker="v", ms=6, mfc="none",
                        mec=colors[name], mew=1.4)
            ax.plot(x, np.where(low, floor, y), color=colors[name], lw=1.0, ls=":" if low.all() else "-", alpha=0.8)
            y = np.where(low, np.nan, y)
        ls, marker, ms = lines[name]
        ax.plot(x, y, marker=marker, ms=ms, mfc="none", mew=1.2, ls=ls, lw=1.6, color=colors[name], label=label)
    if floor is not None:
        ax.set_yscale("log")
        ax.set_ylim(bottom=floor / 2)
    title = "k3-KL per step (log scale)" if floor is not None else "k3-KL per step (all zero)"
    if clipped:
        title += f"\n(▽ on the floor {floor:.2g}: values below it, e.g. exact zeros)"
    note = coincide_note(coinciding(report, "k3_kl", log=floor is not None))
    if note:
        title += f"\n({note})"
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel("k3-KL (nats per token)")
    ax.grid(alpha=0.3, which="both" if floor is not None else "major")
    _legend(fig, ax)
    return _save(fig, path)


def plot_reward(report: dict, path: Path) -> Path:
    colors, lines = arm_colors(report), arm_lines(report)
    fig, ax = _figure()
    for name, arm in report["arms"].items():
        x, y = _per_step(arm, "reward")
        ls, marker, ms = lines[name]
        ax.plot(x, y, marker=marker, ms=ms, mfc="none", mew=1.2, ls=ls, label=name, color=colors[name], lw=1.6)
    note = coincide_note(coinciding(report, "reward"))
    ax.set_title("Mean reward per step" + (f"\n({note})" if note else ""), fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward of the step")
    ax.grid(alpha=0.3)
    _legend(fig, ax)
    return _save(fig, path)


PLOTTERS: dict[str, Any] = {
    "route_agreement": plot_route_agreement,
    "logprob_diff_hist": plot_logprob_diff_hist,
    "k3_kl": plot_k3_kl,
    "reward": plot_reward,
}


def variance_points(lab: dict) -> tuple[np.ndarray, np.ndarray]:
    """(n [K], variance of π_old [K]) sorted by n, from estimator.var (keys are n as strings)."""
    var = (lab.get("estimator") or {}).get("var") or {}
    pairs = sorted((int(n), math.nan if v is None else float(v)) for n, v in var.items())
    return np.array([p[0] for p in pairs], dtype=np.int64), np.array([p[1] for p in pairs], dtype=np.float64)


def plot_variance(lab: dict, path: Path) -> Path:
    """Variance of π_old vs n on log axes with the 1/n line, from `estimator.var` of lab.json or of the
    demo report's noise section (the two share the key)."""
    n, var = variance_points(lab)
    fig, ax = _figure(6.5, 4.2)
    ok = np.isfinite(var) & (var > 0)
    ax.plot(n[ok], var[ok], "o-", ms=7, lw=1.8, color="#1f77b4", label="measured variance of π_old")
    base = var[n == 1]
    if len(base) and np.isfinite(base[0]) and base[0] > 0:
        grid = np.geomspace(max(1, int(n.min())), max(2, int(n.max())), 50)
        ax.plot(grid, base[0] / grid, "--", color="0.4", lw=1.2, label="n = 1's variance x 1/n")
    if len(n):
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(int(v)) for v in n])
        ax.set_xlim(n.min() / 1.3, n.max() * 1.3)
    if ok.any():
        ax.set_yscale("log")
        ax.legend(fontsize=9, frameon=False)
    else:  # nothing to draw on a log axis: say why instead of an empty frame
        ax.text(0.5, 0.5, "no positive variance at any n:\nthe re-scorings of these tokens agreed exactly",
                transform=ax.transAxes, ha="center", va="center", fontsize=10, color="0.3")
        ax.set_yticks([])
    zero = int((~ok).sum())
    title = "Variance of π_old vs replicas n"
    if zero:
        title += f"\n({zero} n with a zero or missing variance not drawn)"
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("replicas n averaged by the estimator")
    ax.set_ylabel("variance of π_old (probability²)")
    ax.grid(alpha=0.3, which="both")
    return _save(fig, path)


def render_plots(report: dict, out_dir: Path) -> dict[str, Path]:
    """Every plot of PLOTS as out_dir/<name>.png; returns name -> path (report already validated)."""
    return {name: PLOTTERS[name](report, Path(out_dir) / f"{name}.png") for name in PLOTS}
