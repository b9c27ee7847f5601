"""The worker end of the adapter: one RPC entry point over the runner's op table.

vLLM reaches its workers through `collective_rpc`, either by method name on the worker extension
class (`worker_extension_cls`; the in-process and the multi-process engine alike) or by shipping a
callable (in-process engines built without the extension). Both land in `call(worker, op,
payload)`: runner.OPS maps an op name to a handler of the runner's `RunnerState`, and the result
travels back in wire.py's envelope, so a worker-side error is re-raised typed on the client (link.py).

vLLM takes one extension class, so capture (capture/worker.py), scoring (scoring/force.py) and
weight sync (weights.py) share it; each registers its own ops in runner.OPS, and the package's
__init__ imports them, so resolving this module's dotted name (what vLLM does with
worker_extension_cls) brings the whole table.
"""

from __future__ import annotations

from typing import Any

from .errors import CaptureHookError
from .runner import OPS, runner_state
from .wire import fail, ok


def _runner_of(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise CaptureHookError(f"worker {type(worker).__name__} has no model_runner")
    return runner


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
