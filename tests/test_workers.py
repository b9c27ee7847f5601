"""The test infrastructure's own promises: make test's scopes start longest first, whole, and the SGLang
modules share one scope (tests/workers.py); the time report's durations file round-trips (tests/timing.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tests import timing, workers


def items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_scopes_start_longest_first_and_stay_whole(monkeypatch):
    monkeypatch.setattr(workers, "_seconds", lambda: {"tests/a.py": 1.0, "tests/b.py": 50.0, "tests/c.py": 9.0})
    got = items("tests/a.py::x", "tests/a.py::y", "tests/b.py::z", "tests/c.py::w", "tests/new.py::v", "tests/b.py::u")
    workers.order_longest_first(got)
    # b (50 s) first, its tests in their order; c (9 s) then new (the median, 9 s: after c, seen later); a (1 s) last
    assert [i.nodeid for i in got] == ["tests/b.py::z", "tests/b.py::u", "tests/c.py::w", "tests/new.py::v",
                                       "tests/a.py::x", "tests/a.py::y"]


def test_the_sglang_server_modules_are_one_scope():
    scopes = {workers.scope_of(m + "::t") for m in workers.SHARED_SCOPES}
    assert scopes == {"sglang_server"}
    assert workers.scope_of("tests/test_codec.py::test_x[1]") == "tests/test_codec.py"


def test_durations_are_written_per_runner(tmp_path):
    report = tmp_path / "times-v1.json"
    report.write_text(json.dumps({"runner": "v1", "modules": {"tests/b.py": 2.04, "tests/a.py": 1.0}}))
    out = tmp_path / "durations.json"
    out.write_text(json.dumps({"mrv2": {"tests/m.py": 3.0}}))
    got = timing.update_durations([report], out)
    assert got == {"mrv2": {"tests/m.py": 3.0}, "v1": {"tests/a.py": 1.0, "tests/b.py": 2.0}}
    assert json.loads(out.read_text()) == got
