"""`make test` on two pytest-xdist workers: what each worker's process is given, which tests share one.

Why workers on a 2-core machine: the suite's tests are tiny models whose forwards are Python- and
launch-bound (one core busy, the other idle), engine starts and imports are single-threaded, and a
subprocess test waits on its child. Two workers keep both cores busy.

- **Each worker one core's worth of threads** (`worker_env`): OMP_NUM_THREADS=1, and vLLM-CPU told not
  to pin its OpenMP threads (`VLLM_CPU_OMP_THREADS_BIND=nobind`): its "auto" binding pins the engine's
  main thread, in the worker process, to the node's cores, so both workers' engines and every child a
  worker starts later would share that pinning. A test that asks for its own binding or thread count
  (tests/test_trl_tp.py, the Megatron workers) still sets it in its child's environment.
- **A module stays on one worker** (`ModuleScheduling`, xdist's load-scope scheduling by module):
  module-scoped engines and trained fixtures are built once. Modules that share a session fixture
  worth sharing are one scope (`SHARED_SCOPES`: the SGLang server, ~60 s a start).
- **Longest first** (`order_longest_first`): the scopes are handed out in the order of their measured
  seconds (`tests/durations.json`, written from a run's time report: tests/timing.py), so the last
  module to start is a short one and the two workers end together. A module not in the file counts as
  the file's median.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

import pytest

WORKER = os.environ.get("PYTEST_XDIST_WORKER")
"""This process's xdist worker id ("gw0", "gw1"), or None when pytest runs without workers."""

DURATIONS = Path(__file__).with_name("durations.json")
"""Measured seconds per test module (a V1 session and an MRV2 one), for the order in which scopes start."""

SHARED_SCOPES = {
    "tests/test_sglang_capture.py": "sglang_server",
    "tests/test_sglang_megatron_ranks.py": "sglang_server",
    "tests/test_sglang_trainers.py": "sglang_server",
}
"""Modules that run on the same worker because they share a session fixture (conftest.sglang_server)."""


def worker_env() -> None:
    """Set the thread environment of a worker process, before torch or vLLM are imported (conftest)."""
    if WORKER is None:
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def scope_of(nodeid: str) -> str:
    """The scheduling unit of a test: its module, or the shared scope the module belongs to."""
    module = nodeid.split("::", 1)[0]
    return SHARED_SCOPES.get(module, module)


def _seconds() -> dict[str, float]:
    runner = os.environ.get("MOE_REPLAY_TEST_RUNNER", "v1")
    try:
        return {m: float(s) for m, s in json.loads(DURATIONS.read_text())[runner].items()}
    except (OSError, KeyError, ValueError):
        return {}


def order_longest_first(items: list[pytest.Item]) -> None:
    """Reorder `items` in place: whole scopes, longest measured first; tests keep their order in a scope."""
    seconds = _seconds()
    default = statistics.median(seconds.values()) if seconds else 0.0
    scope_s: dict[str, float] = {}
    for module in {item.nodeid.split("::", 1)[0] for item in items}:
        scope = scope_of(module)
        scope_s[scope] = scope_s.get(scope, 0.0) + seconds.get(module, default)
    first_seen = {}
    for i, item in enumerate(items):
        first_seen.setdefault(scope_of(item.nodeid), i)
    items.sort(key=lambda item: (-scope_s[scope_of(item.nodeid)], first_seen[scope_of(item.nodeid)]))


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's load-scope scheduling with our scopes, in collection order (already longest first)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    config.option.loadscopereorder = False  # keep order_longest_first's order, not "most tests first"
    return ModuleScheduling(config, log)
