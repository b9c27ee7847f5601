"""Patches applied to SGLang's modules as they are first imported, in whichever process imports them.

SGLang spawns its scheduler and detokenizer, so a patch made in the parent never reaches the forward: it must
be installed in each process at start-up (a sitecustomize on the processes' PYTHONPATH calls `patch_on_import`)
and applied when the module it patches executes. Used by the force hook (force.py) and by the CPU test bed's
fixes (tests/sglang_bed/sitecustomize.py).
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any, Callable

Patch = Callable[[Any], None]
"""module -> None: changes the freshly executed module in place (idempotent)."""


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Patch) -> None:
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class PatchFinder(importlib.abc.MetaPathFinder):
    """First on sys.meta_path: finds a patched module with the finders after it and wraps its loader."""

    def __init__(self, patches: dict[str, Patch]) -> None:
        self.patches = patches

    def find_spec(self, name, path=None, target=None):
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, patch)
                return spec
        return None


def patch_on_import(patches: dict[str, Patch]) -> None:
    """Apply `patches` ({module name: patch}) to each module when it is first imported in this process, and now
    to those already imported. A second call with the same dict installs nothing more."""
    if not any(isinstance(f, PatchFinder) and f.patches is patches for f in sys.meta_path):
        sys.meta_path.insert(0, PatchFinder(patches))
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])


def wrap_method(cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """cls.name = make(cls.name), once (a marked wrapper is never wrapped again)."""
    inner = getattr(cls, name)
    if getattr(inner, "_moe_replay", False):
        return
    wrapper = make(inner)
    wrapper._moe_replay = True
    setattr(cls, name, wrapper)
