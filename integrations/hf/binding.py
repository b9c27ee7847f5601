"""How `moe_replay.enable` attaches to a trainer's Hugging Face model: the generic binding (any
torch module, replayed through the HF router adapters), last in dispatch order. Registered through
the `moe_replay.bindings` entry point (pyproject.toml), so the core names no adapter."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch

from ...bindings import TRAINER_BINDINGS, TrainerBinding
from ...geometry import ModelGeometry
from ...replay import score_tokens


def _geometry(model: Any, family: str) -> ModelGeometry:
    from .replay import model_geometry

    g = model_geometry(model)
    return dataclasses.replace(g, family=family) if family else g


@contextlib.contextmanager
def _replay(model: Any, plan: Any, track_flips: bool, path: str = "project") -> Iterator[tuple[Any, Any]]:
    from .replay import replay

    with replay(model, plan, track_flips=track_flips) as session:
        yield session, session.plan


def _free_routes(model: Any, token_ids: Any, context: Any) -> Any:
    from .audit import free_routes

    return free_routes(model, token_ids, context)


TRAINER_BINDINGS.add("hf", TrainerBinding(100, lambda o: isinstance(o, torch.nn.Module), _geometry, _replay,
                                          lambda plan: plan.model_inputs(), score_tokens, free_routes=_free_routes))
