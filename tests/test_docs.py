"""The README and docs/ as a user reads them: every relative link resolves to a file of the
repository, and no project-history words (issue numbers, session or branch names) stand in them;
history lives in git."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HISTORY = re.compile(r"\b([Ii]ssue #?\d+|[Ss]ession \d+(?![.\d])|capov|verlturns|verlstep|estrep|trlstep|forcec)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    missing = [t for t in LINK.findall(doc.read_text()) if "://" not in t and not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(ROOT)}: links to missing files {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_project_history_words(doc: Path):
    hits = [f"line {i}: {m.group(0)!r}" for i, line in enumerate(doc.read_text().splitlines(), 1)
            for m in HISTORY.finditer(line)]
    assert not hits, f"{doc.relative_to(ROOT)}: {hits[:8]}"


def test_the_checks_can_fail(tmp_path):
    assert HISTORY.search("as issue 23 found") and HISTORY.search("(verlturns session)")
    assert not HISTORY.search("the replay session 1.3 ms")
    assert LINK.findall("see [x](docs/none.md) and [y](https://example.org)") == ["docs/none.md", "https://example.org"]
