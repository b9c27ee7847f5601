"""The README's measured figures come from docs/benchmarks.md and name their machine: its demo table
and headline equal the latest `moe-replay demo` row, and `make test`'s duration is the same in the
README, the Makefile and its benchmark row."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
MAKEFILE = ROOT / "Makefile"

NUM = r"(?:\d+(?:\.\d+)?(?:e[+-]?\d+)?)"
ARM_FIGURES = re.compile(rf"`(\w+)` ({NUM}) / ({NUM}) / ({NUM}) / ({NUM})")
"""`arm` flip / k3-KL / max |Δ logprob| / reward, as the demo row writes them."""
MACHINE = re.compile(r"CPU: (.+?) x (\d+) cores.*?(\d{4}-\d{2}-\d{2})\s*$")
"""The machine cell: 'CPU: <model> x <n> cores, ..., <date>'."""
TEST_MINUTES = re.compile(r"~(\d+) min")


def _cells(line: str) -> list[str]:
    """A markdown table row's cells (escaped pipes `\\|` stay inside their cell)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _rows(text: str) -> list[list[str]]:
    return [_cells(line) for line in text.splitlines() if line.startswith("|") and not line.startswith("| ---")]


def demo_row(benchmarks: str) -> dict:
    """The latest (by date) `moe-replay demo` row: {"arms": {arm: (flip, k3, max, reward)}, machine, cores, date}."""
    found = []
    for cells in _rows(benchmarks):
        if len(cells) == 4 and "moe-replay demo" in cells[0]:
            machine = MACHINE.search(cells[3])
            arms = {m.group(1): tuple(float(m.group(i)) for i in range(2, 6)) for m in ARM_FIGURES.finditer(cells[1])}
            assert machine and arms, f"docs/benchmarks.md: demo row unreadable: {cells}"
            found.append({"arms": arms, "machine": machine.group(1), "cores": machine.group(2), "date": machine.group(3)})
    assert found, "docs/benchmarks.md has no `moe-replay demo` row"
    return max(found, key=lambda r: r["date"])


def readme_demo_section(readme: str) -> tuple[str, dict[str, tuple[float, ...]]]:
    """(the paragraph above the README's demo table, {arm: (flip, k3, max, reward)} of the table)."""
    lines = readme.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| arm | route-flip rate"))
    columns = _cells(lines[head])
    want = ["arm", "route-flip rate", "k3-KL (train vs rollout)", "max \\|Δ logprob\\|", "mean reward"]
    assert columns == want, f"README demo table header changed: {columns}"
    table = {}
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        table[cells[0]] = tuple(float(c) for c in cells[1:])
    end = head
    while end > 0 and not lines[end - 1].strip():
        end -= 1
    start = max((i for i in range(end) if not lines[i].strip()), default=-1) + 1
    return "\n".join(lines[start:end]), table


def test_readme_demo_table_is_the_latest_benchmark_row():
    row = demo_row(BENCHMARKS.read_text())
    paragraph, table = readme_demo_section(README.read_text())
    assert table == row["arms"], f"README demo table {table} != docs/benchmarks.md's latest demo row {row['arms']}"
    flat = " ".join(paragraph.split())
    assert f"{row['machine']} x {row['cores']} cores, {row['date']}" in flat, (
        f"the README's demo paragraph must name the machine and date of the row: {row['machine']!r}, {row['date']}")


def test_readme_headline_is_the_demo_row():
    row = demo_row(BENCHMARKS.read_text())
    text = " ".join(README.read_text().split())
    m = re.search(rf"route flips \*\*({NUM})% -> 0\*\* and train-vs-rollout k3-KL \*\*({NUM}) -> ({NUM})\*\*", text)
    assert m, "README headline: route flips / k3-KL figures not found"
    none, replay = row["arms"]["none"], row["arms"]["r3_support"]
    assert float(m.group(1)) == pytest.approx(100 * none[0], abs=0.05)
    assert (float(m.group(2)), float(m.group(3))) == (none[1], replay[1])
    assert row["machine"].split(" (")[0] in text[:m.start()][-200:], "the headline names the machine"


def test_make_test_duration_is_one_figure():
    rows = [c for c in _rows(BENCHMARKS.read_text()) if len(c) == 4 and c[0].startswith("`make test`")]
    assert len(rows) == 1, "one `make test` row in docs/benchmarks.md"
    minutes = TEST_MINUTES.search(rows[0][1]).group(1)
    readme_line = next(line for line in README.read_text().splitlines() if line.startswith("make test "))
    make_line = next(line for line in MAKEFILE.read_text().splitlines() if line.startswith("# Every test"))
    assert TEST_MINUTES.findall(readme_line) == [minutes], readme_line
    assert TEST_MINUTES.findall(make_line) == [minutes], make_line
    assert MACHINE.search(rows[0][3]), "the `make test` row names its machine"


def test_the_checks_can_fail():
    bench = ("| `moe-replay demo` | `none` 0.030 / 2.42e-2 / 2.18 / 0.148; `r3` 0 / 1.31e-3 / 0.259 / 0.142 | | "
             "CPU: X (y) x 2 cores, 2026-01-02 |\n"
             "| `moe-replay demo` | `none` 0.031 / 2.4e-2 / 2.1 / 0.1 | | CPU: Z x 4 cores, 2026-02-01 |")
    row = demo_row(bench)
    assert row["machine"] == "Z" and row["cores"] == "4" and row["arms"] == {"none": (0.031, 2.4e-2, 2.1, 0.1)}
    readme = ("text\n\nOn Z x 4 cores, 2026-02-01:\n\n| arm | route-flip rate | k3-KL (train vs rollout) | "
              "max \\|Δ logprob\\| | mean reward |\n| --- | --- | --- | --- | --- |\n| none | 0.031 | 2.4e-2 | 2.1 | 0.2 |\n")
    paragraph, table = readme_demo_section(readme)
    assert paragraph == "On Z x 4 cores, 2026-02-01:" and table != row["arms"]
