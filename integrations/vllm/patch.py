"""THE patch file of the vLLM adapter: every change to a vLLM object lives here, and is undoable.

vLLM 0.32 has an official hook for routes (BaseRouter.set_capture_fn, used in route_hook.py) but
none for the sampler's truncation or for "which request owns which row of this step". We wrap, on
the *instances* of one model runner only (never on classes):

  * runner.execute_model                       -> step bookkeeping before/after the forward;
  * runner.sampler.forward                      -> sampled tokens of the step;
  * runner.sampler.topk_topp_sampler.forward    -> the kept set, where truncation happens.

`InstancePatches.undo()` restores the original attributes (instance attributes are deleted when
the original was the class's method, reassigned when it was already an instance attribute).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

_MISSING = object()


class InstancePatches:
    """Set attributes on instances, remember what was there, put it back on undo()."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def wrap(self, obj: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        if not hasattr(obj, name):
            from .errors import CaptureHookError

            raise CaptureHookError(f"{type(obj).__name__} has no attribute {name!r} to hook (vLLM version mismatch?)")
        original = getattr(obj, name)
        if getattr(original, "__moe_replay_wrapped__", False):
            from .errors import CaptureHookError

            raise CaptureHookError(f"{type(obj).__name__}.{name} is already wrapped by moe_replay capture")
        self._saved.append((obj, name, obj.__dict__.get(name, _MISSING)))
        wrapped = make(original)
        functools.update_wrapper(wrapped, original)
        wrapped.__moe_replay_wrapped__ = True
        setattr(obj, name, wrapped)

    def undo(self) -> None:
        while self._saved:
            obj, name, before = self._saved.pop()
            if before is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, before)


def patch_runner(runner: Any, capture: Any) -> InstancePatches:
    """Install the three wrappers of `capture` (a worker.WorkerCapture) on one model runner."""
    patches = InstancePatches()
    try:

        def make_execute(orig):
            def execute_model(scheduler_output, *args, **kwargs):
                t0 = time.perf_counter()
                capture.before_step(scheduler_output)
                t1 = time.perf_counter()
                out = orig(scheduler_output, *args, **kwargs)
                t2 = time.perf_counter()
                capture.after_forward(scheduler_output)
                capture.hook_s += (t1 - t0) + (time.perf_counter() - t2)
                return out

            return execute_model

        patches.wrap(runner, "execute_model", make_execute)

        if capture.config.support or capture.config.logprobs:
            sampler = runner.sampler
            support = capture.support

            def make_sampler(orig):
                def forward(logits, sampling_metadata, *args, **kwargs):
                    out = orig(logits, sampling_metadata, *args, **kwargs)
                    t0 = time.perf_counter()
                    capture.after_sample(out.sampled_token_ids, sampling_metadata)
                    capture.hook_s += time.perf_counter() - t0
                    return out

                return forward

            def make_topk(orig):
                def forward(logits, generators, k, p):
                    # time of our extra work only (the original sampling is subtracted inside)
                    t0 = time.perf_counter()
                    out = support.truncate_and_observe(orig, logits, generators, k, p)
                    capture.hook_s += time.perf_counter() - t0 - support.orig_s
                    return out

                return forward

            patches.wrap(sampler, "forward", make_sampler)
            patches.wrap(sampler.topk_topp_sampler, "forward", make_topk)
    except Exception:
        patches.undo()
        raise
    return patches
