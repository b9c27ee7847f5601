"""Which requests the scheduler preempted, for routes capture reads from the engine's own outputs.

Capture's hooks check a preempted request's route provenance row by row (row_log.py): a re-prefill
that routes a token otherwise is named and the tokens sampled from its old route are marked stale.
Routes the engine returns itself (vLLM's routed experts: Model Runner V2 from 0.32, or 0.26's V1
runner) come from vLLM's route store, keyed by KV block, where a recompute preemption's
re-prefill overwrites the routes the tokens sampled before it were computed with, and the output
says neither that it happened nor where a route changed. So capture records which requests were
preempted, per worker, and the client refuses their native routes by name (capture/api.py): a
request the KV cache never preempted, the usual case, is unaffected; a preempted one is captured
exactly on the V1 runner's hooks (VLLM_USE_V2_MODEL_RUNNER=0) or with room in the KV cache.

Where it listens: the step bracket's before_step hook (patch.StepBracket, on either model runner,
shared with capture's hooks and scoring). Hooks capture records the same per request itself
(worker.py `_file`).
"""

from __future__ import annotations

from typing import Any

from ..link import MERGES
from ..patch import InstancePatches, step_bracket
from ..runner import OPS, RunnerState
from ..step import external_id

MAX_IDS = 1 << 16
"""Preempted request ids kept per worker (oldest forgotten first); ~4 MB at most."""


class PreemptionWatch:
    """The engine request ids a runner's scheduler outputs named preempted, since install."""

    step_hooks = ("before_step",)
    hook_s = 0.0

    def __init__(self, runner: Any, path: str) -> None:
        self.runner, self.path = runner, path
        self.ids: dict[str, None] = {}
        """Preempted engine request ids, oldest first (a dict: ordered, O(1) membership)."""
        self._patches = InstancePatches()
        self._bracket = step_bracket(runner, self)
        self._patches.on_undo(lambda: self._bracket.remove(self))

    def before_step(self, scheduler_output: Any) -> None:
        preempted = getattr(scheduler_output, "preempted_req_ids", None)
        if preempted:
            self.ids.update(dict.fromkeys(preempted))
            while len(self.ids) > MAX_IDS:
                self.ids.pop(next(iter(self.ids)))

    def preempted(self, keys: list[str]) -> list[str]:
        """The keys (engine ids, or the client's ids vLLM's suffix was taken off) named preempted."""
        seen = set(self.ids) | {external_id(r) for r in self.ids}
        return [k for k in keys if k in seen]

    def uninstall(self) -> None:
        self._patches.undo()


def _watch(runner: Any, st: RunnerState, payload: Any) -> dict[str, Any]:
    if st.watch is None:
        from ..model import runner_path

        st.watch = PreemptionWatch(runner, runner_path(runner.vllm_config))
    return {"path": st.watch.path}


def _preempted(runner: Any, st: RunnerState, keys: Any) -> list[str]:
    return [] if st.watch is None else st.watch.preempted(list(keys))


def _unwatch(runner: Any, st: RunnerState, payload: Any) -> bool:
    if st.watch is None:
        return False
    st.watch.uninstall()
    st.watch = None
    return True


OPS.add("capture.watch", _watch)
MERGES["capture.preempted"] = lambda per_engine: sorted({k for keys in per_engine for k in keys})
"""Data-parallel engines: a request preempted on any engine core (each holds its own requests)."""
MERGES["capture.unwatch"] = any
OPS.add("capture.preempted", _preempted)
OPS.add("capture.unwatch", _unwatch)
