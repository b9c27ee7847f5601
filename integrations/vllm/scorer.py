"""Re-score rollouts on a vLLM engine under their recorded routes and sampling support (π_old).

    from moe_replay.integrations.vllm import VllmScorer, VllmScorerConfig, scoring_engine_kwargs
    llm = LLM(model=path, **scoring_engine_kwargs(dtype="bfloat16"))     # same kind as the rollout
    scorer = VllmScorer(llm, VllmScorerConfig(force_routes=True, use_support=True))
    estimates = estimate(traces, scorer, EstimatorConfig(n=4))           # moe_replay.estimator

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**scoring_engine_kwargs(...)))
    backend = await AsyncVllmScorer.attach(engine, VllmScorerConfig())   # a ScoringBackend
    async with EstimatorService(backend, EstimatorConfig(n=4)) as svc: ...

Each trace becomes one request: its full token sequence as the prompt, max_tokens=1, greedy,
prefix-cache reads skipped. The worker (force.py) forces the trace's expert ids on that request's
rows only (other requests in the same step route freely) and returns, per generated token,
log softmax(logits / temperature) renormalised over the trace's kept set, so the only thing that
varies between replicas is the engine's numerics. Results line up with
trace.token_ids_S[prompt_len:], one float per token.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ...geometry import ModelGeometry
from ...trace import RolloutTrace
from .api import EXTENSION, capture_engine_kwargs
from .errors import CaptureHookError
from .force import ForceRouteError, ScoreAlignmentError, ScoringError
from .records import pack_array, unpack_array

_METHODS = {"install": "moe_replay_score_install", "register": "moe_replay_score_register",
            "take": "moe_replay_score_take", "discard": "moe_replay_score_discard",
            "stats": "moe_replay_score_stats", "uninstall": "moe_replay_score_uninstall"}


@dataclass(frozen=True)
class VllmScorerConfig:
    """What a re-scoring replica holds fixed (routes, support) and how tokens are scored."""

    force_routes: bool = True
    """Force each trace's recorded expert ids inside the engine (traces must carry routes)."""
    use_support: bool = True
    """Renormalise over each token's recorded kept set (traces without one use the vocabulary)."""
    temperature: float = 1.0
    """Sampling temperature for traces that do not record one (capture records it in
    extra["sampling"]); scores are of softmax(logits / temperature). 0 = 1."""
    request_prefix: str = "moe-score"
    """Prefix of the engine request ids of scoring requests."""
    max_jobs: int = 65536
    """Scoring requests registered on the worker and not yet collected, at most."""

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"VllmScorerConfig.temperature must be a number >= 0, got {self.temperature!r}")
        if not self.request_prefix or "#" in self.request_prefix:
            raise ValueError(f"VllmScorerConfig.request_prefix must be non-empty without '#', got {self.request_prefix!r}")
        if self.max_jobs < 1:
            raise ValueError(f"VllmScorerConfig.max_jobs must be >= 1, got {self.max_jobs}")


def scoring_engine_kwargs(**engine_kwargs: Any) -> dict[str, Any]:
    """Engine kwargs with the moe_replay worker extension and prefix caching off by default.

    Scoring requests skip prefix-cache reads anyway; turning caching off also keeps rollouts on a
    shared engine from reading KV blocks computed under forced routes.
    """
    engine_kwargs.setdefault("enable_prefix_caching", False)
    return capture_engine_kwargs(**engine_kwargs)


