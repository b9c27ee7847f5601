"""Re-score rollouts on a vLLM engine under their recorded routes and sampling support (π_old).

    from moe_replay.integrations.vllm import VllmScorer, VllmScorerConfig, scoring_engine_kwargs
    llm = LLM(model=path, **scoring_engine_kwargs(dtype="bfloat16"))     # same kind as the rollout
    scorer = VllmScorer(llm, VllmScorerConfig(force_routes=True, use_support=True))
    estimates = estimate(traces, scorer, EstimatorConfig(n=4))           # moe_replay.estimator

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**scoring_engine_kwargs(...)))
    backend = await AsyncVllmScorer.attach(engine, VllmScorerConfig())   # a ScoringBackend
    async with EstimatorService(backend, EstimatorConfig(n=4)) as svc: ...

Each trace becomes one request: its full token sequence as the prompt, max_tokens=1, greedy,
under a cache salt keyed by its prompt routes and the weights version. With prompt reuse (the
default on engines built by `scoring_engine_kwargs`; prefix.py) a replica reads the prompt's KV
cached by an earlier replica and forwards only the last prompt token and the response; with
`prompt_reuse=False` every replica forwards every token; with `read_rollout_kv=True` (scoring on
the engine that sampled) every replica, the first one too, reads the rollout's own prompt blocks. The worker (force.py) forces the trace's expert ids on that request's
rows only (other requests in the same step route freely) and returns, per generated token,
log softmax(logits / temperature) renormalised over the trace's kept set, so the only thing that
varies between replicas is the engine's numerics. Results line up with
trace.token_ids_S[prompt_len:], one float per token.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import itertools
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np

from ....geometry import ModelGeometry
from ....identity import check_consumer
from ....trace import RolloutTrace
from ..engine_kwargs import capture_engine_kwargs
from ..errors import ForceRouteError, PrefixCacheMissError, ScoreAlignmentError, ScoringError
from ..link import MERGES, AsyncLink, SyncLink, engine_count
from ..model import refuse_pipeline_parallel
from ..patch import FORCE_FLAG, flag_value
from ..wire import InstallReply, ScoreRequest, ScoreResult
from .force import data_parallel_force_refusal
from .prefix import (CACHE_UPTO_KEY, READ_UPTO_KEY, SCHEDULER_QUALNAME, cache_salt, engine_for_prompt,
                     engine_reuse_ready, prompt_key, reusable_tokens)

_LINK = {"what": "scoring", "default": ScoringError, "kwargs_fn": "scoring_engine_kwargs"}


def _take_scores(per_engine: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """`score.take` over data-parallel engines: per request, the result of the one engine that ran it.

    Registration goes to every engine (the client cannot tell which core vLLM will pick), so each
    engine answers 'ok' for every key; only the engine that forwarded the request's rows has seen
    it (`cached` >= 0). None seen: the first engine's result (its problems say what was never
    scored); two seen is a problem of that request, never a silent pick."""
    out = []
    for replies in zip(*per_engine):
        seen = [i for i, r in enumerate(replies) if r.get("status") == "ok" and int(r.get("cached", -1)) >= 0]
        if len(seen) == 1:
            out.append(replies[seen[0]])
        elif seen:
            out.append({**replies[seen[0]], "problems": [
                f"expected one data-parallel engine to run the request, found engines {seen}"]})
        else:
            out.append(replies[0])
    return out


MERGES["score.take"] = _take_scores


@dataclass(frozen=True)
class VllmScorerConfig:
    """What a re-scoring replica holds fixed (routes, support) and how tokens are scored."""

    force_routes: bool = True
    """Force each trace's recorded expert ids inside the engine (traces must carry routes)."""
    use_support: bool = True
    """Renormalise over each token's recorded kept set (traces without one use the vocabulary)."""
    prompt_reuse: bool | None = None
    """Read each trace's prompt KV from the prefix cache and forward only the last prompt token and
    the response (prefix.py). None: when the engine was built for it (scoring_engine_kwargs with
    prompt_reuse=True, the default), else full re-scoring; False: always full re-scoring (every
    token forwarded by every replica; also averages the engine's noise in the prompt's KV);
    True: required (an engine not built for it is an error)."""
    on_reuse_miss: Literal["error", "count"] = "error"
    """A replica whose prompt blocks were cached by an earlier scoring of the same salt but were not
    hit (evicted, reset): 'error' fails that rollout naming it; 'count' scores it in full and counts
    it in `reuse_stats['misses']`."""
    read_rollout_kv: bool = False
    """The traces were sampled on this engine (a sidecar on the rollout engine): every replica reads
    the rollout's own unsalted prompt blocks (computed under the routes the trace recorded), caches
    nothing (write cap 0) and forwards the prompt's tail and the response (prefix.py). Every
    replica is promised floor((P - 1) / block_size) * block_size cached tokens, the first one too;
    a miss (evicted, reset by a weight update, sampled elsewhere) is handled per `on_reuse_miss`.
    Needs force_routes (the rollout's KV matches its recorded routes only) and prompt reuse."""
    weights_version: str | int | None = None
    """The weights the engine holds (a step or checkpoint fingerprint; None or "": not tracked; what
    `mr.weights_version` sets). A trace sampled under another version, or under none recorded, is refused
    (WeightsVersionError) unless `off_policy`, and the rollout's own logprobs never count as a replica of
    other weights (moe_replay/identity.py). Part of every cache salt: KV cached under other weights is
    never read (update_weights also resets the prefix cache)."""
    off_policy: bool = False
    """Score traces of other weights versions under these weights on purpose (the estimates say so:
    PiOldEstimate.off_policy, .weights_version)."""
    salt: str = ""
    """More text of every cache salt, naming nothing else: a fresh one gives the scorer a cold prefix
    cache (benchmarks time cold runs so)."""
    request_prefix: str = "moe-score"
    """Prefix of the engine request ids of scoring requests."""
    max_jobs: int = 65536
    """Scoring requests registered on the worker and not yet collected, at most."""

    def __post_init__(self) -> None:
        v = self.weights_version
        if v is not None and (isinstance(v, bool) or not isinstance(v, (str, int))):
            raise ValueError(f"VllmScorerConfig.weights_version must be a str, an int or None, got {v!r}")
        if v == "":
            object.__setattr__(self, "weights_version", None)
        if not isinstance(self.off_policy, bool):
            raise ValueError(f"VllmScorerConfig.off_policy must be True or False, got {self.off_policy!r}")
        if not self.request_prefix or "#" in self.request_prefix:
            raise ValueError(f"VllmScorerConfig.request_prefix must be non-empty without '#', got {self.request_prefix!r}")
        if self.on_reuse_miss not in ("error", "count"):
            raise ValueError(f"VllmScorerConfig.on_reuse_miss must be 'error' or 'count', got {self.on_reuse_miss!r}")
        if self.prompt_reuse not in (None, True, False):
            raise ValueError(f"VllmScorerConfig.prompt_reuse must be None, True or False, got {self.prompt_reuse!r}")
        if self.read_rollout_kv and (not self.force_routes or self.prompt_reuse is False):
            raise ValueError("VllmScorerConfig.read_rollout_kv=True needs force_routes=True and prompt_reuse not False, "
                             f"got force_routes={self.force_routes!r}, prompt_reuse={self.prompt_reuse!r}")
        if self.max_jobs < 1:
            raise ValueError(f"VllmScorerConfig.max_jobs must be >= 1, got {self.max_jobs}")


