"""Public API: attach capture to a vLLM engine, generate, collect one trace per sample.

    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture, capture_engine_kwargs
    llm = LLM(model=path, **capture_engine_kwargs())       # or any LLM (in-process engine)
    with VllmCapture(llm, CaptureConfig(max_support=4096)) as cap:
        outputs, traces = cap.generate(prompts, SamplingParams(top_p=0.9, n=4))

The client reaches the workers through one link (link.py; sync LLM or AsyncLLM); the worker half
is endpoint.py (ops) and capture/worker.py (capture state on the runner); engine_kwargs.py builds
the engine kwargs capture needs. Parts the engine returns itself (`CaptureConfig.source`; native.py)
are read from the outputs, and hooks capture the rest.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Iterable, Sequence

from ....capture_config import CaptureConfig
from ....errors import Where
from ....geometry import EngineInfo, ModelGeometry
from ....trace import RolloutTrace, Sampling, validate_traces
from ..errors import CaptureHookError, CollectError, UnknownRequestError
from ..link import AsyncLink, SyncLink
from ..model import refuse_pipeline_parallel, runner_path
from ..versions import check_release
from ..timings import PartTimes, client_view
from ..wire import CaptureRecord, InstallReply
from .assemble import build_trace, merge_stream
from .native import EngineFlags, PreemptedRoutesError, native_trace, plan_sources

_LINK = {"what": "capture", "default": CaptureHookError, "kwargs_fn": "capture_engine_kwargs"}


LOGIT_ADJUSTMENTS: tuple[tuple[str, Any], ...] = (
    ("repetition_penalty", lambda v: v is not None and float(v) != 1.0),
    ("presence_penalty", lambda v: bool(v)),
    ("frequency_penalty", lambda v: bool(v)),
    ("logit_bias", lambda v: bool(v)),
    ("allowed_token_ids", lambda v: v is not None),
    ("bad_words", lambda v: bool(v)),
    ("min_tokens", lambda v: bool(v)),
    ("structured_outputs", lambda v: v is not None),
    ("logits_processors", lambda v: bool(v)),
    ("thinking_token_budget", lambda v: v is not None),  # past the budget: the end token's logit set to 1e9
)
"""vLLM SamplingParams options that change the logits the sampler draws from (and whose recorded
logprob is of), each with its test for "set"; recorded by name in Sampling.adjusted."""


ENGINE_PROCESSOR_PREFIX = "logits_processors:"
"""`Sampling.adjusted` names of engine-level logits processors: this prefix + the processor's class name."""


def engine_logits_processors(vllm_config: Any) -> tuple[str, ...]:
    """`Sampling.adjusted` names of the custom logits processors this engine's sampler runs.

    vLLM builds the sampler's processors from its three built-ins (min_tokens, logit_bias, min_p:
    each acts only through its SamplingParams option, recorded by LOGIT_ADJUSTMENTS or by
    Sampling.min_p) plus every class in `LLM(logits_processors=[...])` (model_config) and every
    installed `vllm.logits_processors` entry point (`build_logitsprocs`). A custom processor sees
    every request and says to no one which it changed, so each is named on every trace the engine
    samples ("logits_processors:<class name>"): a +8 on one token's logit moves its logprob by up
    to 8 nats, which no trainer forward reproduces (plan.adjusted_sampling_problem refuses it).
    """
    from importlib.metadata import entry_points

    try:
        from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LOGITSPROCS_GROUP
    except ImportError:  # 0.34 on (MRV2 only): the group is in MRV2's loader, and min_p / logit_bias are no processors
        from vllm.v1.worker.gpu.sample.logits_processor.loader import LOGITSPROCS_GROUP

        BUILTIN_LOGITS_PROCESSORS = ()

    builtin = {f"{c.__module__}:{c.__qualname__}" for c in BUILTIN_LOGITS_PROCESSORS}
    given = list(getattr(vllm_config.model_config, "logits_processors", None) or ())
    names = []
    for entry in given + [ep.value for ep in entry_points(group=LOGITSPROCS_GROUP)]:
        fqcn = f"{entry.__module__}:{entry.__qualname__}" if isinstance(entry, type) else str(entry).strip()
        if fqcn not in builtin:
            names.append(ENGINE_PROCESSOR_PREFIX + fqcn.rpartition(":")[2])
    return tuple(dict.fromkeys(names))


