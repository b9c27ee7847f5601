"""THE patch file of the vLLM adapter: every change to a vLLM object lives here, and is undoable.

vLLM 0.32 has an official hook for routes (BaseRouter.set_capture_fn, capture/route_hook.py) but
none for the sampler's truncation, for "which request owns which row of this step" or for forcing
routes. We wrap, on the *instances* of one model runner only (never on classes):

  * runner.execute_model                       -> step bookkeeping before/after the forward, once
                                                  per runner, shared by listeners (StepBracket);
  * the runner's forward point and sampler      -> what differs per model runner is wrapped by its
                                                  port, with these InstancePatches (runners/: V1's
                                                  `_model_forward`, `sampler.forward`,
                                                  `topk_topp_sampler.forward`, `rejection_sampler.
                                                  forward`; Model Runner V2's `prepare_inputs`,
                                                  `sample`, `sampler._sample_random`,
                                                  `block_tables.append_block_ids`);
  * <MoE layer>.router._compute_routing         -> forced expert ids per request row (scoring/
                                                  force_step.py), one wrapper per router instance;
                                                  on eager engines at install, on compiled ones
                                                  at load (below).
  * runner.model.compute_logits                -> the engine-noise model's numerics variants
                                                  (noise.py, opt-in; its route flips wrap the
                                                  routers' _compute_routing through patch_routers).

One class-level wrapper exists, because a compiled forward only calls capture functions set
before torch.compile traces it, i.e. before any runner instance can be reached:

  * BaseModelLoader.load_model (LoadHook)       -> after the model is built and loaded, when the
                                                  engine's additional_config carries CAPTURE_FLAG
                                                  and the forward is compiled, run the LOAD_STEPS
                                                  of the flags it carries (capture binds the route
                                                  step buffer, scoring with FORCE_FLAG the routers'
                                                  forcing step), before the forward is compiled;
                                                  inert for every other engine.

vLLM loads `register_plugin` in every process (entry point group `vllm.general_plugins`,
pyproject.toml); `capture_engine_kwargs()` also installs it in the calling process, so in-process
engines work without the entry point. `remove_load_hook()` undoes it. The entry point imports the
package, whose __init__ imports capture and scoring, which register their load steps.

`InstancePatches.undo()` restores the original attributes (instance attributes are deleted when
the original was the class's method, reassigned when it was already an instance attribute).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable

from ...registry import Registry
from .errors import CaptureHookError
from .model import forward_is_traced, runner_path
from .runner import runner_state
from .versions import check_vllm_version

_MISSING = object()

CAPTURE_FLAG = "moe_replay_capture"
"""Key in vLLM's `additional_config` that asks for the load hook (capture_engine_kwargs) and for
capture's load-time step. vLLM hashes additional_config into its compile-cache key, so compiled
artifacts with and without a step (and with different versions of it) never mix."""

FORCE_FLAG = "moe_replay_force"
"""Key in vLLM's `additional_config` that asks for scoring's load-time forcing step on a compiled
forward (scoring_engine_kwargs), for the same compile-cache reason as CAPTURE_FLAG."""

LOAD_ORDER = (CAPTURE_FLAG, FORCE_FLAG)
"""The order the load hook runs the steps of the flags an engine carries."""


@dataclass(frozen=True)
class LoadStep:
    """`bind(model, vllm_config)`: work bound into a freshly loaded model before its forward is compiled."""

    bind: Callable[[Any, Any], Any]
    sources: tuple[str, ...]
    """The source files the step traces: their hash is the flag's value (flag_value)."""


LOAD_STEPS: Registry[LoadStep] = Registry("moe_replay load-time step")
"""additional_config flag -> its LoadStep, registered by the part that owns the flag
(capture/route_hook.py: CAPTURE_FLAG, scoring/force_step.py: FORCE_FLAG)."""


