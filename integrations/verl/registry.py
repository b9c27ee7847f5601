"""The one place verl is changed: its FSDP language-model engine entries point at MoeReplayFSDPEngine.

verl picks a training engine with `EngineRegistry.new(model_type, backend)` from a class-level
table keyed by device. `install()` replaces the ("language_model", "fsdp"/"fsdp2") entries of
every registered device with the subclass (which behaves as verl's engine unless the model config
names a preset); `uninstall()` puts verl's classes back. PATCH of verl's registry table (its
`register` decorator refuses a second class for a key), idempotent and undoable.
"""

from __future__ import annotations

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
