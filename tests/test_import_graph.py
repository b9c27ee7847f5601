"""No import cycles among the package's own modules, counting imports inside functions.

The graph is read from the source (ast), not from a running interpreter, so an import that only
runs inside a function, a method or a lazy `__getattr__` counts the same as one at module level:
a cycle held together by a deferred import still ties its modules into one unit that cannot be
understood, tested or imported alone.

Modules: every .py under moe_replay/, plus integrations/ and configs/ under their installed names
(moe_replay.integrations.*, moe_replay.configs.*; pyproject.toml's package-dir mapping). A
package's __init__.py is the module named by the package.

Edges, following what the import system executes:
  import a.b.c            -> a.b.c, and each of a, a.b that runs its __init__ for it
  from a.b import c       -> a.b.c when c is a submodule, else a.b (c is a name a.b defines)
  from . import c         -> the same, with the relative name resolved against the importer
  importlib.import_module -> the module, for a literal name or f".{TABLE[key]}" over a literal
                             dict TABLE (the lazy-export tables of package __init__s)
An import never adds an edge to a package that contains the importer: the import system has
already started that package's __init__ before the importer runs, so such an import only looks
the package up in sys.modules. `from pkg import name` for a name defined in an enclosing
__init__ does add the edge, since the name must exist by then. Imports under `if TYPE_CHECKING:`
are left out: they never execute.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = "moe_replay"
MAPPED = {"integrations": f"{TOP}.integrations", "configs": f"{TOP}.configs"}
"""Source folder -> installed package name (pyproject.toml [tool.setuptools.package-dir])."""


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    where: str
    """file:line of the import statement."""
    text: str
    """The import as written."""


def source_modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is_package) for every module of the package."""
    out: dict[str, tuple[Path, bool]] = {}
    for folder, prefix in ((TOP, TOP), *MAPPED.items()):
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts.pop()
            out[".".join([prefix, *parts])] = (path, is_pkg)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _executed_nodes(tree: ast.AST):
    """Every node except the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _literal_tables(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level `NAME = {...: "str", ...}` dicts: NAME -> their string values."""
    out = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Dict):
            values = [v.value for v in stmt.value.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
            for target in stmt.targets:
                if isinstance(target, ast.Name) and len(values) == len(stmt.value.values):
                    out[target.id] = values
    return out


def _import_module_targets(call: ast.Call, tables: dict[str, list[str]]) -> list[str] | None:
    """Names a call `importlib.import_module(...)` may import ("." prefixed when relative)."""
    f = call.func
    if not (isinstance(f, ast.Attribute) and f.attr == "import_module" or isinstance(f, ast.Name) and f.id == "import_module"):
        return None
    if not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.JoinedStr) and len(arg.values) == 2:
        head, tail = arg.values
        if (isinstance(head, ast.Constant) and isinstance(tail, ast.FormattedValue)
                and isinstance(tail.value, ast.Subscript) and isinstance(tail.value.value, ast.Name)
                and tail.value.value.id in tables):
            return [head.value + v for v in tables[tail.value.value.id]]
    return None


