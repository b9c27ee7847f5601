"""What a pip user gets: the wheel and sdist carry the license and the metadata (license expression, every
extra), `moe-replay --version` answers, and a missing optional dependency ends in one line naming the
extra to install (moe_replay/extras.py), from every entry point that needs one.

The distributions are built from this checkout with the venv's setuptools (no build isolation, no
registry); a missing package is simulated in a child interpreter by a finder that refuses its import,
never by uninstalling it. Whether the extras resolve against the registry is scripts/install_check.py's
measurement (network, minutes), not this test's.
"""

from __future__ import annotations

import email.parser
import importlib.util
import json
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

import moe_replay
from moe_replay import extras
from moe_replay.errors import MissingExtraError, MoeReplayError

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LICENSE_TEXT = (ROOT / "LICENSE").read_text()

_BUILD = """
import sys
from setuptools import build_meta
out = sys.argv[1]
names = [build_meta.build_wheel(out), build_meta.build_sdist(out)]
print("BUILT", *names)  # setuptools logs to stdout too
"""


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """{"wheel": ..., "sdist": ...} built from the checkout (~3 s)."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-c", _BUILD, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel, sdist = next(line for line in proc.stdout.splitlines() if line.startswith("BUILT ")).split()[1:]
    return {"wheel": out / wheel, "sdist": out / sdist}


def _metadata(text: str):
    return email.parser.Parser().parsestr(text)


def test_license_is_the_apache_2_text():
    assert LICENSE_TEXT.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in LICENSE_TEXT and len(LICENSE_TEXT.splitlines()) == 202
    assert PYPROJECT["project"]["license"] == "Apache-2.0" and PYPROJECT["project"]["license-files"] == ["LICENSE"]


def test_the_build_requirement_supports_pep_639_and_the_venv_meets_it():
    from importlib.metadata import version

    from packaging.requirements import Requirement

    req = Requirement(next(r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")))
    assert not req.specifier.contains("76.1.0") and req.specifier.contains(version("setuptools")), (str(req), version("setuptools"))


def test_wheel_carries_the_license_and_the_metadata(dists):
    with zipfile.ZipFile(dists["wheel"]) as zf:
        names = zf.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = _metadata(zf.read(f"{info}/METADATA").decode())
        assert zf.read(f"{info}/licenses/LICENSE").decode() == LICENSE_TEXT
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
        assert "moe_replay/extras.py" in names and "moe_replay/integrations/vllm/surface/table.json" in names
    assert meta["Version"] == moe_replay.__version__
    assert meta["License-Expression"] == "Apache-2.0" and meta.get_all("License-File") == ["LICENSE"]
    assert meta["License"] is None  # the deprecated free-text field is gone
    assert sorted(meta.get_all("Provides-Extra")) == sorted(PYPROJECT["project"]["optional-dependencies"])
    assert (meta.get_all("Project-URL") or []) == [f"{k}, {v}" for k, v in PYPROJECT["project"].get("urls", {}).items()]
    assert "moe-replay = moe_replay.cli:main" in entry_points
    verl = [r for r in meta.get_all("Requires-Dist") if r.endswith('extra == "verl"')]
    assert not any(r.startswith("verl") for r in verl), "verl itself comes with --no-deps (extras.VERL), not in its extra"


def test_sdist_carries_the_license_and_the_metadata(dists):
    with tarfile.open(dists["sdist"]) as tf:
        top = tf.getnames()[0].split("/")[0]
        assert tf.extractfile(f"{top}/LICENSE").read().decode() == LICENSE_TEXT
        meta = _metadata(tf.extractfile(f"{top}/PKG-INFO").read().decode())
    assert meta["License-Expression"] == "Apache-2.0" and meta.get_all("License-File") == ["LICENSE"]


def test_version_flag_prints_the_version_and_exits_0():
    proc = subprocess.run([sys.executable, "-m", "moe_replay.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"moe-replay {moe_replay.__version__}"), proc.stderr
    script = Path(sys.executable).with_name("moe-replay")
    if script.exists():  # the console script the install made
        proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stdout.strip()) == (0, f"moe-replay {moe_replay.__version__}"), proc.stderr


# -- the extras table --------------------------------------------------------------------------------
def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_module_names_an_extra_that_exists_and_the_pins_agree():
    declared = PYPROJECT["project"]["optional-dependencies"]
    assert {e.name for e in extras.EXTRAS.values()} <= set(declared)
    assert _script("bootstrap").VERL == extras.VERL  # what make install and a pip user install beside the extra
    assert declared["sglang"] == [_script("sglang_bed").SGLANG]  # the release the CPU test bed runs
    from moe_replay.integrations.vllm import versions

    release = extras.VLLM_GPU.split("==")[1]
    assert all(release in versions.accepted_releases(r) for r in ("v1", "mrv2")), versions.supported_range()
    hf = set(declared["hf"])
    assert hf <= set(declared["verl"]), "the verl extra carries the hf requirements (verl itself comes without its own)"


def test_require_raises_the_typed_error_and_the_hint_lists_the_extra():
    assert extras.is_available("torch") and not extras.is_available("moe_replay_no_such_module")
    assert not extras.is_available("no_such_parent.child")
    with pytest.raises(KeyError, match="not an optional dependency"):
        extras.require("numpy", "x")
    err = MissingExtraError("x", "trl", "trl", extras.install_hint("trl"))
    assert isinstance(err, MoeReplayError) and isinstance(err, ImportError) and err.name == "trl"
    assert "moe_replay[trl]" in str(err) and "pip install -e '.[trl]'" in str(err)


# -- a missing extra, from every entry point ---------------------------------------------------------
_CHILD = r"""
import contextlib, io, json, sys

