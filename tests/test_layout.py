"""Packaging and import rules that a fresh install relies on."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _declared_packages() -> set[str]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(cfg["packages"])


def _source_packages() -> set[str]:
    found = set()
    for init in ROOT.glob("moe_replay/**/__init__.py"):
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    for mapped in ("integrations", "configs"):  # package-dir mappings: installed under moe_replay.
        for init in ROOT.glob(f"{mapped}/**/__init__.py"):
            found.add(".".join(("moe_replay",) + init.parent.relative_to(ROOT).parts))
    return found


def test_every_package_is_declared_in_pyproject():
    """An undeclared subpackage works in the editable install but is missing from a wheel."""
    missing = _source_packages() - _declared_packages()
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"
    stale = _declared_packages() - _source_packages()
    assert not stale, f"declared in pyproject.toml but absent from the tree: {sorted(stale)}"


def test_core_imports_only_torch_numpy_msgpack():
    code = (
        "import sys, moe_replay, moe_replay.trace, moe_replay.audit, moe_replay.codec, moe_replay.store, moe_replay.models, "
        "moe_replay.estimator, moe_replay.estimator.service, moe_replay.replay, moe_replay.metrics, "
        "moe_replay.corrections, moe_replay.presets, moe_replay.enablement, moe_replay.demo, moe_replay.cli, "
        "moe_replay.integrations.vllm, moe_replay.integrations.hf, moe_replay.integrations.megatron\n"
        "heavy = [m for m in ('vllm', 'transformers', 'ray', 'megatron', 'tokenizers') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"core import pulled in: {out}"


def test_integrations_and_configs_install_under_moe_replay_namespace():
    import moe_replay.configs as configs
    import moe_replay.integrations as integ

    assert Path(integ.__file__).resolve().parent == ROOT / "integrations"
    assert Path(configs.__file__).resolve().parent == ROOT / "configs"