def sampling_summary(params: Any) -> dict[str, Any]:
    """The sampling parameters a trainer needs to score like the sampler did (msgpack-able)."""
    return {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k if params.top_k is not None else -1),
        "min_p": float(params.min_p),
        "seed": params.seed,
        "adjusted": [name for name, is_set in LOGIT_ADJUSTMENTS if is_set(getattr(params, name, None))],
    }


def _with_logprobs(params: Any) -> Any:
    """`params` asking for the sampled token's logprob (logprobs=0) if it asked for none."""
    if params.logprobs is not None:
        return params
    params = params.clone()
    params.logprobs = 0
    return params


def _engine_info(model_config: Any) -> EngineInfo:
    import vllm

    dtype = str(model_config.dtype).removeprefix("torch.")
    return EngineInfo(name="vllm", version=vllm.__version__, dtype=dtype, extra={"model": str(model_config.model)})


class _CaptureBase:
    """Shared logic of the sync and async front ends; their links differ only in how they call."""

    config: CaptureConfig
    geometry: ModelGeometry
    engine_info: EngineInfo
    weights_version: str | int | None = None
    """Recorded in every collected trace: set it (a step or checkpoint fingerprint) after each weight sync."""
    times: PartTimes
    """The client's host seconds per part: client.take_call (the take RPC as timed here; timings()
    reports it as client.rpc, less the worker's own time inside it), client.build, client.store."""

    def _plan(self, vllm_config: Any) -> dict[str, Any] | None:
        """Decide each part's source; returns the hooks' config dict, or None when every part is native.
        Hooks read either model runner (runners/: V1 or Model Runner V2); the release is checked for
        the runner path the engine runs (versions.check_release, VllmReleaseError naming what it lacks)."""
        self.runner_path = runner_path(vllm_config)
        """"v1" or "mrv2": the model runner the engine runs (model.runner_path)."""
        check_release(runner=self.runner_path)
        self.plan = plan_sources(self.config, EngineFlags.of(vllm_config))
        self.engine_adjusted = engine_logits_processors(vllm_config)
        """The engine's custom logits processors, named in every trace's `sampling.adjusted`."""
        self._hooks_config = self.plan.hooks_config(self.config)
        if self._hooks_config is not None:
            refuse_pipeline_parallel(vllm_config, f"capture of {sorted(self.plan.hooks)} by hooks")
            return self._hooks_config.to_dict()
        from ....models.layout import geometry_of

        self._link, self.prefix_routes, self.via = None, None, "native"
        self.geometry = geometry_of(vllm_config.model_config.hf_text_config)
        return None

    @property
    def _watches(self) -> bool:
        """Routes come from the engine's outputs and no hooks are installed: a PreemptionWatch on the
        workers says which requests were preempted (capture/preemption.py)."""
        return "routes" in self.plan.native and self._link is None

    def _on_install(self, link: Any, values: list[dict[str, Any]]) -> None:
        replies = [InstallReply.from_dict(v) for v in values]
        geoms = {tuple(sorted(r.geometry.items(), key=lambda x: x[0])).__repr__() for r in replies}
        if len(geoms) != 1:
            raise CaptureHookError(f"workers disagree on the model geometry: {geoms}")
        self._link = link
        self.geometry = ModelGeometry.from_dict(replies[0].geometry)
        self.prefix_routes = replies[0].slot_cache
        self.via = link.via
        """How the link reaches the workers: 'worker_extension_cls' or 'callable'."""

    def _requests(self, outputs: Iterable[Any], n: dict[str, int] | None = None):
        """(items, failures): one item per sample, `n` (request id -> SamplingParams.n) over what
        was recorded at submit; a request in neither takes n from its outputs."""
        return merge_stream(list(outputs), {**getattr(self, "_submitted_n", {}), **(n or {})})

    def _take(self, items) -> Any:
        """The call that fetches the items' worker records; None when no part comes from hooks."""
        if self._link is None or not items:
            return None
        return self._link.call("capture.take", {"keys": [wkey for _, wkey, _, _ in items], "pid": os.getpid()})

    def _assemble(self, items, payloads, store, sampling: dict[str, dict[str, Any]] | None = None,
                  route_starts: dict[str, int] | None = None, failures: dict[str, Exception] | None = None,
                  preempted: "set[str] | frozenset[str]" = frozenset()) -> list[RolloutTrace]:
        t0 = time.perf_counter()
        traces, failures = [], dict(failures or {})
        payloads = [None] * len(items) if payloads is None else payloads
        staged: list[Any] = []  # per item: its hooks trace (None: no part from hooks), or the error refusing it
        for (key, wkey, comp, out), payload in zip(items, payloads):
            try:
                if getattr(comp, "finish_reason", None) is None:  # a streamed child ends before its parent
                    raise UnknownRequestError(f"request {key!r} has not finished; collect final outputs only")
                trace = None
                was_preempted = wkey in preempted
                if payload is not None:  # validated below, all together
                    record = payload if isinstance(payload, CaptureRecord) else CaptureRecord.from_dict(payload)
                    was_preempted = record.preempted
                    trace = build_trace(key, out.prompt_token_ids, comp, record, self.geometry, self._hooks_config,
                                        self.engine_info, validate=False)
                if was_preempted and "routes" in self.plan.native:
                    raise PreemptedRoutesError(
                        Where(record=key, field="routed_experts"), "routes of one forward per token",
                        "a request the scheduler preempted and recomputed",
                        "vLLM's routed experts keep the re-prefill's routes, and the tokens sampled before it were "
                        "computed with the earlier ones; the output does not say where they differ. Capture it by "
                        "hooks (an engine built with capture_engine_kwargs(), without enable_return_routed_experts), "
                        "which name every rerouted position, or give the KV cache room (no preemption)")
                staged.append(trace)
            except Exception as e:  # one bad request never costs the others their traces
                staged.append(e)
        built = [i for i, t in enumerate(staged) if isinstance(t, RolloutTrace)]
        for j, e in validate_traces([staged[i] for i in built]).items():
            staged[built[j]] = e
        for (key, _, comp, out), trace in zip(items, staged):
            if isinstance(trace, Exception):
                failures[key] = trace
                continue
            try:
                if self.plan.native:
                    trace = native_trace(key, out.prompt_token_ids, comp, self.plan, self.geometry, self.config,
                                         self.engine_info, base=trace,
                                         route_start=(route_starts or {}).get(out.request_id, 0))
                if sampling and out.request_id in sampling:
                    trace.sampling = Sampling.from_dict(sampling[out.request_id])
                if self.engine_adjusted:  # every request, whatever sampling summary it came with
                    trace.sampling = dataclasses.replace(
                        trace.sampling, adjusted=trace.sampling.adjusted + self.engine_adjusted)
                trace.weights_version = self.weights_version
                traces.append(trace)
            except Exception as e:  # one bad request never costs the others their traces
                failures[key] = e
        t1 = time.perf_counter()
        self.times.add("client.build", t1 - t0)
        if store is not None:
            for t in traces:
                store.put(t)
            self.times.add("client.store", time.perf_counter() - t1)
        if failures:
            raise CollectError(traces, failures)
        return traces


