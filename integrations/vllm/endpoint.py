"""The worker end of the adapter: one state object per model runner, one RPC entry point.

vLLM reaches its workers through `collective_rpc`, either by method name on the worker extension
class (`worker_extension_cls`; the in-process and the multi-process engine alike) or by shipping a
callable (in-process engines built without the extension). Both land in `call(worker, op,
payload)`: OPS maps an op name to a handler of the runner's `RunnerState`, and the result travels
back in wire.py's envelope, so a worker-side error is re-raised typed on the client (link.py).

vLLM takes one extension class, so capture (worker.py) and scoring (force.py) share it, as they
share the runner's one step bracket (patch.StepBracket) and its step layout (step.py). Weight sync
(weights.py: a checkpoint update, or a bracket around a trainer's own per-tensor loads) adds its ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ...registry import Registry
from .errors import CaptureHookError
from .wire import InstallReply, ScoreRequest, fail, ok

STATE_ATTR = "_moe_replay"
"""The one attribute moe_replay sets on a model runner (a RunnerState)."""


@dataclass
class RunnerState:
    """Everything moe_replay keeps on one model runner."""

    bracket: Any = None
    """patch.StepBracket: the execute_model wrapper shared by capture and scoring."""
    capture: Any = None
    """worker.WorkerCapture, while capture is installed."""
    scoring: Any = None
    """force.WorkerScoring, while scoring is installed."""


def runner_state(runner: Any) -> RunnerState:
    """The runner's RunnerState (created empty on first use)."""
    st = getattr(runner, STATE_ATTR, None)
    if st is None:
        st = RunnerState()
        setattr(runner, STATE_ATTR, st)
    return st


def _runner_of(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise CaptureHookError(f"worker {type(worker).__name__} has no model_runner")
    return runner


Op = Callable[[Any, RunnerState, Any], Any]
OPS: Registry[Op] = Registry("moe_replay worker op")
"""op name -> handler(runner, state, payload) returning a wire-ready value."""


def _part(st: RunnerState, name: str) -> Any:
    obj = getattr(st, name)
    if obj is None:
        raise CaptureHookError(f"{name} is not installed on this engine")
    return obj


@OPS.register("capture.install")
def _capture_install(runner: Any, st: RunnerState, config: dict[str, Any]) -> dict[str, Any]:
    from ...capture_config import CaptureConfig
    from .versions import check_vllm_version
    from .worker import WorkerCapture

    check_vllm_version()
    if st.capture is not None:
        raise CaptureHookError("capture is already installed on this engine; uninstall() it first")
    st.capture = WorkerCapture(runner, CaptureConfig.from_dict(config))
    return InstallReply(st.capture.geometry.to_dict(), st.capture.slot_cache is not None).to_dict()


@OPS.register("score.install")
def _score_install(runner: Any, st: RunnerState, options: dict[str, Any]) -> dict[str, Any]:
    from .force import WorkerScoring

    if st.scoring is not None:
        raise CaptureHookError("scoring is already installed on this engine; uninstall it first")
    st.scoring = WorkerScoring(runner, **options)
    return InstallReply(st.scoring.geometry.to_dict()).to_dict()


@OPS.register("score.register")
def _score_register(runner: Any, st: RunnerState, requests: list[dict[str, Any]]) -> int:
    return _part(st, "scoring").register([ScoreRequest.from_dict(d) for d in requests])


@OPS.register("weights.update")
def _weights_update(runner: Any, st: RunnerState, path: str) -> dict[str, Any]:
    from .weights import update_on_worker

    return update_on_worker(runner, path)


@OPS.register("weights.begin")
def _weights_begin(runner: Any, st: RunnerState, payload: Any) -> None:
    from .weights import begin_on_worker

    begin_on_worker(runner)


@OPS.register("weights.end")
def _weights_end(runner: Any, st: RunnerState, options: dict[str, Any]) -> dict[str, Any] | None:
    from .weights import end_on_worker

    return end_on_worker(runner, bool(options["check"]))


def _uninstall(name: str) -> Op:
    def op(runner: Any, st: RunnerState, payload: Any) -> bool:
        obj = getattr(st, name)
        if obj is None:
            return False
        obj.uninstall()
        setattr(st, name, None)
        return True

    return op


for _name, _short in (("capture", "capture"), ("scoring", "score")):
    OPS.add(f"{_short}.take", lambda runner, st, keys, n=_name: [r.to_dict() for r in _part(st, n).take(keys)])
    OPS.add(f"{_short}.discard", lambda runner, st, keys, n=_name: int(_part(st, n).discard(keys)))
    OPS.add(f"{_short}.stats", lambda runner, st, payload, n=_name: _part(st, n).stats())
    OPS.add(f"{_short}.uninstall", _uninstall(_name))


def call(worker: Any, op: str, payload: Any = None) -> dict[str, Any]:
    """Run `op` on this worker's runner; the reply envelope carries its value or its error."""
    try:
        handler = OPS.get(op)
        runner = _runner_of(worker)
        return ok(handler(runner, runner_state(runner), payload))
    except Exception as e:  # typed errors travel as (kind, message) and are re-raised client-side
        return fail(e)


class ReplayWorkerExtension:
    """Mixed into vLLM's worker class (ParallelConfig.worker_extension_cls): one prefixed method,
    so it cannot clash with the worker's own attributes."""

    def moe_replay_call(self, op: str, payload: Any = None) -> dict[str, Any]:
        return call(self, op, payload)
