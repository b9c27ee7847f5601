"""The demo report's engine-noise section (report["engine_noise"], written by moe_replay/demo/noisy.py):
its tables (HTML and terminal), its one plot and the columns the glossary explains (schema.py checks it).

The section is optional: a report without it (`demo --no-noise`, or written before it existed)
renders as before. Its numbers come from the engine-noise instrument (moe_replay/noise.py), and
every place that shows them says so.

    {"label": str, "noise": {EngineNoise}, "setup": {...},
     "estimator": {"var": {n: f}, "variance_ratio": {n: f | None}, "pi_old_abs_diff": {n: f},
                   "pi_old_max_abs_diff": {n: f}, "estimates": {n: int}, "rollouts": int, "tokens": int},
     "phantom_clip": {"clip_eps": f, "n": int, "rollout_logprobs": f, "estimate": f, ...}   (optional)
     ...}
"""

from __future__ import annotations

import html
import math
import numbers
from pathlib import Path
from typing import Any, TextIO

from .schema import NOISE_SECTION
NOISE_PLOT = "pi_old_variance"
"""The section's plot (also its PNG file stem); drawn only when the report has the section."""
NOISE_PLOT_CAPTION = "variance of the multi-sample π_old vs the replicas n it averages, under the engine-noise instrument"
BY_N_COLUMNS = ("n", "pi_old_abs_diff", "pi_old_max_abs_diff", "pi_old_var", "pi_old_variance_ratio", "inverse_n")
"""The section's per-n table (report.json: engine_noise.estimator.<key>.<n>; the ratio's key there is variance_ratio)."""
CLIP_COLUMNS = ("pi_old_source", "phantom_clip_fraction")
"""The section's phantom-clip table."""
_BY_N_KEYS = {"pi_old_abs_diff": "pi_old_abs_diff", "pi_old_max_abs_diff": "pi_old_max_abs_diff", "pi_old_var": "var",
              "pi_old_variance_ratio": "variance_ratio"}
"""Table column -> its dict in engine_noise.estimator."""


def has_section(report: dict) -> bool:
    return NOISE_SECTION in report


def by_n_rows(report: dict) -> list[dict[str, Any]]:
    """One dict per n (ascending) with the BY_N_COLUMNS keys (None where not measured)."""
    est = report[NOISE_SECTION]["estimator"]
    rows = []
    for n in sorted(int(k) for k in est["var"]):
        row: dict[str, Any] = {"n": n, "inverse_n": 1.0 / n}
        for col, key in _BY_N_KEYS.items():
            row[col] = (est.get(key) or {}).get(str(n))
        if n == 1 and row["pi_old_variance_ratio"] is None and est["var"]["1"]:
            row["pi_old_variance_ratio"] = 1.0
        rows.append(row)
    return rows


def clip_rows(report: dict) -> list[dict[str, Any]]:
    clip = report[NOISE_SECTION].get("phantom_clip")
    if not clip:
        return []
    return [{"pi_old_source": "rollout logprobs (the engine's, as recorded)", "phantom_clip_fraction": clip["rollout_logprobs"]},
            {"pi_old_source": f"estimator, n = {clip['n']}", "phantom_clip_fraction": clip["estimate"]}]


def section_columns(report: dict) -> list[str]:
    """Every column key the section's tables print (what the page's glossary must explain)."""
    if not has_section(report):
        return []
    return [*BY_N_COLUMNS, *(CLIP_COLUMNS if clip_rows(report) else ())]


def plot_pi_old_variance(report: dict, path: Path) -> Path:
    """Variance vs n on log axes with the 1/n line: the lab's plot too (plots.plot_variance), which reads
    `estimator.var`, the key this section shares with lab.json."""
    from .plots import plot_variance

    return plot_variance(report[NOISE_SECTION], path)


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any) -> str:
    from .tables import fmt

    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return '<td class="na">n/a</td>'
    return f'<td class="num">{_e(fmt(value))}</td>'


def _noise_did(sec: dict) -> str:
    """What the instrument did, from its counters (NoiseState.stats)."""
    roll, score = sec.get("rollout_noise_stats") or {}, sec.get("rescoring_noise_stats") or {}
    parts = []
    if roll.get("route_rows"):
        parts.append(f"router flips on {roll.get('route_rows_flipped')} of {roll['route_rows']} token-layer rows of the rollouts")
    if roll.get("rows"):
        parts.append(f"logits perturbed on {roll.get('rows_perturbed')} of {roll['rows']} rollout rows")
    if score.get("rows"):
        parts.append(f"on {score.get('rows_perturbed')} of {score['rows']} re-scoring rows")
    return "; ".join(parts) or "instrument counters not recorded"