def scoring_engine_kwargs(*, prompt_reuse: bool = True, **engine_kwargs: Any) -> dict[str, Any]:
    """Engine kwargs with the moe_replay worker extension (capture + scoring), the load-time forcing
    step for compiled forwards (additional_config FORCE_FLAG: forced scoring works with vLLM's
    default enforce_eager=False) and, for prompt reuse, prefix caching on and the scheduler that
    caps what scoring requests cache (prefix.py).

    Rollouts on the same engine are unaffected: their requests carry no cap, and scoring requests
    carry their own cache salt, so neither ever reads the other's KV.
    """
    if prompt_reuse:
        if engine_kwargs.get("enable_prefix_caching") is False:
            raise ValueError("scoring_engine_kwargs(prompt_reuse=True) needs enable_prefix_caching; "
                             "pass prompt_reuse=False for an engine without it")
        engine_kwargs["enable_prefix_caching"] = True
        engine_kwargs.setdefault("scheduler_cls", SCHEDULER_QUALNAME)
    else:
        engine_kwargs.setdefault("enable_prefix_caching", False)
    extra = engine_kwargs.get("additional_config") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"additional_config must be a dict to add {FORCE_FLAG!r}, got {type(extra).__name__}")
    # the routers' forcing step, bound at load when the forward is compiled (force_step.py)
    engine_kwargs["additional_config"] = {**extra, FORCE_FLAG: flag_value(FORCE_FLAG)}
    return capture_engine_kwargs(**engine_kwargs)


