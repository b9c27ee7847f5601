"""Every public entry that takes a model, checkpoint, preset or store path takes any os.PathLike,
not only str and pathlib.Path (vLLM itself needs a str: capture_engine_kwargs converts)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


class OtherPath:
    """An os.PathLike that is not a pathlib.Path: `isinstance(x, Path)` checks miss it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return str(self.path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from moe_replay.models import build_tiny_model

    out = build_tiny_model("qwen3_moe", OtherPath(tmp_path_factory.mktemp("m")))
    assert isinstance(out, Path) and (out / "config.json").is_file()
    return out


def test_model_geometry_and_config_from_a_pathlike(model_dir):
    from moe_replay.models import geometry_of
    from moe_replay.models.layout import read_config

    assert geometry_of(OtherPath(model_dir)) == geometry_of(str(model_dir))
    assert read_config(OtherPath(model_dir))["model_type"] == "qwen3_moe"


def test_preset_and_enable_from_a_pathlike(model_dir, tmp_path):
    import importlib.resources as resources

    import moe_replay
    from moe_replay.presets import load_preset

    yaml_path = tmp_path / "mine.yaml"
    yaml_path.write_text((resources.files("moe_replay.configs") / "r3_support.yaml").read_text())
    assert load_preset(OtherPath(yaml_path)) == load_preset(yaml_path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)  # HF's own API: str or Path
    assert moe_replay.enable(OtherPath(yaml_path), model=model).preset.replay.routes


def test_store_from_a_pathlike(tmp_path):
    from moe_replay.store import open_store

    store = open_store(OtherPath(tmp_path / "s"))
    assert store.keys() == [] and (tmp_path / "s").is_dir()
    store.close()


def test_engine_kwargs_pass_paths_to_vllm_as_str(model_dir):
    pytest.importorskip("vllm")
    from moe_replay.integrations.vllm import capture_engine_kwargs

    kw = capture_engine_kwargs(model=OtherPath(model_dir), tokenizer=model_dir)
    assert kw["model"] == kw["tokenizer"] == os.fspath(model_dir)
