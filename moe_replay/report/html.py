"""One self-contained HTML page for a demo report: inline CSS, PNGs embedded as base64 data URIs,
no scripts and no external resources (it opens offline and can be mailed as one file)."""

from __future__ import annotations

import base64
import html
import json
import math
import numbers
from pathlib import Path
from typing import Any, Callable

from .glossary import NOT_MEASURED, PLOT_GLOSSARY, lookup, title
from .noise_section import NOISE_PLOT, has_section, section_columns, section_html
from .plots import PLOTS, arm_colors, coincide_note, coinciding, summed_histogram
from .schema import MEAN_KEYS
from .tables import ARM_COLUMNS, fmt

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
figcaption { color: #555; font-size: 0.9em; } .note { color: #8a4b00; }
code { font-size: 0.9em; } td.na { color: #999; text-align: center; }
"""

ARMS_COLUMNS = ("arm", "preset", "description", "steps")
SETUP_COLUMNS = ("setting", "value")


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _cell(value: Any) -> str:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return f'<td class="num">{_e(fmt(value))}</td>'
    if isinstance(value, (dict, list)):
        return f"<td><code>{_e(json.dumps(value, default=str))}</code></td>"
    return f"<td>{_e(value)}</td>"


def _na() -> str:
    return f'<td class="na" title="not measured in this arm">{NOT_MEASURED}</td>'


def _table(keys: list[str], rows: list[list[str]], title_of: Callable[[str], str] = title) -> str:
    """A table headed by the glossary titles of `keys` (the raw key as each header's tooltip)."""
    head = "".join(f'<th title="{_e(k)}">{_e(title_of(k))}</th>' for k in keys)
    body = "".join("<tr>" + "".join(r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def mean_keys(report: dict) -> list[str]:
    """The required means first, then every other mean key any arm has, in first-seen order."""
    keys = list(MEAN_KEYS)
    for arm in report["arms"].values():
        keys += [k for k in arm["mean"] if k not in keys]
    return keys


def step_columns(arm: dict) -> list[str]:
    """The per-step table's columns of one arm: "step", then every number its first step carries."""
    first = sorted(arm["steps"], key=lambda s: s["step"])[0]
    return ["step"] + [k for k, v in first.items() if k != "step" and isinstance(v, numbers.Real)
                       and not isinstance(v, bool)]


def table_columns(report: dict) -> list[str]:
    """Every column key any table of the page or the terminal's arm table prints for `report`, in
    order of first appearance: what the glossary section explains."""
    keys = [*ARMS_COLUMNS, *mean_keys(report), *SETUP_COLUMNS, "arm", "preset", *(k for k, _ in ARM_COLUMNS)]
    for arm in report["arms"].values():
        keys += step_columns(arm)
    keys += section_columns(report)
    return list(dict.fromkeys(keys))


def token_count_note(report: dict) -> str:
    """Why the |Δ logprob| histogram's n differs between arms, or '' when every arm has the same n.

    n is what the arm's rollouts generated: every arm samples the same prompts with the same seeds
    and `max_tokens`, but after the first update each arm's policy is its own, and a completion
    that samples its end-of-sequence token early is shorter. Where a step records its generated
    `tokens` and the histogram holds fewer, the rest fell outside the bins (non-finite, or beyond
    the last edge), and the note says how many.
    """
    totals = {name: int(summed_histogram(arm)[1].sum()) for name, arm in report["arms"].items()}
    generated = {name: sum(int(s["tokens"]) for s in arm["steps"]) for name, arm in report["arms"].items()
                 if all(isinstance(s.get("tokens"), numbers.Integral) for s in arm["steps"])}
    outside = {name: generated[name] - totals[name] for name in generated if generated[name] > totals[name]}
    if len(set(totals.values())) <= 1 and not outside:
        return ""
    counts = "; ".join(f"{name} {n:,}" for name, n in totals.items())
    text = (f"Token counts differ between arms ({counts}): n is the number of tokens each arm's rollouts generated. "
            "Every arm samples the same prompts with the same seeds and the same token limit, but after its first "
            "update each arm samples from its own weights, and a completion that draws its end-of-sequence token "
            "before the limit is shorter.")
    setup = report.get("setup", {})
    cap = [setup.get(k) for k in ("steps", "prompts_per_step", "samples_per_prompt", "max_tokens")]
    if all(isinstance(c, numbers.Integral) for c in cap):
        text += f" At most {math.prod(cap):,} per arm ({' x '.join(str(c) for c in cap)}: steps x prompts x samples x max tokens)."
    if outside:
        text += " Outside the histogram's bins (non-finite or beyond its last edge): " + "; ".join(
            f"{name} {n:,} of {generated[name]:,}" for name, n in outside.items()) + "."
    return text


def plot_notes(report: dict) -> dict[str, list[str]]:
    """Plot name -> notes the page prints under it, computed from this report."""
    notes: dict[str, list[str]] = {name: [] for name in PLOTS}
    counts = token_count_note(report)
    if counts:
        notes["logprob_diff_hist"].append(counts)
    k3_positive = any(float(s["k3_kl"]) > 0 for arm in report["arms"].values() for s in arm["steps"])
    for name, key, log in (("k3_kl", "k3_kl", k3_positive), ("reward", "reward", False)):
        note = coincide_note(coinciding(report, key, log=log))
        if note:
            notes[name].append(f"{note[0].upper()}{note[1:]}: their lines lie on one another (told apart by line style and marker).")
    return notes


def _glossary(report: dict) -> str:
    rows = []
    for key in table_columns(report):
        term = lookup(key)
        if term is None:
            rows.append([f"<td>{_e(key)}</td>", f"<td><code>{_e(key)}</code></td>", "<td></td>",
                         '<td class="note">no glossary entry</td>'])
        else:
            rows.append([f"<td>{_e(term.title)}</td>", f"<td><code>{_e(key)}</code></td>", f"<td>{_e(term.unit)}</td>",
                         f"<td>{_e(term.meaning)}</td>"])
    head = "".join(f"<th>{h}</th>" for h in ("column", "key in report.json", "unit", "meaning"))
    body = "".join("<tr>" + "".join(r) + "</tr>" for r in rows)
    return (
        '<h2 id="glossary">Glossary</h2>'
        "<p>Every column of the tables above, with its key in <code>report.json</code>. π_rollout is the engine's "
        "probability of a sampled token, π_train the trainer's for the same token, ρ = π_train / π_rollout; "
        "logprobs are natural logs, so differences are in nats. A per-arm mean is the mean of the per-step values. "
        f"<b>{NOT_MEASURED}</b>: the arm does not measure that metric (its preset has no such step); <b>nan</b> would "
        "mean a step measured it but had no token to average over.</p>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )


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
        f'<p class="meta">moe_replay {_e(report["moe_replay_version"])} · total wall time {_e(fmt(float(report["wall_s"])))} s'
        f" (every arm, with model build and engine start) · {len(arms)} arm{'s' if len(arms) != 1 else ''}</p>",
        "<p>The same GRPO run once per arm; each arm switches on one fix (its preset). The tables compare what the "
        "trainer computed with what the rollout engine did on the same tokens; the <a href=\"#glossary\">glossary</a> "
        "explains every column, its unit and which values can be negative.</p>",
    ]

    parts.append("<h2>Arms</h2>")
    rows = [
        [f'<td><span class="swatch" style="background:{colors[name]}"></span>{_e(name)}</td>',
         _cell(arm["preset"]), _cell(arm["description"]), _cell(len(arm["steps"]))]
        for name, arm in arms.items()
    ]
    parts.append(_table(list(ARMS_COLUMNS), rows))

    parts.append("<h2>Per-arm means</h2>")
    keys = mean_keys(report)
    rows = [[f"<td>{_e(name)}</td>"] + [_cell(arm["mean"][k]) if k in arm["mean"] else _na() for k in keys]
            for name, arm in arms.items()]
    parts.append(_table(["arm", *keys], rows))

    parts.append("<h2>Plots</h2>")
    notes = plot_notes(report)
    for name, path in pngs.items():
        if name == NOISE_PLOT:  # drawn inside its own section below
            continue
        data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
        caption = PLOTS.get(name, name)
        how = PLOT_GLOSSARY.get(name, "")
        extra = "".join(f'<br><span class="note">{_e(n)}</span>' for n in notes.get(name, []))
        parts.append(
            f'<figure><img alt="{_e(caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption><b>{_e(caption)}.</b> {_e(how)}{extra}</figcaption></figure>"
        )

    if has_section(report):
        parts.append(section_html(report, pngs.get(NOISE_PLOT)))

    parts.append("<h2>Setup</h2>")
    parts.append(_table(list(SETUP_COLUMNS), [[f"<td>{_e(k)}</td>", _cell(v)] for k, v in report["setup"].items()]))

    parts.append("<h2>Per-step metrics</h2>")
    for name, arm in arms.items():
        steps = sorted(arm["steps"], key=lambda s: s["step"])
        cols = step_columns(arm)
        rows = [[_cell(s[c]) if c in s else _na() for c in cols] for s in steps]
        parts.append(f"<h3>{_e(name)}</h3>" + _table(cols, rows))

    parts.append(_glossary(report))
    parts.append("</body></html>")
    return "\n".join(parts)