class VllmCapture(_CaptureBase):
    """Capture attached to one `vllm.LLM`; `uninstall()` (or leaving the `with`) detaches it.

    The engine is best built with `capture_engine_kwargs()` (works in-process and multi-process);
    an in-process LLM built without it is also accepted. The prefix cache is reset on attach so
    every cached block's routes are known.
    """

    def __init__(self, llm: Any, config: CaptureConfig | None = None, *, reset_prefix_cache: bool = True) -> None:
        self.llm, self.config = llm, config or CaptureConfig()
        self.times = PartTimes()
        self.engine_info = _engine_info(llm.llm_engine.model_config)
        hooks = self._plan(llm.llm_engine.vllm_config)
        self._watch = None
        if hooks is not None:
            self._on_install(*SyncLink.open(llm, "capture.install", hooks, **_LINK))
        elif self._watches:
            self._watch, _ = SyncLink.open(llm, "capture.watch", None, **_LINK)
        if reset_prefix_cache:
            llm.reset_prefix_cache()

    def generate(self, prompts: Any, sampling_params: Any = None, *, store: Any = None, **kwargs: Any):
        """`LLM.generate` then `collect`: returns (outputs, traces), traces in output/sample order.

        Each trace's `sampling` records its request's sampling parameters (temperature, top_p,
        top_k, min_p, seed), so a trainer or scorer reads them from the trace.
        """
        if sampling_params is None:
            sampling_params = self.llm.get_default_sampling_params()
        if "logprobs" in self.plan.native:  # the engine returns the sampled token's logprob only when asked
            sampling_params = ([_with_logprobs(sp) for sp in sampling_params]
                               if isinstance(sampling_params, (list, tuple)) else _with_logprobs(sampling_params))
        outputs = self.llm.generate(prompts, sampling_params, **kwargs)
        per_prompt = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(outputs)
        sampling = {out.request_id: sampling_summary(sp) for out, sp in zip(outputs, per_prompt)}
        starts = {out.request_id: int(getattr(sp, "routed_experts_prompt_start", 0) or 0)
                  for out, sp in zip(outputs, per_prompt)}
        n = {out.request_id: int(sp.n) for out, sp in zip(outputs, per_prompt)}
        return outputs, self.collect(outputs, store=store, sampling=sampling, route_starts=starts, n=n)

    def collect(self, outputs: Sequence[Any], *, store: Any = None, sampling: dict[str, dict[str, Any]] | None = None,
                route_starts: dict[str, int] | None = None, n: dict[str, int] | None = None) -> list[RolloutTrace]:
        """One trace per sample of each finished RequestOutput; the records leave the worker.

        `sampling` (request id -> sampling_summary(params)) becomes each trace's `sampling`;
        `route_starts` (request id -> SamplingParams.routed_experts_prompt_start, default 0) places
        native routes; `n` (request id -> SamplingParams.n) says how many samples each request must
        show (default: as many as its outputs hold).
        Raises CollectError (with `.traces` = every good trace, already put to `store`) when some
        requests fail (aborted, unknown, evicted, support overflow under 'error', misaligned).
        """
        items, missing = self._requests(outputs, n)
        t0 = time.perf_counter()
        payloads = self._take(items)
        if payloads is not None:
            self.times.add("client.take_call", time.perf_counter() - t0)
        preempted = set(self._watch.call("capture.preempted", [w for _, w, _, _ in items])) if self._watch else set()
        return self._assemble(items, payloads, store, sampling, route_starts, missing, preempted)

    def discard(self, request_ids: Sequence[str]) -> int:
        """Drop worker records (e.g. of aborted requests); returns how many were dropped."""
        return int(self._link.call("capture.discard", list(request_ids))) if self._link is not None else 0

    def stats(self) -> dict[str, Any]:
        return self._link.call("capture.stats") if self._link is not None else {"source": "native"}

    def timings(self, reset: bool = False) -> dict[str, dict[str, float]]:
        """Host seconds and calls per part of capture's work, worker and client, since attach or the
        last `timings(reset=True)`: {part: {"s": seconds, "calls": count}}, parts disjoint (their sum
        is capture's host time; the route writes inside a compiled graph are not in it). Parts:
        step.* (every engine step), flush.* (once per flush), take.assemble, client.rpc /
        client.build / client.store (collect). Flushes first, so
        every finished step is counted. See integrations/vllm/timings.py (`shares` turns them into
        fractions of a wall time)."""
        worker = (self._link.call("capture.timings", bool(reset)) if self._link is not None
                  else {"parts": {}, "take_s": 0.0})
        out = client_view(worker, self.times)
        if reset:
            self.times.reset()
        return out

    def uninstall(self) -> None:
        if self._link is not None:
            self._link.call("capture.uninstall")
        if self._watch is not None:
            self._watch.call("capture.unwatch")
            self._watch = None

    def __enter__(self) -> "VllmCapture":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()


