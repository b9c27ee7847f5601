"""How `moe_replay.enable` attaches to a Megatron-core model (or its virtual-pipeline chunks).
Registered through the `moe_replay.bindings` entry point (pyproject.toml), so the core names no
adapter. Importing it does not import megatron."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ...bindings import TRAINER_BINDINGS, TrainerBinding, made_by
from ...geometry import ModelGeometry


def _is_megatron(obj: Any) -> bool:
    chunks = obj if isinstance(obj, (list, tuple)) and obj else [obj]  # virtual-pipeline chunks
    return all(made_by(c, "megatron") for c in chunks)


def _geometry(model: Any, family: str) -> ModelGeometry:
    from .routers import model_geometry

    return model_geometry(model, family=family)


@contextlib.contextmanager
def _replay(model: Any, plan: Any, track_flips: bool, path: str = "auto") -> Iterator[tuple[Any, Any]]:
    """`path`: the preset's replay.trainer_path (paths.py: "project", "megatron_native", or "auto")."""
    from .paths import open_replay

    if track_flips:
        raise ValueError("track_flips is not available on Megatron (its RouterReplay does not expose the router's own top-k)")
    with open_replay(model, plan, path=path) as session:
        yield session, plan


def _inputs(plan: Any) -> dict[str, torch.Tensor]:
    from .layout import megatron_inputs

    return megatron_inputs(plan)


def _score(logits_BSV: torch.Tensor, plan: Any, *, entropy: bool = True, **kw: Any) -> Any:
    """Vocabulary-parallel logits (TP > 1) are normalised across the tensor-parallel group."""
    from .replay import score_tokens

    scores = score_tokens(logits_BSV, plan, **kw)
    if not entropy:
        scores.entropy_G = None
    return scores


def _free_routes(model: Any, token_ids: Any, context: Any) -> Any:
    from .audit import free_routes

    return free_routes(model, token_ids, context)


TRAINER_BINDINGS.add("megatron", TrainerBinding(0, _is_megatron, _geometry, _replay, _inputs, _score,
                                                paths=("project", "megatron_native"), free_routes=_free_routes))
