"""The base of the worker side: moe_replay's one state object on a model runner, and the op table.

Every worker-side part reads and writes the runner's `RunnerState` (patch.StepBracket, capture in
capture/worker.py, scoring in scoring/force.py, weight sync in weights.py) and registers its own
operations in OPS when its module is imported: `capture.*`, `score.*`, `weights.*`. The package's
__init__ imports those modules, so the table is complete in any process that reaches the adapter
(endpoint.py serves it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from ...registry import Registry
from .errors import CaptureHookError

STATE_ATTR = "_moe_replay"
"""The one attribute moe_replay sets on a model runner (a RunnerState)."""


@dataclass
class RunnerState:
    """Everything moe_replay keeps on one model runner."""

    bracket: Any = None
    """patch.StepBracket: the execute_model wrapper shared by capture and scoring."""
    capture: Any = None
    """capture.worker.WorkerCapture, while capture is installed."""
    scoring: Any = None
    """scoring.force.WorkerScoring, while scoring is installed."""
    noise: Any = None
    """noise.WorkerNoise, while the engine-noise model is installed."""
    watch: Any = None
    """capture.preemption.PreemptionWatch, while a capture reads routes from the engine's outputs."""
    port: Any = None
    """runners.RunnerPort of the runner (its step layout, hook points, requests), kept from one
    StepBracket to the next: binding the V1 port (buffer views, host rings, their first page
    touches) was ~85 us inside the first step after each install (bench model, compiled;
    benchmarks/capture.py attaches capture every round)."""


def runner_state(runner: Any) -> RunnerState:
    """The runner's RunnerState (created empty on first use)."""
    st = getattr(runner, STATE_ATTR, None)
    if st is None:
        st = RunnerState()
        setattr(runner, STATE_ATTR, st)
    return st


Op = Callable[[Any, RunnerState, Any], Any]
OPS: Registry[Op] = Registry("moe_replay worker op")
"""op name -> handler(runner, state, payload) returning a wire-ready value."""


def installed(st: RunnerState, name: str) -> Any:
    """The part `name` ('capture' or 'scoring') of the runner's state; refused when not installed."""
    obj = getattr(st, name)
    if obj is None:
        raise CaptureHookError(f"{name} is not installed on this engine")
    return obj


def register_part_ops(name: str, prefix: str) -> None:
    """The ops every installed part serves alike: `<prefix>.take`, `.discard`, `.stats`, `.uninstall`
    on the RunnerState attribute `name` (an object with take/discard/stats/uninstall)."""

    def uninstall(runner: Any, st: RunnerState, payload: Any) -> bool:
        obj = getattr(st, name)
        if obj is None:
            return False
        obj.uninstall()
        setattr(st, name, None)
        return True

    def take(runner: Any, st: RunnerState, payload: Any) -> list[Any]:
        """payload: the keys, or {"keys": ..., "pid": the client's process id}. A client in this
        process (an in-process engine: no serialiser between it and this op) gets the records as
        they are; packing and unpacking their 7 arrays each was ~0.2 ms of a collect of 8 (bench
        model). Any other client gets wire dicts."""
        keys, pid = (payload["keys"], payload.get("pid")) if isinstance(payload, dict) else (payload, None)
        records = installed(st, name).take(keys)
        return records if pid == os.getpid() else [r.to_dict() for r in records]

    OPS.add(f"{prefix}.take", take)
    OPS.add(f"{prefix}.discard", lambda runner, st, keys: int(installed(st, name).discard(keys)))
    OPS.add(f"{prefix}.stats", lambda runner, st, payload: installed(st, name).stats())
    OPS.add(f"{prefix}.uninstall", uninstall)