class AsyncVllmCapture(_CaptureBase):
    """Capture for `vllm.v1.engine.async_llm.AsyncLLM`: `await AsyncVllmCapture.attach(engine)`.

    The engine must be built with `capture_engine_kwargs()` (its workers live in other processes).
    """

    def __init__(self, engine: Any, config: CaptureConfig) -> None:
        self.engine, self.config = engine, config
        self.times = PartTimes()
        self.engine_info = _engine_info(engine.model_config)
        self._submitted_n: dict[str, int] = {}
        """request id -> SamplingParams.n of requests submitted through `generate` (dropped at collect)."""
        self._submitted_sampling: dict[str, dict[str, Any]] = {}

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any):
        """`AsyncLLM.generate`, yielding its outputs unchanged, that records the request's n and
        sampling parameters for `collect`: with vLLM's default (cumulative) streaming an n > 1
        request's children arrive one output each, so pass every yielded output to `collect`."""
        if "logprobs" in self.plan.native:
            sampling_params = _with_logprobs(sampling_params)
        self._submitted_n[request_id] = int(sampling_params.n)
        self._submitted_sampling[request_id] = sampling_summary(sampling_params)
        async for out in self.engine.generate(prompt, sampling_params, request_id=request_id, **kwargs):
            yield out

    @classmethod
    async def attach(cls, engine: Any, config: CaptureConfig | None = None, *, reset_prefix_cache: bool = True):
        self = cls(engine, config or CaptureConfig())
        hooks = self._plan(engine.vllm_config)
        self._watch = None
        if hooks is not None:
            self._on_install(*await AsyncLink.open(engine, "capture.install", hooks, **_LINK))
        elif self._watches:
            self._watch, _ = await AsyncLink.open(engine, "capture.watch", None, **_LINK)
        if reset_prefix_cache:
            await engine.reset_prefix_cache()
        return self

    async def collect(self, outputs: Sequence[Any], *, store: Any = None,
                      sampling: dict[str, dict[str, Any]] | None = None,
                      route_starts: dict[str, int] | None = None, n: dict[str, int] | None = None
                      ) -> list[RolloutTrace]:
        """As VllmCapture.collect; pass `sampling` ({request id: sampling_summary(params)}) to record
        each request's sampling parameters in its traces (requests sent through `generate` have
        theirs and their n recorded). Streamed outputs are welcome: a request's chunks are merged."""
        outputs = list(outputs)
        items, missing = self._requests(outputs, n)
        rids = {out.request_id for out in outputs}
        sampling = {**{r: s for r, s in self._submitted_sampling.items() if r in rids}, **(sampling or {})}
        for r in rids:
            self._submitted_n.pop(r, None)
            self._submitted_sampling.pop(r, None)
        t0 = time.perf_counter()
        pending = self._take(items)
        payloads = None
        if pending is not None:
            payloads = await pending
            self.times.add("client.take_call", time.perf_counter() - t0)
        preempted = set()
        if self._watch is not None:
            preempted = set(await self._watch.call("capture.preempted", [w for _, w, _, _ in items]))
        return self._assemble(items, payloads, store, sampling or None, route_starts, missing, preempted)

    async def discard(self, request_ids: Sequence[str]) -> int:
        return int(await self._link.call("capture.discard", list(request_ids))) if self._link is not None else 0

    async def stats(self) -> dict[str, Any]:
        return await self._link.call("capture.stats") if self._link is not None else {"source": "native"}

    async def timings(self, reset: bool = False) -> dict[str, dict[str, float]]:
        """As VllmCapture.timings, summed over data-parallel engines."""
        worker = (await self._link.call("capture.timings", bool(reset)) if self._link is not None
                  else {"parts": {}, "take_s": 0.0})
        out = client_view(worker, self.times)
        if reset:
            self.times.reset()
        return out

    async def uninstall(self) -> None:
        if self._link is not None:
            await self._link.call("capture.uninstall")
        if self._watch is not None:
            await self._watch.call("capture.unwatch")
            self._watch = None