class _ScorerBase:
    config: VllmScorerConfig
    geometry: ModelGeometry
    _counter = itertools.count()

    def _on_install(self, link: Any, values: list[dict[str, Any]]) -> None:
        self._link = link
        self.geometry = ModelGeometry.from_dict(InstallReply.from_dict(values[0]).geometry)

    def _prepare(self, vllm_config: Any, engines: int = 1) -> None:
        """Client-side state, checked before anything is installed on the engine."""
        refuse_pipeline_parallel(vllm_config, "forced scoring")
        self._force_block = data_parallel_force_refusal(vllm_config)
        """None if this engine can force routes, else why not (free scoring works regardless)."""
        self._check_force(self.config)
        self.engines = engines
        """Engine cores behind the client (data parallelism); a trace's replicas go to one of them."""
        self.block_size = int(vllm_config.cache_config.block_size)
        self.engine_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        """The scoring engine's compute dtype, spelt as capture records it (EngineInfo.dtype)."""
        self._reuse_block = engine_reuse_ready(vllm_config)
        """None if this engine can reuse prompt KV, else why not."""
        self._warm: dict[str, int] = {}
        """prefix.prompt_key -> prompt tokens a later replica is promised to read (an earlier one cached them)."""
        self._promised: dict[str | None, int] = {}
        """Request id -> prompt tokens it was promised to read from the cache, until assembled."""
        self.reuse_stats = collections.Counter()
        """requests, tokens, cached_tokens (prefix-cache hits the engine reported), promised_tokens, misses."""
        self._check_reuse(self.config)

    @property
    def weights_version(self) -> str | int | None:
        """The weights this scorer scores under (config.weights_version; identity.py)."""
        return self.config.weights_version

    @property
    def off_policy(self) -> bool:
        """Whether traces of other weights versions are scored on purpose (config.off_policy)."""
        return self.config.off_policy

    def with_weights(self, weights_version: str | int | None, off_policy: bool = False):
        """This scorer under `weights_version` (sharing its engine installation): what
        `mr.weights_version = v` and `mr.pi_old(..., off_policy=...)` use."""
        return self.with_config(dataclasses.replace(self.config, weights_version=weights_version, off_policy=off_policy))

    def _salt_version(self) -> str:
        """What of the config names the weights in a cache salt (prefix.cache_salt)."""
        v = self.config.weights_version
        return ("" if v is None else f"{type(v).__name__}:{v}") + (f"|{self.config.salt}" if self.config.salt else "")

    def with_config(self, config: VllmScorerConfig):
        """A scorer with other scoring settings sharing this one's engine installation."""
        other = copy.copy(self)  # shares the engine, its warm salts and pending promises
        other.config = config
        other.reuse_stats = collections.Counter()
        other._check_force(config)
        other._check_reuse(config)
        return other

    def _check_force(self, config: VllmScorerConfig) -> None:
        if config.force_routes and self._force_block is not None:
            raise ForceRouteError(f"VllmScorerConfig(force_routes=True): {self._force_block}")

    def _check_reuse(self, config: VllmScorerConfig) -> None:
        if (config.prompt_reuse or config.read_rollout_kv) and self._reuse_block is not None:
            what = "read_rollout_kv=True" if config.read_rollout_kv else "prompt_reuse=True"
            raise ScoringError(f"VllmScorerConfig({what}): this engine cannot reuse prompt KV: {self._reuse_block}")

    @property
    def prompt_reuse(self) -> bool:
        """Whether this scorer reads prompt KV from the prefix cache (config, resolved on the engine)."""
        return self._reuse_block is None if self.config.prompt_reuse is None else self.config.prompt_reuse

    def recorded_logprobs_problem(self, trace: RolloutTrace) -> str | None:
        """None when `trace.logprobs_G` is exactly what one replica of this scorer returns, else why not
        (EstimatorConfig.rollout_replica counts the recorded values as a replica only then).

        What capture records per generated token (capture/sampler_hook.py; native: processed_logprobs) is
        x[token] - logsumexp(x[kept]) with x = logits / T, routed by the routes the trace holds; a
        replica returns the same expression with the trace's T and kept set, routed by those routes
        (forced) or by the engine again (free, as the rollout was). It differs where the replica
        normalises over the vocabulary (no use_support, or no kept set recorded), where the rollout
        ran in another precision, or where the numbers come from an engine other than vLLM's sampler
        (other weights: the estimator's core refuses them, identity.replica_version_problem).
        """
        if not self.config.use_support:
            return ("this scorer normalises over the whole vocabulary (use_support=False); the rollout's "
                    "recorded logprob is normalised over its kept set")
        if trace.support is None:
            how = "omitted (support overflow)" if trace.extra.get("support_omitted") else "not recorded"
            return (f"the trace's kept set is {how}: its recorded logprob is normalised over that set, a "
                    "replica would normalise over the vocabulary")
        if trace.engine.name != "vllm":
            return f"the trace's logprobs come from engine {trace.engine.name!r}, not vLLM's sampler"
        if trace.sampling.adjusted:
            return (f"the rollout's logits were adjusted by {', '.join(trace.sampling.adjusted)} before "
                    "sampling: its recorded logprob is of those logits, a replica scores the model's own")
        if trace.engine.dtype != self.engine_dtype:
            return f"the rollout ran in {trace.engine.dtype}, this scoring engine in {self.engine_dtype}"
        return None  # the weights versions: the estimator's core checks them (identity.replica_version_problem)

    def _sampling_params(self, max_cached: int, max_read: int) -> Any:
        from vllm import SamplingParams

        # write cap: a reusing request caches its prompt (minus the last token), never its response;
        # full re-scoring and reads of the rollout's unsalted blocks cache nothing; read cap: the
        # lookup never hits past the prompt (extra_args are read by prefix.ScoringScheduler)
        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                              skip_reading_prefix_cache=not self.prompt_reuse,
                              extra_args={CACHE_UPTO_KEY: max_cached, READ_UPTO_KEY: max_read})

    def _engine_of(self, trace: RolloutTrace) -> int | None:
        """The data-parallel engine core a reusing replica must run on (the one whose prefix cache
        its earlier replicas filled); None: any (one engine, or nothing to reuse)."""
        if not self.prompt_reuse or self.config.read_rollout_kv:
            return None
        return engine_for_prompt(self._prompt_key(trace), self.engines)

    def _prompt_key(self, trace: RolloutTrace) -> str:
        """Names the prompt blocks a reusing replica of `trace` reads (prefix.prompt_key)."""
        return prompt_key(trace, cache_salt(trace, self.config.force_routes, self._salt_version()))

    def _temperature(self, trace: RolloutTrace) -> float:
        """The trace's recorded sampling temperature (trace.sampling; v1 records migrate theirs)."""
        return float(trace.sampling.temperature)

    def _prompt(self, trace: RolloutTrace) -> tuple[dict[str, Any], Any]:
        """vLLM prompt (tokens + cache salt) and sampling params of one scoring request."""
        max_read = trace.prompt_len - 1 if self.prompt_reuse else 0
        if self.config.read_rollout_kv:  # the rollout's own blocks: no salt, write nothing
            return {"prompt_token_ids": trace.token_ids_S.tolist()}, self._sampling_params(0, max_read)
        salt = cache_salt(trace, self.config.force_routes, self._salt_version())
        prompt = {"prompt_token_ids": trace.token_ids_S.tolist(), "cache_salt": salt}
        return prompt, self._sampling_params(max_read, max_read)

    def _requests(self, traces: Sequence[RolloutTrace]) -> tuple[list[str | None], list[dict[str, Any]]]:
        """Engine request id per trace (None when it has no generated token) and the ScoreRequests
        (wire dicts) to register."""
        ids: list[str | None] = []
        payloads = []
        tag = uuid.uuid4().hex[:12]
        # the one identity check of every consumer (identity.py): geometry field by field, family included,
        # and the weights version (GeometryMismatchError, WeightsVersionError), on either model runner
        check_consumer(traces, self, "the scoring engine vs the trace")
        for t in traces:
            t.require_single_span("the vLLM scorer (it scores positions prompt_len..S-1)")
            if t.num_generated == 0:
                ids.append(None)
                continue
            if t.prompt_len < 1:
                raise ScoringError(f"trace {t.key!r}: expected a prompt of >= 1 token, found prompt_len={t.prompt_len}")
            rid = f"{self.config.request_prefix}:{next(self._counter)}:{tag}"
            routes = route_start = None
            if self.config.force_routes:
                if t.routes_TLK is None:
                    raise ForceRouteError(f"trace {t.key!r} has no routes; force_routes=True needs them")
                routes, route_start = t.routes_TLK, t.route_start
            sup = t.support if self.config.use_support else None
            p = ScoreRequest(rid, t.token_ids_S.astype(np.int64), t.prompt_len, self._temperature(t),
                             max_cached=t.prompt_len - 1 if self.prompt_reuse else 0, route_start=route_start or 0,
                             routes_TLK=routes, support_offsets_G1=None if sup is None else sup.offsets_G1,
                             support_ids_N=None if sup is None else sup.ids_N).to_dict()
            if self.config.read_rollout_kv:  # promised: the rollout cached its prompt's blocks
                self._promised[rid] = reusable_tokens(t.prompt_len, self.block_size)
            elif self.prompt_reuse:  # promised: an earlier scoring of this salt cached the prompt's blocks
                self._promised[rid] = self._warm.get(self._prompt_key(t), 0)
            ids.append(rid)
            payloads.append(p)
        return ids, payloads

    def _assemble(self, traces: Sequence[RolloutTrace], ids: list[str | None], replies: list[dict[str, Any]]) -> list[np.ndarray]:
        out, it = [], iter(replies)
        st = self.reuse_stats
        wants = [self._promised.pop(rid, 0) for rid in ids]
        for t, rid, want in zip(traces, ids, wants):
            if rid is None:
                out.append(np.zeros(0, dtype=np.float64))
                continue
            rep = ScoreResult.from_dict(next(it))
            if rep.status != "ok":
                raise ScoreAlignmentError(f"trace {t.key!r}: the engine holds no scores for request {rid!r}")
            if rep.problems:
                raise ScoreAlignmentError(f"trace {t.key!r} (request {rid!r}): {rep.problems[0]}")
            got = int(rep.cached)
            st["requests"] += 1
            st["tokens"] += t.num_tokens
            st["cached_tokens"] += got
            st["promised_tokens"] += want
            if got < want:
                st["misses"] += 1
                if self.config.on_reuse_miss == "error":
                    who = ("its rollout on this engine cached them" if self.config.read_rollout_kv
                           else "an earlier replica cached them")
                    raise PrefixCacheMissError(
                        f"trace {t.key!r} (request {rid!r}): prompt reuse promised {want} cached prompt tokens ({who}), "
                        f"found {got}: the blocks were evicted, the cache was reset (weight update) or the rollout "
                        "ran elsewhere")
            if self.prompt_reuse and not self.config.read_rollout_kv:
                reusable = reusable_tokens(t.prompt_len, self.block_size)
                if reusable:
                    self._warm[self._prompt_key(t)] = reusable
            lp = np.asarray(rep.logprobs_G).astype(np.float64).reshape(-1)
            if lp.shape != (t.num_generated,):
                raise ScoreAlignmentError(f"trace {t.key!r}: expected {t.num_generated} scores, found {lp.shape}")
            out.append(lp)
        return out


