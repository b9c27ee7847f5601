"""Terminal tables: rich when it is installed, aligned plain text otherwise (rich is optional)."""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any, Sequence, TextIO

from .glossary import title as _title

ARM_COLUMNS = tuple((key, _title(key)) for key in ("route_flip_rate", "k3_kl", "max_abs_logprob_diff", "reward"))
"""(mean key, column title) of the per-arm table; the titles are the glossary's (glossary.py)."""


def fmt(value: Any) -> str:
    """Numbers to 4 significant digits (ints as they are); anything else via str."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    if isinstance(value, numbers.Real):
        value = float(value)
        if math.isnan(value):
            return "nan"
        return "0" if value == 0 else f"{value:.4g}"
    return str(value)


def print_table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, file: TextIO | None = None,
    numeric: Sequence[bool] | None = None,
) -> None:
    """Print one table with rich if importable, else as aligned text."""
    file = file or sys.stdout
    cells = [[fmt(c) for c in row] for row in rows]
    numeric = list(numeric) if numeric is not None else [
        bool(rows) and all(isinstance(r[i], numbers.Real) and not isinstance(r[i], bool) for r in rows)
        for i in range(len(columns))
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
        print(title, file=file)
        line = lambda vals: "  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(vals, widths, numeric))
        print(line(list(columns)), file=file)
        print("  ".join("-" * w for w in widths), file=file)
        for r in cells:
            print(line(r), file=file)
        return
    table = Table(title=title, title_justify="left", header_style="bold")
    for i, (c, n) in enumerate(zip(columns, numeric)):
        # names (first column) and numbers never wrap; long free text folds
        table.add_column(c, justify="right" if n else "left", no_wrap=n or i == 0, overflow="fold")
    for r in cells:
        table.add_row(*r)
    console = Console(file=file)
    if not console.is_terminal:  # a pipe or file: do not squeeze tables into 80 columns
        console = Console(file=file, width=120)
    console.print(table)


def arm_rows(report: dict) -> list[list[Any]]:
    """One row per arm: name, preset, then the means of ARM_COLUMNS."""
    return [
        [name, arm.get("preset", ""), *(arm["mean"].get(key, math.nan) for key, _ in ARM_COLUMNS)]
        for name, arm in report["arms"].items()
    ]


def print_arm_table(report: dict, *, file: TextIO | None = None) -> None:
    """Print the per-arm table (route-flip rate, k3-KL, max |Δ logprob|, reward means)."""
    from .schema import validate_report

    validate_report(report)
    print_table(
        "moe_replay demo: per-arm means",
        [_title("arm"), _title("preset"), *(title for _, title in ARM_COLUMNS)],
        arm_rows(report),
        file=file,
        numeric=[False, False] + [True] * len(ARM_COLUMNS),
    )