class _ScorerBase:
    config: VllmScorerConfig
    geometry: ModelGeometry
    _counter = itertools.count()

    def _on_install(self, replies: list[dict[str, Any]]) -> None:
        bad = [r for r in replies if not r.get("ok")]
        if bad:
            _raise_remote(bad[0], "installing scoring on the engine failed")
        self.geometry = ModelGeometry.from_dict(replies[0]["geometry"])

    def _sampling_params(self) -> Any:
        from vllm import SamplingParams

        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, skip_reading_prefix_cache=True)

    def _temperature(self, trace: RolloutTrace) -> float:
        """The trace's recorded sampling temperature (trace.sampling; v1 records migrate theirs)."""
        return float(trace.sampling.temperature)

    def _requests(self, traces: Sequence[RolloutTrace]) -> tuple[list[str | None], list[dict[str, Any]]]:
        """Engine request id per trace (None when it has no generated token) and worker payloads."""
        ids: list[str | None] = []
        payloads = []
        tag = uuid.uuid4().hex[:12]
        g = self.geometry
        for t in traces:
            if t.num_generated == 0:
                ids.append(None)
                continue
            if (t.geometry.num_moe_layers, t.geometry.top_k, t.geometry.num_experts) != (g.num_moe_layers, g.top_k, g.num_experts) \
                    or t.geometry.vocab_size > g.vocab_size:
                raise ScoringError(f"trace {t.key!r}: geometry {t.geometry.to_dict()} does not fit the engine's {g.to_dict()}")
            if t.prompt_len < 1:
                raise ScoringError(f"trace {t.key!r}: expected a prompt of >= 1 token, found prompt_len={t.prompt_len}")
            rid = f"{self.config.request_prefix}:{next(self._counter)}:{tag}"
            p: dict[str, Any] = {"key": rid, "tokens": pack_array(t.token_ids_S.astype(np.int64)),
                                 "prompt_len": t.prompt_len, "temperature": self._temperature(t)}
            if self.config.force_routes:
                if t.routes_TLK is None:
                    raise ForceRouteError(f"trace {t.key!r} has no routes; force_routes=True needs them")
                p["routes"], p["route_start"] = pack_array(t.routes_TLK), t.route_start
            if self.config.use_support and t.support is not None:
                p["support_offsets"] = pack_array(t.support.offsets_G1)
                p["support_ids"] = pack_array(t.support.ids_N)
            ids.append(rid)
            payloads.append(p)
        return ids, payloads

    @staticmethod
    def _check_register(reply: dict[str, Any]) -> None:
        if not reply.get("ok"):
            _raise_remote(reply, "registering scoring requests failed")

    @staticmethod
    def _assemble(traces: Sequence[RolloutTrace], ids: list[str | None], replies: list[dict[str, Any]]) -> list[np.ndarray]:
        out, it = [], iter(replies)
        for t, rid in zip(traces, ids):
            if rid is None:
                out.append(np.zeros(0, dtype=np.float64))
                continue
            rep = next(it)
            if rep.get("status") != "ok":
                raise ScoreAlignmentError(f"trace {t.key!r}: the engine holds no scores for request {rid!r}")
            if rep["problems"]:
                raise ScoreAlignmentError(f"trace {t.key!r} (request {rid!r}): {rep['problems'][0]}")
            lp = unpack_array(rep["logprobs"]).astype(np.float64).reshape(-1)
            if lp.shape != (t.num_generated,):
                raise ScoreAlignmentError(f"trace {t.key!r}: expected {t.num_generated} scores, found {lp.shape}")
            out.append(lp)
        return out


def _raise_remote(reply: dict[str, Any], what: str) -> None:
    from . import errors, force

    kind = reply.get("kind", "")
    cls = getattr(force, kind, None) or getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = ScoringError
    raise cls(f"{what}: {reply.get('error')}")


