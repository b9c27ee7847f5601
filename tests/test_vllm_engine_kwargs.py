"""capture_engine_kwargs and a user's own worker extension: vLLM takes one `worker_extension_cls`,
so a framework that has its own (verl's colocate extension) mixes moe_replay's endpoint into it."""

from __future__ import annotations

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
