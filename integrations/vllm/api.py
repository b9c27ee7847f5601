"""Public API: attach capture to a vLLM engine, generate, collect one trace per sample.

    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture, capture_engine_kwargs
    llm = LLM(model=path, **capture_engine_kwargs())       # or any LLM (in-process engine)
    with VllmCapture(llm, CaptureConfig(max_support=4096)) as cap:
        outputs, traces = cap.generate(prompts, SamplingParams(top_p=0.9, n=4))

The client reaches the workers through one link (link.py; sync LLM or AsyncLLM); the worker half
is endpoint.py (ops) and worker.py (capture state on the runner).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from ...capture_config import CaptureConfig
from ...geometry import EngineInfo, ModelGeometry
from ...trace import RolloutTrace, Sampling
from .assemble import build_trace, completions_of
from .errors import CaptureHookError, CollectError, UnknownRequestError
from .link import EXTENSION, AsyncLink, SyncLink
from .wire import CaptureRecord, InstallReply

_LINK = {"what": "capture", "default": CaptureHookError, "kwargs_fn": "capture_engine_kwargs"}


def capture_abi() -> str:
    """Hash of the capture function's source (route_hook.py): the value of the load-time flag, so
    vLLM's compile cache never serves a graph traced with another version of it."""
    import hashlib
    from pathlib import Path

    from . import route_hook

    return hashlib.sha256(Path(route_hook.__file__).read_bytes()).hexdigest()[:16]


def capture_engine_kwargs(**engine_kwargs: Any) -> dict[str, Any]:
    """Engine kwargs for capture (LLM(...), AsyncEngineArgs(...)): the worker extension (the RPC
    endpoint) and `additional_config[CAPTURE_FLAG]`, which makes the load hook bind the route step
    buffer before the forward is compiled (needed for enforce_eager=False; patch.py). Also installs
    that hook in this process, for in-process engines."""
    from .patch import CAPTURE_FLAG, install_load_hook
    from .versions import check_vllm_version

    check_vllm_version()
    ext = engine_kwargs.get("worker_extension_cls")
    if ext and ext != EXTENSION:
        raise ValueError(f"worker_extension_cls is already set to {ext!r}; capture needs {EXTENSION!r}")
    extra = engine_kwargs.get("additional_config") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"additional_config must be a dict to add {CAPTURE_FLAG!r}, got {type(extra).__name__}")
    install_load_hook()
    return {**engine_kwargs, "worker_extension_cls": EXTENSION,
            "additional_config": {**extra, CAPTURE_FLAG: capture_abi()}}


def sampling_summary(params: Any) -> dict[str, Any]:
    """The sampling parameters a trainer needs to score like the sampler did (msgpack-able)."""
    return {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k if params.top_k is not None else -1),
        "min_p": float(params.min_p),
        "seed": params.seed,
    }


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

    def _requests(self, outputs: Iterable[Any]) -> list[tuple[str, str, Any, Any]]:
        items = []
        for out in outputs:
            for key, wkey, comp in completions_of(out):
                items.append((key, wkey, comp, out))
        return items

    def _assemble(self, items, payloads, store, sampling: dict[str, dict[str, Any]] | None = None) -> list[RolloutTrace]:
        traces, failures = [], {}
        for (key, _, comp, out), payload in zip(items, payloads):
            try:
                if not out.finished:
                    raise UnknownRequestError(f"request {key!r} has not finished; collect final outputs only")
                record = CaptureRecord.from_dict(payload)
                trace = build_trace(key, out.prompt_token_ids, comp, record, self.geometry, self.config, self.engine_info)
                if sampling and out.request_id in sampling:
                    trace.sampling = Sampling.from_dict(sampling[out.request_id])
                trace.weights_version = self.weights_version
                traces.append(trace)
            except Exception as e:  # one bad request never costs the others their traces
                failures[key] = e
        if store is not None:
            for t in traces:
                store.put(t)
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
        self.engine_info = _engine_info(llm.llm_engine.model_config)
        self._on_install(*SyncLink.open(llm, "capture.install", self.config.to_dict(), **_LINK))
        if reset_prefix_cache:
            llm.reset_prefix_cache()

    def generate(self, prompts: Any, sampling_params: Any = None, *, store: Any = None, **kwargs: Any):
        """`LLM.generate` then `collect`: returns (outputs, traces), traces in output/sample order.

        Each trace's `sampling` records its request's sampling parameters (temperature, top_p,
        top_k, min_p, seed), so a trainer or scorer reads them from the trace.
        """
        outputs = self.llm.generate(prompts, sampling_params, **kwargs)
        if sampling_params is None:
            sampling_params = self.llm.get_default_sampling_params()
        per_prompt = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(outputs)
        sampling = {out.request_id: sampling_summary(sp) for out, sp in zip(outputs, per_prompt)}
        return outputs, self.collect(outputs, store=store, sampling=sampling)

    def collect(self, outputs: Sequence[Any], *, store: Any = None,
                sampling: dict[str, dict[str, Any]] | None = None) -> list[RolloutTrace]:
        """One trace per sample of each finished RequestOutput; the records leave the worker.

        `sampling` (request id -> sampling_summary(params)) becomes each trace's `sampling`.
        Raises CollectError (with `.traces` = every good trace, already put to `store`) when some
        requests fail (aborted, unknown, evicted, support overflow under 'error', misaligned).
        """
        items = self._requests(outputs)
        payloads = self._link.call("capture.take", [wkey for _, wkey, _, _ in items]) if items else []
        return self._assemble(items, payloads, store, sampling)

    def discard(self, request_ids: Sequence[str]) -> int:
        """Drop worker records (e.g. of aborted requests); returns how many were dropped."""
        return int(self._link.call("capture.discard", list(request_ids)))

    def stats(self) -> dict[str, Any]:
        return self._link.call("capture.stats")

    def uninstall(self) -> None:
        self._link.call("capture.uninstall")

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
        self.engine_info = _engine_info(engine.model_config)

    @classmethod
    async def attach(cls, engine: Any, config: CaptureConfig | None = None, *, reset_prefix_cache: bool = True):
        self = cls(engine, config or CaptureConfig())
        self._on_install(*await AsyncLink.open(engine, "capture.install", self.config.to_dict(), **_LINK))
        if reset_prefix_cache:
            await engine.reset_prefix_cache()
        return self

    async def collect(self, outputs: Sequence[Any], *, store: Any = None,
                      sampling: dict[str, dict[str, Any]] | None = None) -> list[RolloutTrace]:
        """As VllmCapture.collect; pass `sampling` ({request id: sampling_summary(params)}) to record
        each request's sampling parameters in its traces."""
        items = self._requests(outputs)
        payloads = await self._link.call("capture.take", [wkey for _, wkey, _, _ in items]) if items else []
        return self._assemble(items, payloads, store, sampling)

    async def discard(self, request_ids: Sequence[str]) -> int:
        return int(await self._link.call("capture.discard", list(request_ids)))

    async def stats(self) -> dict[str, Any]:
        return await self._link.call("capture.stats")

    async def uninstall(self) -> None:
        await self._link.call("capture.uninstall")