BLOCKED = set(sys.argv[1].split(","))


class Refuse:
    '''A missing package: its import, and importlib.util.find_spec of it, raise ModuleNotFoundError.'''

    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED or name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Refuse())
tmp = sys.argv[2]
from moe_replay import cli
from moe_replay.errors import MissingExtraError

out = {}
for key, argv in {
    "audit": ["audit", f"{tmp}/model", f"{tmp}/routes.jsonl"],
    "make-model": ["make-model", "--family", "qwen3_moe", "--out", f"{tmp}/model"],
    "demo": ["demo", "--out", f"{tmp}/demo"],
    "lab": ["lab", "--out", f"{tmp}/lab"],
}.items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    out[key] = [rc, err.getvalue()]
for key, stmt in {
    "integrations.trl": "from moe_replay.integrations.trl import MoeReplayGRPOTrainer",
    "integrations.verl.plugin": "import moe_replay.integrations.verl.plugin",
}.items():
    try:
        exec(stmt)
        out[key] = [0, "imported"]
    except MissingExtraError as e:
        out[key] = [1, f"{type(e).__name__}: {e}"]
print(json.dumps(out))
"""

EXPECTED = {
    "audit": ("transformers", "hf"),
    "make-model": ("transformers", "hf"),
    "demo": ("vllm", "vllm"),
    "lab": ("matplotlib", "dev"),
    "integrations.trl": ("trl", "trl"),
    "integrations.verl.plugin": ("verl", "verl"),
}
"""Entry point -> (the first module it needs that the child lacks, the extra its error names)."""


def test_a_missing_extra_is_one_line_naming_the_extra_at_every_entry_point(tmp_path):
    blocked = "transformers,tokenizers,vllm,trl,verl,matplotlib"
    proc = subprocess.run([sys.executable, "-c", _CHILD, blocked, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for where, (module, extra) in EXPECTED.items():
        rc, text = got[where]
        assert rc in (1, 2) and "Traceback" not in text, (where, rc, text)
        assert f"expected {module} installed, found no module named '{module}'" in text, (where, text)
        assert f"install the moe_replay[{extra}] extra: pip install -e '.[{extra}]' in a clone" in text, (where, text)
        if where in ("audit", "make-model", "demo", "lab"):
            assert text.startswith(f"moe-replay {where}: error: ") and text.count("\n") == 1, (where, text)
    assert f"vLLM is in no extra, install it on its own: on a GPU machine pip install {extras.VLLM_GPU}" in got["demo"][1]
    assert f"pip install --no-deps {extras.VERL}" in got["integrations.verl.plugin"][1]
    assert not (tmp_path / "model").exists() and not (tmp_path / "demo" / "model").exists()  # refused before any work
