"""capture_engine_kwargs and a user's own worker extension: vLLM takes one `worker_extension_cls`,
so a framework that has its own (verl's colocate extension) mixes moe_replay's endpoint into it.
Also: paths reach vLLM as str, and vLLM-CPU's settings are filled in only where the user left them."""

from __future__ import annotations

import os

import pytest

from moe_replay.integrations.vllm import capture_engine_kwargs
from moe_replay.integrations.vllm.endpoint import ReplayWorkerExtension
from moe_replay.integrations.vllm.link import EXTENSION


class MixedExtension(ReplayWorkerExtension):
    """A framework's extension with moe_replay's endpoint mixed in."""


class ForeignExtension:
    """A framework's extension without it."""


def test_default_extension_is_the_endpoint():
    assert capture_engine_kwargs()["worker_extension_cls"] == EXTENSION


def test_an_extension_that_mixes_in_the_endpoint_is_kept():
    name = f"{__name__}.MixedExtension"
    assert capture_engine_kwargs(worker_extension_cls=name)["worker_extension_cls"] == name


def test_an_extension_without_the_endpoint_is_refused_by_name():
    name = f"{__name__}.ForeignExtension"
    with pytest.raises(ValueError, match="ForeignExtension.*ReplayWorkerExtension"):
        capture_engine_kwargs(worker_extension_cls=name)
    with pytest.raises(ValueError, match="cannot be imported"):
        capture_engine_kwargs(worker_extension_cls=f"{__name__}.NoSuchExtension")


def test_path_values_reach_vllm_as_str(tmp_path):
    """vLLM calls str methods on `model` (PosixPath has no `.lower`): every os.PathLike becomes a str."""
    from moe_replay.integrations.vllm import scoring_engine_kwargs

    kw = capture_engine_kwargs(model=tmp_path / "m", tokenizer=tmp_path / "t", dtype="bfloat16")
    assert (kw["model"], kw["tokenizer"], kw["dtype"]) == (str(tmp_path / "m"), str(tmp_path / "t"), "bfloat16")
    assert scoring_engine_kwargs(model=tmp_path / "m")["model"] == str(tmp_path / "m")


CPU_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")


@pytest.mark.parametrize("kwargs, expected", [
    ({"model": "m"}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}),
    ({"model": "m", "tensor_parallel_size": 2}, {"VLLM_CPU_KVCACHE_SPACE": "1"}),  # several processes: vLLM's layout
    ({"model": "m", "data_parallel_size": 2, "pipeline_parallel_size": 1}, {"VLLM_CPU_KVCACHE_SPACE": "1"}),
    ({"model": "m", "kv_cache_memory_bytes": 2 << 30}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),  # the user's memory
    ({"model": "m", "gpu_memory_utilization": 0.5, "pipeline_parallel_size": 2}, {}),
    ({"additional_config": {}}, {}),  # a part of another builder's kwargs (verl's server): its engine is unseen
])
def test_cpu_env_defaults_fill_only_what_the_user_left_unset(kwargs, expected, monkeypatch):
    from vllm.platforms import current_platform

    from moe_replay.integrations.vllm.engine_kwargs import cpu_env_defaults

    if not current_platform.is_cpu():
        pytest.skip("vLLM-CPU defaults; this vLLM is not the CPU build")
    for name in CPU_ENV:
        monkeypatch.delenv(name, raising=False)
    assert cpu_env_defaults(kwargs) == expected
    assert {k: os.environ[k] for k in CPU_ENV if k in os.environ} == expected
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # a value the user set is kept
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert cpu_env_defaults({"model": "m"}) == {}
    assert (os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"], os.environ["VLLM_CPU_KVCACHE_SPACE"]) == ("1", "4")
