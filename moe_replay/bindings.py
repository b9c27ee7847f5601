"""Engine bindings: how `enable()` attaches a preset to the rollout engine and the trainer it is given.

A binding says which objects it serves (`matches`: read from the object's class and its bases,
module and name, so nothing here imports a framework) and how to attach capture / π_old scoring
(rollout side) or replay and scoring (trainer side). `enable()` takes the first binding, by
`order`, that matches; the generic one (any torch module: Hugging Face) comes last. An object no
binding serves is a ValueError naming the kinds that are supported. The adapters register their
own bindings (integrations/*/binding.py, loaded through an entry point: `load_bindings`);
frameworks are imported only inside the attach functions.

Legend: G generated tokens of the batch (flat, trace order), B rows, S positions, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

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
    replay: Callable[[Any, Any, bool, str], Any]
    """(model, plan, track_flips, trainer path) -> a context manager yielding (session, plan as the model sees it)."""
    model_inputs: Callable[[Any], dict[str, torch.Tensor]]
    """plan -> the forward's keyword inputs."""
    score: Callable[..., Any]
    """(logits, plan, *, temperature, use_support, full, entropy) -> TokenScores."""
    paths: tuple[str, ...] = ("project",)
    """The replay paths it offers, for the preset's `replay.trainer_path` (besides "auto", which
    lets the binding choose: integrations/megatron/paths.py states Megatron's rule)."""
    free_routes: Callable[..., Any] | None = None
    """(model, token ids per sample, context) -> moe_replay.audit.FreeRoutes: one forward without gradients
    and with free routing, inside `context()`, recording the model's own top-k (`moe_replay.audit`)."""

    def check_path(self, path: str) -> None:
        """ValueError unless `path` is "auto" or one this binding offers."""
        if path != "auto" and path not in self.paths:
            raise ValueError(f"replay.trainer_path {path!r} is not offered by this trainer; expected 'auto' or one of "
                             f"{list(self.paths)}")


ROLLOUT_BINDINGS: Registry[RolloutBinding] = Registry("rollout engine binding")
TRAINER_BINDINGS: Registry[TrainerBinding] = Registry("trainer binding")


ENTRY_POINT_GROUP = "moe_replay.bindings"
"""Adapters register their bindings by being imported; each names its module under this entry-point
group (pyproject.toml: vllm, hf, megatron), so the core names no adapter and a third-party adapter
registers the same way."""
_loaded = False


def load_bindings() -> None:
    """Import every module registered under ENTRY_POINT_GROUP, once per process (their imports add
    to the registries). The modules import no framework; their attach functions do."""
    global _loaded
    if _loaded:
        return
    from importlib.metadata import entry_points

    found = entry_points(group=ENTRY_POINT_GROUP)
    if not found:
        raise RuntimeError(f"no moe_replay bindings registered under the entry-point group {ENTRY_POINT_GROUP!r}: "
                           "expected moe_replay installed with its package metadata (pip install -e . or a wheel)")
    for ep in found:
        ep.load()
    _loaded = True


def binding_for(registry: Registry, obj: Any, role: str) -> tuple[str, Any]:
    """(name, binding) of the first binding, by order, that serves `obj`; ValueError naming the kinds if none."""
    load_bindings()
    ranked = sorted(((registry.get(n).order, n) for n in registry.names()))
    for _, name in ranked:
        b = registry.get(name)
        if b.matches(obj):
            return name, b
    raise ValueError(f"enable(...): no {role} binding serves a {type(obj).__module__}.{type(obj).__name__}; "
                     f"supported: {', '.join(n for _, n in ranked)}")
