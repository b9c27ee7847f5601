"""The one place verl is changed (two PATCHes, each undoable).

1. Its FSDP language-model engine entries point at MoeReplayFSDPEngine.

verl picks a training engine with `EngineRegistry.new(model_type, backend)` from a class-level
table keyed by device. `install()` replaces the ("language_model", "fsdp"/"fsdp2") entries of
every registered device with the subclass (which behaves as verl's engine unless the model config
names a preset); `uninstall()` puts verl's classes back. PATCH of verl's registry table (its
`register` decorator refuses a second class for a key), idempotent and undoable.

2. `without_trl_value_head()`: while verl builds an actor, its monkey patch sees no TRL (below).
"""

from __future__ import annotations

import contextlib
from typing import Any

_BACKENDS = ("fsdp", "fsdp2")
_saved: dict[tuple[str, object], type] = {}


def install() -> None:
    from verl.workers.engine import EngineRegistry

    from .engine import MoeReplayFSDPEngine

    table = EngineRegistry._engines.get("language_model", {})
    for backend in _BACKENDS:
        for device, cls in list(table.get(backend, {}).items()):
            if cls is not MoeReplayFSDPEngine:
                _saved.setdefault((backend, device), cls)
                table[backend][device] = MoeReplayFSDPEngine


def uninstall() -> None:
    from verl.workers.engine import EngineRegistry

    table = EngineRegistry._engines.get("language_model", {})
    for (backend, device), cls in list(_saved.items()):
        table[backend][device] = cls
        del _saved[(backend, device)]


@contextlib.contextmanager
def without_trl_value_head() -> Any:
    """While verl builds its model, tell verl's monkey_patch that TRL is absent. PATCH, undone on exit.

    verl 0.9.1's `apply_monkey_patch` re-binds `state_dict` on TRL's `AutoModelForCausalLMWithValueHead`
    whenever TRL is importable; TRL >= 1.x (this project's `trl` extra pins 1.16) no longer has that
    class, so verl's engine fails with ImportError while building a plain causal LM. The re-bind is
    for value-head (critic) models only; the actor never has one.
    """
    import verl.models.transformers.monkey_patch as mp

    original = mp.is_trl_available
    mp.is_trl_available = lambda: False
    try:
        yield
    finally:
        mp.is_trl_available = original