def flag_value(flag: str) -> str:
    """The value of `flag` in additional_config: a hash of its step's sources, so vLLM's compile
    cache never serves a graph traced with another version of the step."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    for f in LOAD_STEPS.get(flag).sources:
        h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]


class InstancePatches:
    """Set attributes on instances, remember what was there, put it back on undo()."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []
        self._on_undo: list[Callable[[], None]] = []

    def on_undo(self, fn: Callable[[], None]) -> None:
        """Run `fn` at undo(), after every attribute is restored (e.g. leave the step bracket)."""
        self._on_undo.append(fn)

    def wrap(self, obj: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        if not hasattr(obj, name):
            raise CaptureHookError(f"{type(obj).__name__} has no attribute {name!r} to hook (vLLM version mismatch?)")
        original = getattr(obj, name)
        if getattr(original, "__moe_replay_wrapped__", False):
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
        while self._on_undo:
            self._on_undo.pop()()


class StepBracket:
    """THE execute_model wrapper of one runner, shared by every moe_replay listener on it.

    vLLM takes one worker_extension_cls and an instance attribute can be wrapped once, so capture
    (capture.worker.WorkerCapture) and scoring (scoring.force.WorkerScoring) do not each wrap execute_model: they
    register here. Per step, listeners' `before_step(scheduler_output)` run before the original
    (input batch not yet updated), `before_forward()` inside it, once the inputs are prepared and
    before the model runs (outside any compiled graph), and `after_forward(scheduler_output)` after
    it (batch, positions and the step's hidden states in place). A listener runs only the hooks it
    names in `step_hooks` (all three when it has no such attribute): each hook a step enters costs
    ~10-25 us inside a busy engine whatever it does (the first touch of its code and data after
    the forward, benchmarks/capture.py), so `_model_forward` is wrapped only once a listener asks
    for before_forward. Seconds spent in each listener go to its `hook_s`: the bracket times
    before_step and before_forward; after_forward, which runs every step after the forward, times
    itself (the bracket's timing loop and in_step flag there were ~4.5 us a step inside the engine:
    bench model, compiled, the hook's phase less its own time, 8.0 against 12.5 us).
    Both read the step's rows from one `views.layout(n)` (step.py). The wrappers are removed when
    the last listener leaves (`remove`).

    A listener that reads the step from its sampler wrapper instead (capture: one hook a step, not
    two) names `after_unsampled` and no `after_forward`: the wrapper keeps the step's scheduler
    output in `scheduled` until that listener takes it, and calls `after_unsampled(scheduler_output)`
    after an execute_model that returned its output itself, since no sampler runs for it (a step
    with nothing scheduled, a pooling model). vLLM's engine core calls sample_tokens exactly when
    execute_model returned None (v1/engine/core.py), and the runner's step buffers (positions,
    query starts, slot mapping, the route step buffer) are next written by the next execute_model.
    """

    HOOKS = ("before_step", "before_forward", "after_forward", "after_unsampled")
    DEFAULT_HOOKS = ("before_step", "before_forward", "after_forward")
    """The hooks of a listener without `step_hooks`."""

    def __init__(self, runner: Any) -> None:
        from .runners import port_of

        self.runner = runner
        self.views = port_of(runner)
        """The runner's port (runners/), whose one layout of each step (request ids, query starts,
        positions) the listeners share (no listener holds rows of an earlier bracket)."""
        self.views.current = None
        self.views.rewind()
        self.listeners: list[Any] = []
        self._on: dict[str, tuple[Any, ...]] = {h: () for h in self.HOOKS}
        """Hook name -> the listeners that run it, in registration order."""
        self.in_step = False
        """True between before_step and after_forward of a real engine step (never in dummy runs)."""
        self._patches = InstancePatches()
        self._forward_wrapped = False
        on, clock = self._on, time.perf_counter

        self._after: tuple[Callable[[Any], None], ...] = ()
        """The listeners' bound after_forward hooks (made once at `_sync`, not per step)."""
        self._unsampled: tuple[Callable[[Any], None], ...] = ()
        """The listeners' bound after_unsampled hooks."""
        self.scheduled: Any = None
        """The scheduler output of the step whose forward ran and whose sampler has not, until a
        listener reading the step from its sampler wrapper takes it (None outside engine steps:
        a dummy or profile sampler run finds None)."""
        views = self.views

        def make_execute(orig):
            def execute_model(scheduler_output, *args, **kwargs):
                if kwargs.get("dummy_run"):  # Model Runner V2's warm-up / profile / idle-DP runs: no engine step
                    self.scheduled = None
                    return orig(scheduler_output, *args, **kwargs)
                views.current = None  # a new step: no layout taken yet
                self.scheduled = scheduler_output
                for lst in on["before_step"]:
                    t0 = clock()
                    lst.before_step(scheduler_output)
                    lst.hook_s += clock() - t0
                if not self._forward_wrapped:  # nothing reads in_step
                    out = orig(scheduler_output, *args, **kwargs)
                else:
                    self.in_step = True
                    try:
                        out = orig(scheduler_output, *args, **kwargs)
                    finally:
                        self.in_step = False
                for hook in self._after:  # each times itself into its hook_s (see the class docstring)
                    hook(scheduler_output)
                if out is not None:  # the runner's output already: no sampler runs for this step
                    self.scheduled = None
                    for hook in self._unsampled:
                        hook(scheduler_output)
                return out

            return execute_model

        self._patches.wrap(runner, "execute_model", make_execute)
        try:
            self.views.bind(self._patches)
        except Exception:
            self._patches.undo()
            raise

    def _before_forward(self) -> None:
        """The forward point's hook (the port calls it once inputs are prepared): before_forward listeners."""
        if self.in_step:  # never in dummy / warm-up / graph-capture runs
            clock = time.perf_counter
            for lst in self._on["before_forward"]:
                t0 = clock()
                lst.before_forward()
                lst.hook_s += clock() - t0

    def add(self, listener: Any) -> None:
        if listener in self.listeners:
            raise CaptureHookError(f"{type(listener).__name__} is already registered on this runner's step bracket")
        hooks = tuple(getattr(listener, "step_hooks", self.DEFAULT_HOOKS))
        odd = [h for h in hooks if h not in self.HOOKS or not callable(getattr(listener, h, None))]
        if odd:
            raise CaptureHookError(f"{type(listener).__name__} names step hooks {odd} it does not have "
                                   f"(known: {self.HOOKS})")
        if "before_forward" in hooks and not self._forward_wrapped:  # no forward point: forced rows fail as never filled
            self._forward_wrapped = self.views.wrap_forward(self._patches, self._before_forward)
        self.listeners.append(listener)
        self._sync()

    def resync(self) -> None:
        """Read the listeners' `step_hooks` again (a listener that changed which hooks it runs)."""
        self._sync()

    def _sync(self) -> None:
        for h in self.HOOKS:
            self._on[h] = tuple(lst for lst in self.listeners if h in getattr(lst, "step_hooks", self.DEFAULT_HOOKS))
        self._after = tuple(lst.after_forward for lst in self._on["after_forward"])
        self._unsampled = tuple(lst.after_unsampled for lst in self._on["after_unsampled"])

    def remove(self, listener: Any) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)
            self._sync()
        if not self.listeners:
            self._patches.undo()
            st = runner_state(self.runner)
            if st.bracket is self:
                st.bracket = None


