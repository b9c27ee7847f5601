"""Engine bindings: how `enable()` attaches a preset to the rollout engine and the trainer it is given.

A binding says which objects it serves (`matches`: read from the object's class and its bases,
module and name, so nothing here imports a framework) and how to attach capture / π_old scoring
(rollout side) or replay and scoring (trainer side). `enable()` takes the first binding, by
`order`, that matches; the generic one (any torch module: Hugging Face) comes last. An object no
binding serves is a ValueError naming the kinds that are supported. Frameworks are imported only
inside the attach functions.

Legend: G generated tokens of the batch (flat, trace order), B rows, S positions, V vocabulary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .geometry import ModelGeometry
from .registry import Registry


def made_by(obj: Any, module_prefix: str, *class_names: str) -> bool:
    """True if `obj`'s class, or a base of it, comes from `module_prefix` (and has one of `class_names`)."""
    for cls in type(obj).__mro__:
        if cls.__module__.split(".")[0] == module_prefix and (not class_names or cls.__name__ in class_names):
            return True
    return False


@dataclass(frozen=True)
class RolloutBinding:
    """How capture and π_old scoring attach to one kind of rollout engine."""

    order: int
    """Dispatch order (lower first); the first binding whose `matches` is true serves the engine."""
    matches: Callable[[Any], bool]
    attach: Callable[[Any, Any], Any]
    """(engine, preset) -> (capture, scorer or None); an awaitable of that for async engines."""
    is_async: bool = False
    """attach must be awaited (`enable_async`); the engine's own generate is async too."""


@dataclass(frozen=True)
class TrainerBinding:
    """How replay and token scoring attach to one kind of trainer model."""

    order: int
    matches: Callable[[Any], bool]
    geometry: Callable[[Any, str], ModelGeometry]
    """(model, family) -> the model's MoE geometry ('' family: taken from the model if it names one)."""
    replay: Callable[[Any, Any, bool], Any]
    """(model, plan, track_flips) -> a context manager yielding (session, plan as the model sees it)."""
    model_inputs: Callable[[Any], dict[str, torch.Tensor]]
    """plan -> the forward's keyword inputs."""
    score: Callable[..., Any]
    """(logits, plan, *, temperature, use_support, full, entropy) -> TokenScores."""


ROLLOUT_BINDINGS: Registry[RolloutBinding] = Registry("rollout engine binding")
TRAINER_BINDINGS: Registry[TrainerBinding] = Registry("trainer binding")


def binding_for(registry: Registry, obj: Any, role: str) -> tuple[str, Any]:
    """(name, binding) of the first binding, by order, that serves `obj`; ValueError naming the kinds if none."""
    ranked = sorted(((registry.get(n).order, n) for n in registry.names()))
    for _, name in ranked:
        b = registry.get(name)
        if b.matches(obj):
            return name, b
    raise ValueError(f"enable(...): no {role} binding serves a {type(obj).__module__}.{type(obj).__name__}; "
                     f"supported: {', '.join(n for _, n in ranked)}")


# -- rollout engines ---------------------------------------------------------------------------------

def _vllm_sync(llm: Any, preset: Any) -> tuple[Any, Any]:
    from .integrations.vllm import VllmCapture, VllmScorer, VllmScorerConfig

    capture = VllmCapture(llm, preset.capture)
    scorer = None
    if preset.estimator.enabled:
        scorer = VllmScorer(llm, VllmScorerConfig(force_routes=preset.estimator.force_routes,
                                                  use_support=preset.estimator.use_support))
    return capture, scorer


async def _vllm_async(engine: Any, preset: Any) -> tuple[Any, Any]:
    from .integrations.vllm import AsyncVllmCapture, AsyncVllmScorer, VllmScorerConfig

    capture = await AsyncVllmCapture.attach(engine, preset.capture)
    scorer = None
    if preset.estimator.enabled:
        scorer = await AsyncVllmScorer.attach(engine, VllmScorerConfig(force_routes=preset.estimator.force_routes,
                                                                       use_support=preset.estimator.use_support))
    return capture, scorer


ROLLOUT_BINDINGS.add("vllm.LLM", RolloutBinding(0, lambda o: made_by(o, "vllm", "LLM"), _vllm_sync))
ROLLOUT_BINDINGS.add("vllm.AsyncLLM", RolloutBinding(1, lambda o: made_by(o, "vllm", "AsyncLLM"), _vllm_async,
                                                     is_async=True))


# -- trainers ----------------------------------------------------------------------------------------

def _hf_geometry(model: Any, family: str) -> ModelGeometry:
    import dataclasses

    from .integrations.hf.replay import model_geometry

    g = model_geometry(model)
    return dataclasses.replace(g, family=family) if family else g


@contextlib.contextmanager
def _hf_replay(model: Any, plan: Any, track_flips: bool) -> Iterator[tuple[Any, Any]]:
    from .integrations.hf.replay import replay

    with replay(model, plan, track_flips=track_flips) as session:
        yield session, session.plan


def _hf_score(logits_BSV: torch.Tensor, plan: Any, **kw: Any) -> Any:
    from .replay import score_tokens

    return score_tokens(logits_BSV, plan, **kw)


def _is_megatron(obj: Any) -> bool:
    chunks = obj if isinstance(obj, (list, tuple)) and obj else [obj]  # virtual-pipeline chunks
    return all(made_by(c, "megatron") for c in chunks)


def _megatron_geometry(model: Any, family: str) -> ModelGeometry:
    from .integrations.megatron import model_geometry

    return model_geometry(model, family=family)


@contextlib.contextmanager
def _megatron_replay(model: Any, plan: Any, track_flips: bool) -> Iterator[tuple[Any, Any]]:
    from .integrations.megatron import replay

    if track_flips:
        raise ValueError("track_flips is not available on Megatron (its RouterReplay does not expose the router's own top-k)")
    with replay(model, plan) as session:
        yield session, plan


def _megatron_inputs(plan: Any) -> dict[str, torch.Tensor]:
    from .integrations.megatron import megatron_inputs

    return megatron_inputs(plan)


def _megatron_score(logits_BSV: torch.Tensor, plan: Any, *, entropy: bool = True, **kw: Any) -> Any:
    """Vocabulary-parallel logits (TP > 1) are normalised across the tensor-parallel group."""
    from .integrations.megatron import score_tokens

    scores = score_tokens(logits_BSV, plan, **kw)
    if not entropy:
        scores.entropy_G = None
    return scores


TRAINER_BINDINGS.add("megatron", TrainerBinding(0, _is_megatron, _megatron_geometry, _megatron_replay, _megatron_inputs,
                                                _megatron_score))
TRAINER_BINDINGS.add("hf", TrainerBinding(100, lambda o: isinstance(o, torch.nn.Module), _hf_geometry, _hf_replay,
                                          lambda plan: plan.model_inputs(), _hf_score))
"""The generic fallback: any torch module, replayed through the Hugging Face router adapters."""