class VllmScorer(_ScorerBase):
    """Synchronous scorer over a `vllm.LLM` (a BatchScorer: `score_batch(traces)`).

    While `score_batch` runs it drives the engine itself (add_request + step): do not generate on
    the same LLM from another thread meanwhile.
    """

    def __init__(self, llm: Any, config: VllmScorerConfig | None = None) -> None:
        self.llm, self.config = llm, config or VllmScorerConfig()
        self._prepare(llm.llm_engine.vllm_config)
        self._on_install(*SyncLink.open(llm, "score.install", {"max_jobs": self.config.max_jobs}, **_LINK))

    def submit(self, traces: Sequence[RolloutTrace]) -> list[str | None]:
        """Register and enqueue one scoring request per trace without running the engine.

        The caller steps the engine (e.g. interleaved with rollouts, as in the pipelined
        benchmark) and calls `finish(traces, ids)` once every request id has finished.
        """
        ids, payloads = self._requests(traces)
        live = [r for r in ids if r is not None]
        if not live:
            return ids
        self._link.call("score.register", payloads, "registering scoring requests failed")
        eng = self.llm.llm_engine
        try:
            for rid, t in zip(ids, traces):
                if rid is not None:
                    eng.add_request(rid, *self._prompt(t))
        except BaseException:
            self.cancel(ids)
            raise
        return ids

    def finish(self, traces: Sequence[RolloutTrace], ids: list[str | None]) -> list[np.ndarray]:
        """Scores of submitted traces whose requests have finished (they leave the worker)."""
        live = [r for r in ids if r is not None]
        return self._assemble(traces, ids, self._link.call("score.take", live) if live else [])

    def cancel(self, ids: list[str | None]) -> None:
        live = [r for r in ids if r is not None]
        for r in live:
            self._promised.pop(r, None)
        try:
            self.llm.llm_engine.abort_request(live)
        finally:
            self._link.call("score.discard", live)

    def score_batch(self, traces: Sequence[RolloutTrace]) -> list[np.ndarray]:
        """Logprobs of each trace's generated tokens [G], in the order given; one engine batch."""
        return self.score_batches([traces])[0]

    def score_batches(self, batches: Sequence[Sequence[RolloutTrace]]) -> list[list[np.ndarray]]:
        """Every batch submitted before the engine runs, so all are in flight together: the engine
        packs them into its steps as it would a rollout's requests, instead of one drain per batch
        (on an H200, n = 4 replicas of 64 rollouts drained batch by batch cost 7.2x an HF
        recompute, of which the 64 drains of one request each were 0.36 s of 0.83: docs/findings.md).
        Results per batch, in the order given; a batch may repeat traces of another (replicas)."""
        submitted: list[list[str | None]] = []
        eng = self.llm.llm_engine
        try:
            for traces in batches:
                submitted.append(self.submit(traces))
            pending = {r for ids in submitted for r in ids if r is not None}
            while pending:
                if not eng.has_unfinished_requests():
                    raise ScoringError(f"the engine finished without returning {sorted(pending)[:3]}")
                for o in eng.step():
                    if o.finished:
                        pending.discard(o.request_id)
        except BaseException:
            self.cancel([r for ids in submitted for r in ids])  # one abort and one discard for all
            raise
        return [self.finish(traces, ids) for traces, ids in zip(batches, submitted)]

    __call__ = score_batch

    def stats(self) -> dict[str, Any]:
        return self._link.call("score.stats")

    def uninstall(self) -> None:
        self._link.call("score.uninstall")


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
        self._prepare(engine.vllm_config, engine_count(engine))
        self._on_install(*await AsyncLink.open(engine, "score.install", {"max_jobs": self.config.max_jobs}, **_LINK))
        return self

    async def score(self, traces: Sequence[RolloutTrace]) -> list[np.ndarray]:
        ids, payloads = self._requests(traces)
        live = [r for r in ids if r is not None]
        if not live:
            return self._assemble(traces, ids, [])
        await self._link.call("score.register", payloads, "registering scoring requests failed")
        async def one(rid: str, t: RolloutTrace) -> None:
            rank = self._engine_of(t)  # a replica runs where its prompt's KV was cached
            async for _ in self.engine.generate(*self._prompt(t), request_id=rid, data_parallel_rank=rank):
                pass

        try:
            await asyncio.gather(*(one(r, t) for r, t in zip(ids, traces) if r is not None))
            replies = await self._link.call("score.take", live)
        except BaseException:
            for r in live:
                self._promised.pop(r, None)
            await asyncio.shield(self._link.call("score.discard", live))
            raise
        return self._assemble(traces, ids, replies)

    async def stats(self) -> dict[str, Any]:
        return await self._link.call("score.stats")

    async def uninstall(self) -> None:
        await self._link.call("score.uninstall")
