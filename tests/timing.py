"""Where a test session's minutes go: a pytest plugin (loaded by conftest.py) that prints, at the end of
every session, the session's wall time, the slowest tests, the time per module and the engine starts per
module, and writes the same as JSON (`MOE_REPLAY_TIMES_JSON`, default `.pytest_cache/times-<runner>.json`).

Why a report of our own and not only `--durations`: the budget (docs/benchmarks.md: `make test` from a
fresh clone, install included, in 45 min on 2 cores) is spent per module and per engine start (an
in-process vLLM-CPU engine costs 10-30 s to build, a test's own work a fraction of that), and
`--durations` names neither.

Engine starts are counted where they happen in this process: `vllm.LLM.__init__` (every in-process
engine, fixture or test) and the SGLang bed's `server()` (tests/sglang_bed/bed.py calls `note_engine`).
Engines started in child processes (benchmarks, multi-process tests) count in their test's time only.
Under pytest-xdist (tests/workers.py) each worker sends its engine starts to the controller when it ends
(xdist's `workeroutput`), and the report adds each worker's busy seconds (how evenly the two were loaded).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import pytest

SLOWEST = 15
"""How many tests and modules the terminal report lists (the JSON has every module)."""

_module_s: dict[str, float] = defaultdict(float)
_tests_s: dict[str, float] = defaultdict(float)
_engines: dict[str, list[float]] = defaultdict(list)
"""module -> the seconds of each engine start in it."""
_workers_s: dict[str, float] = defaultdict(float)
_current = {"module": "(collection)"}
_t0 = time.perf_counter()


def note_engine(kind: str, seconds: float) -> None:
    """Count one engine start of `kind` ("vllm", "sglang") in the module now running."""
    _engines[f"{_current['module']}::{kind}"].append(seconds)


def _wrap_vllm() -> None:
    """Time `vllm.LLM.__init__` once vLLM has been imported by a test module (never imports it itself)."""
    mod = sys.modules.get("vllm.entrypoints.llm")
    if mod is None or getattr(mod.LLM.__init__, "_moe_replay_timed", False):
        return
    init = mod.LLM.__init__

    @functools.wraps(init)
    def timed(self: Any, *args: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        try:
            init(self, *args, **kwargs)
        finally:
            note_engine("vllm", time.perf_counter() - t)

    timed._moe_replay_timed = True  # type: ignore[attr-defined]
    mod.LLM.__init__ = timed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _current["module"] = item.nodeid.split("::")[0]
    _wrap_vllm()
    yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::")[0]
    _module_s[module] += report.duration
    _tests_s[report.nodeid] += report.duration
    node = getattr(report, "node", None)  # set by xdist's controller on a worker's report
    if node is not None:
        _workers_s[node.gateway.id] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)  # present in an xdist worker
    if workeroutput is not None:
        workeroutput["moe_replay_engines"] = json.dumps(_engines)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist's controller: add a finished worker's engine starts."""
    for key, seconds in json.loads(getattr(node, "workeroutput", {}).get("moe_replay_engines", "{}")).items():
        _engines[key].extend(seconds)


def _runner() -> str:
    return os.environ.get("MOE_REPLAY_TEST_RUNNER", "v1")


def summary() -> dict[str, Any]:
    """The session's times as data (what the JSON file holds)."""
    engines = {k: {"starts": len(v), "seconds": round(sum(v), 1)} for k, v in sorted(_engines.items())}
    return {
        "runner": _runner(),
        "wall_s": round(time.perf_counter() - _t0, 1),
        "tests_s": round(sum(_tests_s.values()), 1),
        "engine_starts": sum(e["starts"] for e in engines.values()),
        "engine_start_s": round(sum(e["seconds"] for e in engines.values()), 1),
        "workers_s": {w: round(s, 1) for w, s in sorted(_workers_s.items())},
        "modules": {m: round(s, 1) for m, s in sorted(_module_s.items(), key=lambda kv: -kv[1])},
        "engines": engines,
        "slowest": {t: round(s, 1) for t, s in sorted(_tests_s.items(), key=lambda kv: -kv[1])[:SLOWEST]},
    }


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workeroutput"):  # an xdist worker: its controller reports for the session
        return
    data = summary()
    out = Path(os.environ.get("MOE_REPLAY_TIMES_JSON", Path(config.rootpath) / ".pytest_cache" / f"times-{data['runner']}.json"))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1) + "\n")
    except OSError as e:  # a read-only checkout still gets the terminal report
        out = Path(f"(not written: {e})")
    tr = terminalreporter
    tr.section(f"where the time went ({data['runner']} session)")
    tr.write_line(f"session wall {data['wall_s']:.0f} s; tests (setup + call + teardown) {data['tests_s']:.0f} s; "
                  f"{data['engine_starts']} in-process engine starts, {data['engine_start_s']:.0f} s; JSON: {out}")
    if data["workers_s"]:
        tr.write_line("busy seconds per worker: " + ", ".join(f"{w} {s:.0f}" for w, s in data["workers_s"].items()))
    tr.write_line("slowest modules:")
    for module, s in list(data["modules"].items())[:SLOWEST]:
        starts = sum(e["starts"] for k, e in data["engines"].items() if k.startswith(module + "::"))
        tr.write_line(f"  {s:8.1f} s  {module}" + (f"  ({starts} engine starts)" if starts else ""))
    tr.write_line("slowest tests:")
    for test, s in data["slowest"].items():
        tr.write_line(f"  {s:8.1f} s  {test}")


def update_durations(paths: list[Path], out: Path) -> dict[str, dict[str, float]]:
    """tests/durations.json (tests/workers.py's order) from the time reports of a V1 and an MRV2 session."""
    durations: dict[str, dict[str, float]] = json.loads(out.read_text()) if out.exists() else {}
    for path in paths:
        data = json.loads(path.read_text())
        durations[data["runner"]] = {m: round(s, 1) for m, s in sorted(data["modules"].items())}
    out.write_text(json.dumps(durations, indent=1, sort_keys=True) + "\n")
    return durations


if __name__ == "__main__":  # python -m tests.timing .pytest_cache/times-v1.json .pytest_cache/times-mrv2.json
    import argparse

    parser = argparse.ArgumentParser(description="write tests/durations.json from session time reports")
    parser.add_argument("reports", nargs="+", type=Path)
    args = parser.parse_args()
    from tests.workers import DURATIONS

    update_durations(args.reports, DURATIONS)
    print(f"wrote {DURATIONS}")
