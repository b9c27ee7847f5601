"""The API reference builds from the docstrings with no warning (`mkdocs build --strict`, what `make
docs` runs), one page per module of the installed package, found from the tree (scripts/mkdocs_api.py)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")

ROOT = Path(__file__).resolve().parent.parent


def _hook():
    spec = importlib.util.spec_from_file_location("mkdocs_api", ROOT / "scripts" / "mkdocs_api.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    shutil.rmtree(ROOT / _hook().SOURCE_TREE, ignore_errors=True)  # as in a fresh clone: the hook makes it
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stderr[-4000:]}"
    return out


def test_every_module_has_a_page(site):
    names = _hook().modules(ROOT)
    assert {"moe_replay.replay.gates", "moe_replay.integrations.hf.replay", "moe_replay.integrations.vllm.capture.api",
            "moe_replay.integrations.vllm.scoring.scorer"} <= set(names)
    missing = [n for n in names if not (site / "api" / n / "index.html").exists()]
    assert not missing, missing
    index = (site / "api" / "index.html").read_text()
    assert all(f"{n}/" in index for n in names)


def test_pages_hold_the_docstrings(site):
    gates = (site / "api" / "moe_replay.replay.gates" / "index.html").read_text()
    assert "GateSpec" in gates and "upcast" in gates
    replay = (site / "api" / "moe_replay.integrations.hf.replay" / "index.html").read_text()
    assert "self_replay_gap" in replay


def test_modules_are_read_from_the_tree(tmp_path):
    (tmp_path / "moe_replay" / "sub").mkdir(parents=True)
    (tmp_path / "integrations" / "vllm").mkdir(parents=True)
    for f in ("moe_replay/__init__.py", "moe_replay/sub/__init__.py", "moe_replay/sub/mod.py",
              "integrations/__init__.py", "integrations/vllm/__init__.py", "integrations/vllm/x.py"):
        (tmp_path / f).write_text('"""doc."""\n')
    assert _hook().modules(tmp_path) == ["moe_replay", "moe_replay.integrations", "moe_replay.integrations.vllm",
                                         "moe_replay.integrations.vllm.x", "moe_replay.sub", "moe_replay.sub.mod"]