def _counts(estimates: Any) -> str:
    if not isinstance(estimates, dict):
        return "estimate counts not recorded"
    return ", ".join(f"{c} at n = {n}" for n, c in sorted(estimates.items(), key=lambda kv: int(kv[0])))


def section_html(report: dict, png: Path | None) -> str:
    """The page's section (heading, instrument label, per-n table, phantom-clip table, plot)."""
    import base64

    from .glossary import PLOT_GLOSSARY, title
    from .tables import fmt

    sec = report[NOISE_SECTION]
    est, setup = sec["estimator"], sec.get("setup", {})
    head = lambda keys: "".join(f'<th title="{_e(k)}">{_e(title(k))}</th>' for k in keys)  # noqa: E731
    rows = "".join("<tr>" + "".join(_num(r[c]) for c in BY_N_COLUMNS) + "</tr>" for r in by_n_rows(report))
    noise = sec.get("noise", {})
    parts = [
        f'<h2 id="{NOISE_SECTION}">Engine-noise instrument: the multi-sample π_old vs n</h2>',
        f'<p class="note"><b>{_e(sec["label"])}.</b></p>',
        "<p>On the CPU engine every re-score is bit-identical, so the arms above cannot show what averaging does. "
        f"Here the same engine runs under <code>EngineNoise(seed={_e(noise.get('seed'))}, scale={_e(noise.get('scale'))})</code> "
        "(docs/noise.md: batch-composition numerics variants and router flips, calibrated to the H100's figures), "
        f"at the arms' starting weights: {_e(setup.get('rollouts'))} rollouts of one more step of prompts, captured "
        f"({_e(sec.get('traces_marked_noisy'))} traces marked noisy; {_e(_noise_did(sec))}). "
        f"The first {_e(est.get('rollouts'))} ({_e(est.get('tokens'))} tokens) are re-scored {_e(setup.get('replicas'))} "
        f"times each ({_e(setup.get('placement', ''))}), forcing their routes and support, under the logit variants only; "
        "an n-replica π_old is the estimator's average of n of them, and the disjoint groups of n are independent "
        f"estimates ({_e(_counts(est.get('estimates')))}).</p>",
        f"<table><thead><tr>{head(BY_N_COLUMNS)}</tr></thead><tbody>{rows}</tbody></table>",
    ]
    clips = clip_rows(report)
    if clips:
        clip = sec["phantom_clip"]
        body = "".join(f"<tr><td>{_e(r['pi_old_source'])}</td>{_num(r['phantom_clip_fraction'])}</tr>" for r in clips)
        parts.append(
            f"<p>Phantom clipping at the first minibatch (identical weights; trainer with routes and support replayed, "
            f"ε = {_e(fmt(clip['clip_eps']))}, {_e(clip.get('tokens'))} tokens): kept tokens whose ratio π_train / π_old "
            "leaves [1 - ε, 1 + ε] with each π_old.</p>"
            f"<table><thead><tr>{head(CLIP_COLUMNS)}</tr></thead><tbody>{body}</tbody></table>")
    if png is not None:
        data = base64.b64encode(Path(png).read_bytes()).decode("ascii")
        parts.append(f'<figure><img alt="{_e(NOISE_PLOT_CAPTION)}" src="data:image/png;base64,{data}">'
                     f"<figcaption><b>{_e(NOISE_PLOT_CAPTION)}.</b> {_e(PLOT_GLOSSARY.get(NOISE_PLOT, ''))}</figcaption></figure>")
    return "\n".join(parts)


def summary(report: dict) -> dict[str, Any]:
    """The section's headline numbers for the demo's one-line JSON summary."""
    sec = report[NOISE_SECTION]
    est = sec["estimator"]
    out = {"label": sec["label"], "variance_ratio": est["variance_ratio"], "pi_old_abs_diff": est["pi_old_abs_diff"]}
    if sec.get("phantom_clip"):
        clip = sec["phantom_clip"]
        out["phantom_clip"] = {"rollout_logprobs": clip["rollout_logprobs"], f"estimate_n{clip['n']}": clip["estimate"]}
    return out


def print_noise_table(report: dict, *, file: TextIO | None = None) -> None:
    """The per-n table on the terminal (nothing when the report has no section)."""
    if not has_section(report):
        return
    from .glossary import title
    from .tables import print_table

    rows = [[r[c] if r[c] is not None else math.nan for c in BY_N_COLUMNS] for r in by_n_rows(report)]
    print_table("engine noise: the multi-sample π_old vs n (an instrument, not a GPU result; report.html says more)",
                [title(c) for c in BY_N_COLUMNS], rows,
                file=file, numeric=[isinstance(v, numbers.Real) for v in rows[0]] if rows else None)
