"""Human-facing output: the demo report (PNG plots + one self-contained HTML page), terminal
tables, the trace-store summary of `moe-replay inspect` and the benchmark runner of `moe-replay bench`.

matplotlib and rich are optional (the `dev` extra) and imported only inside the functions that
draw or print, so importing this package costs nothing.

    from moe_replay.report import render_report, print_arm_table
    paths = render_report(report_dict, "runs/demo")   # {"route_agreement": Path(...png), ..., "html": Path(...)}
    print_arm_table(report_dict)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .plots import PLOTS
from .schema import ReportSchemaError, validate_report
from .tables import print_arm_table, print_table

HTML_NAME = "report.html"


def render_report(report: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Validate `report` (see `schema`), draw every plot of PLOTS as out_dir/<name>.png and write
    out_dir/report.html with the PNGs embedded. Returns plot name -> PNG path, plus "html"."""
    from .html import build_html
    from .noise_section import NOISE_PLOT, has_section, plot_pi_old_variance
    from .plots import render_plots

    validate_report(report)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = render_plots(report, out)
    if has_section(report):  # the engine-noise section's plot (noise_section.py)
        paths[NOISE_PLOT] = plot_pi_old_variance(report, out / f"{NOISE_PLOT}.png")
    html_path = out / HTML_NAME
    tmp = html_path.with_suffix(".html.tmp")
    tmp.write_text(build_html(report, paths), encoding="utf-8")
    os.replace(tmp, html_path)
    return {**paths, "html": html_path}


def load_report(path: str | os.PathLike) -> dict:
    """Read and validate a report JSON file (FileNotFoundError, ReportSchemaError on bad content)."""
    p = Path(path)
    data = p.read_bytes()
    try:
        report = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ReportSchemaError(f"{str(p)!r}: expected UTF-8 JSON text, found byte {data[err.start]:#04x} "
                                f"at offset {err.start}") from None
    except json.JSONDecodeError as err:
        raise ReportSchemaError(f"{str(p)!r}: expected JSON text, found {'an empty file' if not data.strip() else f'text that is not valid JSON ({err})'}") from None
    return validate_report(report)


__all__ = [
    "HTML_NAME",
    "PLOTS",
    "ReportSchemaError",
    "load_report",
    "print_arm_table",
    "print_table",
    "render_report",
    "validate_report",
]
