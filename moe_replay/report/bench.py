"""`moe-replay bench`: run the benchmark scripts of a source checkout one after another, each in a
fresh Python process (`python benchmarks/<name>.py --json`), and collect their JSON objects into
one, keyed by benchmark name. A failing benchmark is recorded (exit code, stderr tail), not fatal.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import moe_replay

KNOWN_ORDER = ("store", "capture", "replay", "estimator")
"""Run order of the project's benchmarks; other scripts in the folder run after these, by name."""
STDERR_TAIL_CHARS = 4000


class BenchmarksNotFoundError(FileNotFoundError):
    """No benchmarks folder where one was looked for (e.g. a wheel install, which ships none)."""


def default_benchmarks_dir() -> Path:
    """benchmarks/ of the source checkout this moe_replay was imported from."""
    return Path(moe_replay.__file__).resolve().parent.parent / "benchmarks"


def available(bench_dir: Path) -> list[str]:
    """Benchmark names (script stems) in `bench_dir`: KNOWN_ORDER first, then the rest sorted."""
    if not bench_dir.is_dir():
        raise BenchmarksNotFoundError(
            f"no benchmarks folder at {str(bench_dir)!r}: `moe-replay bench` runs the scripts of a source "
            "checkout (git clone the repository and install it with `pip install -e .`), a wheel install "
            "does not ship them; or pass --benchmarks-dir DIR"
        )
    names = sorted(p.stem for p in bench_dir.glob("*.py") if not p.name.startswith("_"))
    return [n for n in KNOWN_ORDER if n in names] + [n for n in names if n not in KNOWN_ORDER]


def select(bench_dir: Path, only: Sequence[str] | None) -> list[str]:
    """The names to run, in order; an unknown name in `only` raises ValueError listing what exists."""
    names = available(bench_dir)
    if not only:
        return names
    missing = [n for n in only if n not in names]
    if missing:
        raise ValueError(
            f"no benchmark script for {', '.join(map(repr, missing))} in {str(bench_dir)!r}; "
            f"available: {', '.join(names) or '(none)'}"
        )
    return list(dict.fromkeys(only))


@dataclass
class BenchResult:
    name: str
    ok: bool
    wall_s: float
    value: dict[str, Any]
    """The benchmark's JSON object, or a failure record (failed, returncode, error, stderr_tail)."""


def last_json_object(stdout: str) -> dict[str, Any] | None:
    """The last JSON object a benchmark printed on stdout, whatever came before it.

    A benchmark prints one JSON object last, on one line or indented over many (json.dumps with
    indent), after whatever its engine logged to stdout (vLLM prints ~125 lines before replay.py's
    result). Candidates are the lines that open with `{` in column 0, tried from the last one up:
    an indented object's nested objects never start in column 0, so the first candidate that
    decodes to a dict is the whole last object, not a piece of it. Text after the object is
    allowed (an engine's shutdown log).
    """
    decoder = json.JSONDecoder()
    starts = [m.start() for m in re.finditer(r"^\{", stdout, flags=re.MULTILINE)]
    for start in reversed(starts):
        try:
            value, _ = decoder.raw_decode(stdout, start)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None


def median_ci95(ratios: Sequence[float]) -> list[float]:
    """Distribution-free 95% interval of the median of `ratios` (per-pair or per-round ratios of an
    interleaved run): order statistics [x_(k), x_(n-k+1)] with k the largest count such that
    P(Binomial(n, 1/2) < k) <= 2.5%. Unlike mean +- 2 standard errors, one pair hit by a spike of the
    shared machine cannot widen it. n < 6 has no such interval: [nan, nan] (10 rounds give [x_(2), x_(9)])."""
    x, n = sorted(ratios), len(ratios)
    below, k = 0.0, 0
    while k < n and below + math.comb(n, k) / 2**n <= 0.025:
        below += math.comb(n, k) / 2**n
        k += 1
    if k == 0:  # too few pairs for a 95% interval
        return [float("nan"), float("nan")]
    return [round(x[k - 1], 4), round(x[n - k], 4)]


def _tail(text: str) -> str:
    return text if len(text) <= STDERR_TAIL_CHARS else "..." + text[-STDERR_TAIL_CHARS:]


RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                   "GROUP_RANK", "TORCHELASTIC_RUN_ID")
"""torch.distributed's env:// rendezvous. A parent that ran a trainer in-process (TRL sets MASTER_PORT
and keeps its group listening there) hands these to every child, whose own group then cannot bind."""


def fresh_world_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without torch.distributed's rendezvous variables: for a child that starts a world of its own."""
    return {k: v for k, v in env.items() if k not in RENDEZVOUS_VARS}


def run_one(name: str, bench_dir: Path, *, timeout_s: float | None = None, python: str = sys.executable,
            extra_args: Sequence[str] = ()) -> BenchResult:
    """Run benchmarks/<name>.py --json [extra_args] in a fresh process from the checkout root."""
    script = bench_dir / f"{name}.py"
    root = bench_dir.resolve().parent
    env = fresh_world_env(os.environ)
    # the same moe_replay as this process, even if the checkout is not installed
    pkg_root = str(Path(moe_replay.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [python, str(script), "--json", *extra_args], cwd=root, env=env, stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        wall = time.perf_counter() - t0
        return BenchResult(name, False, wall, {
            "failed": True, "returncode": None, "wall_s": wall,
            "error": f"timed out after {timeout_s} s", "stderr_tail": _tail(err),
        })
    wall = time.perf_counter() - t0
    value = last_json_object(proc.stdout) if proc.returncode == 0 else None
    if value is not None:
        return BenchResult(name, True, wall, value)
    error = (f"exited with code {proc.returncode}" if proc.returncode != 0
             else "exited 0 but printed no JSON object on stdout")
    return BenchResult(name, False, wall, {
        "failed": True, "returncode": proc.returncode, "wall_s": wall, "error": error,
        "stderr_tail": _tail(proc.stderr), "stdout_tail": _tail(proc.stdout) if proc.returncode == 0 else "",
    })


def run_benchmarks(
    names: Sequence[str], bench_dir: Path, *, timeout_s: float | None = None,
    on_start: Callable[[str], None] | None = None, on_done: Callable[[BenchResult], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run `names` in order; returns {name: benchmark JSON or failure record}."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        if on_start is not None:
            on_start(name)
        result = run_one(name, bench_dir, timeout_s=timeout_s)
        out[name] = result.value
        if on_done is not None:
            on_done(result)
    return out