def _resolve(importer: str, is_pkg: bool, level: int, module: str | None) -> str:
    base = importer.split(".") if is_pkg else importer.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def import_edges(modules: dict[str, tuple[Path, bool]], root: Path = ROOT) -> list[Edge]:
    """Every edge between two of `modules` (see the module docstring for the rules)."""
    edges: dict[tuple[str, str, str], Edge] = {}  # one edge per (src, dst, statement)
    for name, (path, is_pkg) in modules.items():
        src = path.read_text()
        tree = ast.parse(src, str(path))
        tables = _literal_tables(tree)
        containing = set(_prefixes(name)) if is_pkg else set(_prefixes(name)[:-1])
        rel = path.relative_to(root).as_posix()

        def edge(dst: str, node: ast.AST) -> None:
            where = f"{rel}:{node.lineno}"
            if (name, dst, where) not in edges:
                edges[name, dst, where] = Edge(name, dst, where, ast.get_source_segment(src, node) or "")

        def add(dst: str, node: ast.AST) -> None:
            if dst in modules and dst != name and dst not in containing:
                edge(dst, node)

        def add_module(target: str, node: ast.AST) -> None:
            for p in _prefixes(target):
                add(p, node)

        for node in _executed_nodes(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add_module(alias.name, node)
            elif isinstance(node, ast.ImportFrom):
                pkg = _resolve(name, is_pkg, node.level, node.module) if node.level else (node.module or "")
                for p in _prefixes(pkg)[:-1]:
                    add(p, node)
                for alias in node.names:
                    sub = f"{pkg}.{alias.name}"
                    if sub in modules:
                        add(sub, node)
                    elif pkg in modules and pkg != name:
                        # a name the package defines: needed even when pkg encloses the importer
                        edge(pkg, node)
            elif isinstance(node, ast.Call):
                for target in _import_module_targets(node, tables) or ():
                    if target.startswith("."):
                        level = len(target) - len(target.lstrip("."))
                        target = _resolve(name, is_pkg, level, target.lstrip(".") or None)
                    add_module(target, node)
    return list(edges.values())


def strongly_connected(nodes: list[str], edges: list[Edge]) -> list[list[str]]:
    """Tarjan's algorithm: the components with more than one module, each sorted, largest first."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        succ[e.src].append(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        comps.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = counter
                counter += 1
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(succ[nxt])))
            elif nxt in on_stack:
                low[v] = min(low[v], index[nxt])
    return sorted(comps, key=lambda c: (-len(c), c))


def shortest_cycle(comp: list[str], edges: list[Edge]) -> list[Edge]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    members = set(comp)
    succ: dict[str, list[Edge]] = {}
    for e in edges:
        if e.src in members and e.dst in members:
            succ.setdefault(e.src, []).append(e)
    start = comp[0]
    back: dict[str, Edge] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for e in succ.get(v, []):
            if e.dst == start:
                path = [e]
                while path[0].src != start:
                    path.insert(0, back[path[0].src])
                return path
            if e.dst not in back:
                back[e.dst] = e
                queue.append(e.dst)
    raise AssertionError(f"{comp} is not a cycle")


def describe(comps: list[list[str]], edges: list[Edge]) -> str:
    """Each component: its modules, one shortest cycle, and every import inside it (file:line)."""
    lines = []
    for comp in comps:
        members = set(comp)
        lines.append(f"cycle among {len(comp)} modules: {', '.join(comp)}")
        cycle = shortest_cycle(comp, edges)
        lines.append("  shortest: " + " -> ".join([e.src for e in cycle] + [cycle[0].src]))
        for e in sorted((e for e in edges if e.src in members and e.dst in members), key=lambda e: (e.src, e.where)):
            lines.append(f"    {e.src} -> {e.dst}    {e.where}  {' '.join(e.text.split())}")
    return "\n".join(lines)


def test_no_import_cycles():
    modules = source_modules()
    edges = import_edges(modules)
    comps = strongly_connected(sorted(modules), edges)
    assert not comps, "import cycles (break them by giving the shared part one home below both):\n" + describe(comps, edges)


def test_cycle_finder_reports_a_two_module_cycle(tmp_path):
    pkg = tmp_path / TOP
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import A\n")
    (pkg / "sub" / "a.py").write_text("from . import b\nA = 1\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n"
        "def f():\n    from .a import A\n    return A\n")
    (pkg / "sub" / "c.py").write_text("from .b import f\n")
    modules = source_modules(tmp_path)
    assert set(modules) == {TOP, f"{TOP}.sub", f"{TOP}.sub.a", f"{TOP}.sub.b", f"{TOP}.sub.c"}
    edges = import_edges(modules, tmp_path)
    pairs = {(e.src.rsplit(".", 1)[-1], e.dst.rsplit(".", 1)[-1]) for e in edges}
    # `from . import b` in a: an edge to b, none to the package that encloses a; b's TYPE_CHECKING
    # import of c is left out; b's import inside f counts.
    assert pairs == {("sub", "a"), ("a", "b"), ("b", "a"), ("c", "b")}
    comps = strongly_connected(sorted(modules), edges)
    assert comps == [[f"{TOP}.sub.a", f"{TOP}.sub.b"]]
    report = describe(comps, edges)
    assert f"{TOP}/sub/b.py:5" in report and "from .a import A" in report and f"{TOP}/sub/a.py:1" in report


def test_lazy_table_and_enclosing_package_names_count(tmp_path):
    pkg = tmp_path / TOP
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "X = 1\n_LAZY = {'Api': 'api'}\n"
        "def __getattr__(name):\n    import importlib\n    return importlib.import_module(f'.{_LAZY[name]}', __name__)\n")
    (pkg / "api.py").write_text("from . import X\n")
    modules = source_modules(tmp_path)
    comps = strongly_connected(sorted(modules), import_edges(modules, tmp_path))
    assert comps == [[TOP, f"{TOP}.api"]]


PEERS = (f"{TOP}.integrations.vllm.capture", f"{TOP}.integrations.vllm.scoring")
"""The vLLM adapter's two peer subpackages: they share the base below them and never import each other."""


def imported_names(name: str, path: Path, is_pkg: bool) -> list[tuple[str, int]]:
    """Every dotted name a module's imports may resolve to, with its line: `import a.b`, `from a
    import b` (a and a.b), relative forms resolved, importlib.import_module over literals; imports
    inside functions and under `if TYPE_CHECKING:` included."""
    tree = ast.parse(path.read_text(), str(path))
    tables = _literal_tables(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            pkg = _resolve(name, is_pkg, node.level, node.module) if node.level else (node.module or "")
            out += [(pkg, node.lineno)] + [(f"{pkg}.{alias.name}", node.lineno) for alias in node.names]
        elif isinstance(node, ast.Call):
            for target in _import_module_targets(node, tables) or ():
                if target.startswith("."):
                    level = len(target) - len(target.lstrip("."))
                    target = _resolve(name, is_pkg, level, target.lstrip(".") or None)
                out.append((target, node.lineno))
    return out


def test_vllm_capture_and_scoring_never_import_each_other():
    modules = source_modules()
    bad = []
    for mine, other in (PEERS, PEERS[::-1]):
        members = [m for m in modules if m == mine or m.startswith(mine + ".")]
        assert len(members) > 1, f"{mine} has no modules"
        for name in members:
            path, is_pkg = modules[name]
            for target, line in imported_names(name, path, is_pkg):
                if target == other or target.startswith(other + "."):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not bad, "capture/ and scoring/ are peers over the vLLM base; move what both need into it:\n" + "\n".join(bad)


def test_peer_check_sees_imports_inside_functions(tmp_path):
    pkg = tmp_path / TOP / "sub"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import typing\ndef f():\n    from ..other import x\n    from .. import peer\n")
    modules = source_modules(tmp_path)
    path, is_pkg = modules[f"{TOP}.sub.a"]
    names = dict(imported_names(f"{TOP}.sub.a", path, is_pkg))
    assert names[f"{TOP}.other"] == 3 and names[f"{TOP}.peer"] == 4 and "typing" in names
