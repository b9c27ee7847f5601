"""The API reference builds from the docstrings with no warning (`mkdocs build --strict`, what `make
docs` runs), one page per module of the installed package, found from the tree (scripts/mkdocs_api.py).

The docs toolchain is the `docs` extra, which `make install` (scripts/bootstrap.py) installs for CI
and `make test`: where it is missing these tests fail naming it, never skip, so a CI image without
it cannot pass with the reference unbuilt."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS_MODULES = {"mkdocs": "mkdocs", "mkdocstrings": "mkdocstrings", "mkdocstrings-python": "mkdocstrings_handlers.python"}
"""Distribution of the docs extra -> the module `mkdocs build` imports from it."""


def test_docs_toolchain_is_installed_and_bootstrapped():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["docs"]
    assert sorted(re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0] for req in extra) == sorted(DOCS_MODULES)
    bootstrap = (ROOT / "scripts" / "bootstrap.py").read_text()
    extras = re.search(r'^PROJECT_EXTRAS = "([^"]*)"', bootstrap, re.M)
    assert extras and "docs" in extras.group(1).split(","), "scripts/bootstrap.py must install the docs extra"
    missing = [dist for dist, mod in DOCS_MODULES.items() if importlib.util.find_spec(mod.split(".")[0]) is None
               or importlib.util.find_spec(mod) is None]
    assert not missing, (f"the docs extra is not installed here (missing {missing}): run `make install` "
                         "(scripts/bootstrap.py installs moe_replay[docs]) or pip install -e '.[docs]'")


def _hook():
    spec = importlib.util.spec_from_file_location("mkdocs_api", ROOT / "scripts" / "mkdocs_api.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    test_docs_toolchain_is_installed_and_bootstrapped()  # a missing toolchain fails here, by name
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