def step_bracket(runner: Any, listener: Any) -> StepBracket:
    """Register `listener` on the runner's StepBracket, installing the bracket if needed."""
    st = runner_state(runner)
    bracket = st.bracket
    if bracket is None:
        bracket = st.bracket = StepBracket(runner)
    try:
        bracket.add(listener)
    except Exception:
        bracket.remove(listener)  # a bracket left without listeners unwraps the runner
        raise
    return bracket


def patch_runner(runner: Any, capture: Any) -> tuple[InstancePatches, StepBracket]:
    """Install capture on one model runner: the step bracket plus, where capture reads the sampler
    (`capture.samples`), the runner port's sampler wrappers (runners/).

    Returns the patches (their undo() also leaves the step bracket) and the bracket.
    """
    patches = InstancePatches()
    bracket = step_bracket(runner, capture)
    patches.on_undo(lambda: bracket.remove(capture))
    try:
        if capture.samples:  # the kept set or logprobs, or a speculative engine's emitted tokens
            bracket.views.wrap_sampler(patches, capture)
    except Exception:
        patches.undo()
        raise
    return patches, bracket


def patch_routers(routers: list[Any], make: Callable[[int, Callable], Callable]) -> InstancePatches:
    """Wrap `_compute_routing` on each router *instance*; make(j, orig) -> replacement.

    This is the forcing point of scoring (scoring/force_step.py): BaseRouter.select_experts calls
    self._compute_routing(hidden_states, router_logits, indices_type, input_ids=...) and feeds its
    (weights fp32 [T, K], ids int32 [T, K]) to the experts kernel and to set_capture_fn.
    """
    patches = InstancePatches()
    try:
        for j, router in enumerate(routers):
            patches.wrap(router, "_compute_routing", lambda orig, j=j: make(j, orig))
    except Exception:
        patches.undo()
        raise
    return patches