class VllmScorer(_ScorerBase):
    """Synchronous scorer over a `vllm.LLM` (a BatchScorer: `score_batch(traces)`).

    While `score_batch` runs it drives the engine itself (add_request + step): do not generate on
    the same LLM from another thread meanwhile.
    """

    def __init__(self, llm: Any, config: VllmScorerConfig | None = None) -> None:
        from . import worker as W

        self.llm, self.config = llm, config or VllmScorerConfig()
        opts = {"max_jobs": self.config.max_jobs}
        try:
            replies = llm.collective_rpc(_METHODS["install"], args=(opts,))
            self._call = lambda name, *a: llm.collective_rpc(_METHODS[name], args=a)[0]
        except Exception as e:
            if _METHODS["install"] not in str(e):
                raise
            funcs = {"install": W.score_install_on_worker, "register": W.score_register_on_worker,
                     "take": W.score_take_on_worker, "discard": W.score_discard_on_worker,
                     "stats": W.score_stats_on_worker, "uninstall": W.score_uninstall_on_worker}
            try:
                replies = llm.collective_rpc(funcs["install"], args=(opts,))
            except Exception as e2:
                raise CaptureHookError(
                    f"cannot reach the engine's workers to install scoring ({type(e2).__name__}: {e2}); build the "
                    f"engine with LLM(..., **scoring_engine_kwargs()) (worker_extension_cls={EXTENSION!r})"
                ) from e2
            self._call = lambda name, *a: llm.collective_rpc(funcs[name], args=a)[0]
        self._on_install(replies)

    def with_config(self, config: VllmScorerConfig) -> "VllmScorer":
        """A scorer with other scoring settings sharing this one's engine installation."""
        other = copy.copy(self)
        other.config = config
        return other

    def submit(self, traces: Sequence[RolloutTrace]) -> list[str | None]:
        """Register and enqueue one scoring request per trace without running the engine.

        The caller steps the engine (e.g. interleaved with rollouts, as in the pipelined
        benchmark) and calls `finish(traces, ids)` once every request id has finished.
        """
        ids, payloads = self._requests(traces)
        live = [r for r in ids if r is not None]
        if not live:
            return ids
        self._check_register(self._call("register", payloads))
        eng = self.llm.llm_engine
        sp = self._sampling_params()
        try:
            for rid, t in zip(ids, traces):
                if rid is not None:
                    eng.add_request(rid, {"prompt_token_ids": t.token_ids_S.tolist()}, sp)
        except BaseException:
            self.cancel(ids)
            raise
        return ids

    def finish(self, traces: Sequence[RolloutTrace], ids: list[str | None]) -> list[np.ndarray]:
        """Scores of submitted traces whose requests have finished (they leave the worker)."""
        live = [r for r in ids if r is not None]
        return self._assemble(traces, ids, self._call("take", live) if live else [])

    def cancel(self, ids: list[str | None]) -> None:
        live = [r for r in ids if r is not None]
        try:
            self.llm.llm_engine.abort_request(live)
        finally:
            self._call("discard", live)

    def score_batch(self, traces: Sequence[RolloutTrace]) -> list[np.ndarray]:
        """Logprobs of each trace's generated tokens [G], in the order given; one engine batch."""
        ids = self.submit(traces)
        eng = self.llm.llm_engine
        try:
            pending = {r for r in ids if r is not None}
            while pending:
                if not eng.has_unfinished_requests():
                    raise ScoringError(f"the engine finished without returning {sorted(pending)[:3]}")
                for o in eng.step():
                    if o.finished:
                        pending.discard(o.request_id)
        except BaseException:
            self.cancel(ids)
            raise
        return self.finish(traces, ids)

    __call__ = score_batch

    def stats(self) -> dict[str, Any]:
        return self._call("stats")

    def uninstall(self) -> None:
        self._call("uninstall")


class AsyncVllmScorer(_ScorerBase):
    """ScoringBackend over `vllm.v1.engine.async_llm.AsyncLLM`: `await AsyncVllmScorer.attach(engine)`.

    Concurrent `score()` calls share the engine: their requests are batched together by vLLM's
    scheduler (each request keeps its own routes and support).
    """

    def __init__(self, engine: Any, config: VllmScorerConfig) -> None:
        self.engine, self.config = engine, config

    @classmethod
    async def attach(cls, engine: Any, config: VllmScorerConfig | None = None) -> "AsyncVllmScorer":
        self = cls(engine, config or VllmScorerConfig())
        try:
            replies = await engine.collective_rpc(_METHODS["install"], args=({"max_jobs": self.config.max_jobs},))
        except Exception as e:
            raise CaptureHookError(
                f"cannot install scoring on this AsyncLLM ({type(e).__name__}: {e}); build it with "
                "AsyncEngineArgs(..., **scoring_engine_kwargs())"
            ) from e
        self._on_install(replies)
        return self

    async def _call(self, name: str, *args: Any) -> Any:
        return (await self.engine.collective_rpc(_METHODS[name], args=args))[0]

    async def score(self, traces: Sequence[RolloutTrace]) -> list[np.ndarray]:
        ids, payloads = self._requests(traces)
        live = [r for r in ids if r is not None]
        if not live:
            return self._assemble(traces, ids, [])
        self._check_register(await self._call("register", payloads))
        sp = self._sampling_params()

        async def one(rid: str, t: RolloutTrace) -> None:
            async for _ in self.engine.generate({"prompt_token_ids": t.token_ids_S.tolist()}, sp, request_id=rid):
                pass

        try:
            await asyncio.gather(*(one(r, t) for r, t in zip(ids, traces) if r is not None))
            replies = await self._call("take", live)
        except BaseException:
            await asyncio.shield(self._call("discard", live))
            raise
        return self._assemble(traces, ids, replies)

    async def stats(self) -> dict[str, Any]:
        return await self._call("stats")

    async def uninstall(self) -> None:
        await self._call("uninstall")