def patch_compute_logits(model: Any, make: Callable[[Callable], Callable]) -> InstancePatches:
    """Wrap `model.compute_logits(hidden_states)` on the model *instance* (noise.py: the engine-noise
    model's logit variants). The runner calls it outside any compiled graph, so it works on eager
    and compiled engines alike; decode rows, prompt-logprob rows and spec-decode rows all pass here."""
    patches = InstancePatches()
    patches.wrap(model, "compute_logits", make)
    return patches


# -- scoring: prefix-cache write cap (scoring/prefix.py; scheduler side, one wrapper per coordinator) --------
def patch_cache_writes(coordinator: Any, cap: Callable[[Any], int | None]) -> InstancePatches:
    """Wrap `KVCacheCoordinator.cache_blocks(request, num_tokens)`: cache at most cap(request) tokens."""
    patches = InstancePatches()

    def make(orig):
        def cache_blocks(request, num_computed_tokens, *args, **kwargs):
            n = cap(request)
            return orig(request, num_computed_tokens if n is None else min(n, num_computed_tokens), *args, **kwargs)

        return cache_blocks

    patches.wrap(coordinator, "cache_blocks", make)
    return patches


def patch_cache_reads(manager: Any, cap: Callable[[Any], int | None]) -> InstancePatches:
    """Wrap `KVCacheManager.get_computed_blocks(request)` so its prefix-cache lookup hits at most
    cap(request) tokens: vLLM's own `find_longest_cache_hit` gets min(its limit, cap), so block
    alignment across KV-cache groups stays vLLM's. The scheduler runs lookups one at a time."""
    patches = InstancePatches()
    coordinator = manager.coordinator
    current: list[int | None] = [None]

    def make_lookup(orig):
        def get_computed_blocks(request, *args, **kwargs):
            current[0] = cap(request)
            try:
                return orig(request, *args, **kwargs)
            finally:
                current[0] = None

        return get_computed_blocks

    def make_hit(orig):
        def find_longest_cache_hit(block_hashes, max_cache_hit_length, *args, **kwargs):
            n = current[0]
            return orig(block_hashes, max_cache_hit_length if n is None else min(n, max_cache_hit_length), *args, **kwargs)

        return find_longest_cache_hit

    patches.wrap(manager, "get_computed_blocks", make_lookup)
    patches.wrap(coordinator, "find_longest_cache_hit", make_hit)
    return patches


class LoadHook:
    """THE class-level patch: wraps BaseModelLoader.load_model, once per process, undoable."""

    installed: "LoadHook | None" = None

    def __init__(self) -> None:
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader

        self.cls = BaseModelLoader
        self.before = BaseModelLoader.__dict__["load_model"]
        original = self.before

        def load_model(loader, vllm_config, model_config, *args, **kwargs):
            model = original(loader, vllm_config, model_config, *args, **kwargs)
            extra = getattr(vllm_config, "additional_config", None)
            # the target model only (a draft model of speculative decoding is loaded the same way)
            if isinstance(extra, dict) and extra.get(CAPTURE_FLAG) and model_config is vllm_config.model_config:
                check_vllm_version(runner=runner_path(vllm_config))
                if forward_is_traced(vllm_config):  # eager forwards get their functions at install
                    for flag in LOAD_ORDER:
                        if extra.get(flag):
                            LOAD_STEPS.get(flag).bind(model, vllm_config)
            return model

        functools.update_wrapper(load_model, original)
        load_model.__moe_replay_wrapped__ = True
        BaseModelLoader.load_model = load_model

    def undo(self) -> None:
        self.cls.load_model = self.before


def install_load_hook() -> LoadHook:
    """Install the load hook in this process (idempotent)."""
    if LoadHook.installed is None:
        LoadHook.installed = LoadHook()
    return LoadHook.installed


def remove_load_hook() -> None:
    if LoadHook.installed is not None:
        LoadHook.installed.undo()
        LoadHook.installed = None


def register_plugin() -> None:
    """vLLM general plugin (pyproject.toml `vllm.general_plugins`): run in every vLLM process."""
    install_load_hook()
