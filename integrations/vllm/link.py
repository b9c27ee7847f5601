"""The client end: one link to the workers of a sync (`LLM`) or an async (`AsyncLLM`) engine.

Capture (capture/api.py) and scoring (scoring/scorer.py) reach the workers only through a link's
`call(op, payload)`. How is chosen once, when the link opens with an install op:
  worker_extension_cls  collective_rpc("moe_replay_call", (op, payload)) on an engine built with
                        the worker extension (capture_engine_kwargs / scoring_engine_kwargs); works
                        in-process and multi-process;
  callable              collective_rpc(endpoint.call, (op, payload)) on an in-process LLM built
                        without it (vLLM ships the function to its in-process worker).
An AsyncLLM's workers live in another process, so it needs the extension. A reply that carries a
worker-side error is re-raised here as the same class (errors.py) with the worker's message.

Data parallelism: an AsyncLLM with data_parallel_size > 1 drives several engine cores, each
serving its own requests, and vLLM's client answers a collective_rpc with the first engine's reply
only. The async link therefore calls every engine (`call_utility_all_async`) and merges their
values per op (`merge_engines`): a record comes from the one engine that holds it. A sync `LLM`
serves data parallelism as one engine per process (vLLM refuses DP in one LLM), so its link reads
its own engine.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn

from . import endpoint
from .errors import CaptureHookError
from .timings import merge_worker_timings
from .versions import check_release

EXTENSION = "moe_replay.integrations.vllm.endpoint.ReplayWorkerExtension"
"""Qualified name to pass as vLLM's `worker_extension_cls`."""
METHOD = "moe_replay_call"
"""The extension's one method (endpoint.ReplayWorkerExtension)."""


def raise_failure(reply: dict[str, Any], what: str, default: type[Exception]) -> NoReturn:
    """Re-raise a worker's failure reply as its own error class (else `default`), prefixed by `what`."""
    from . import errors

    cls = getattr(errors, reply.get("kind", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = default
    raise cls(f"{what}: {reply.get('error')}")


def _values(replies: list[dict[str, Any]], what: str, default: type[Exception]) -> list[Any]:
    bad = [r for r in replies if not r.get("ok")]
    if bad:
        raise_failure(bad[0], what, default)
    return [r["value"] for r in replies]


def _take(per_engine: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per key, the record of the one engine that holds it; else the most telling refusal."""
    out = []
    for replies in zip(*per_engine):
        held = [r for r in replies if r.get("status") == "ok"]
        if len(held) == 1:
            out.append(held[0])
        elif held:
            out.append({"status": "ambiguous", "key": held[0].get("key", ""),
                        "matches": [f"engine {i}: {r.get('req_id')}" for i, r in enumerate(replies) if r in held]})
        else:  # an engine's own ambiguity, then an eviction, say more than "unknown"
            told = [r for status in ("ambiguous", "evicted") for r in replies if r.get("status") == status]
            out.append(told[0] if told else {**replies[0], "known": sum(int(r.get("known", 0)) for r in replies)})
    return out


def _stats(per_engine: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters summed over engines; each engine's own stats under 'engines'."""
    out: dict[str, Any] = {k: v for k, v in per_engine[0].items()
                           if all(e.get(k) == v for e in per_engine)}
    for k, v in per_engine[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = sum(e.get(k, 0) for e in per_engine)
    out["engines"] = per_engine
    return out


MERGES: dict[str, Callable[[list[Any]], Any]] = {"take": _take, "stats": _stats, "discard": sum, "uninstall": all,
                                                 "timings": merge_worker_timings}
"""Op name (or its last part, for ops capture and scoring share) -> how the values of several
data-parallel engines become one; a part registers its own (scoring/scorer.py: 'score.take')."""


def merge_engines(op: str, per_engine: list[Any]) -> Any:
    """One value from each engine's value of `op`; ops without a rule must agree across engines."""
    if len(per_engine) == 1:
        return per_engine[0]
    rule = MERGES.get(op) or MERGES.get(op.rsplit(".", 1)[-1])
    if rule is not None:
        return rule(per_engine)
    if any(v != per_engine[0] for v in per_engine[1:]):
        raise CaptureHookError(f"{op}: expected the {len(per_engine)} data-parallel engines to reply alike, "
                               f"found {per_engine!r}")
    return per_engine[0]


def engine_count(engine: Any) -> int:
    """Engine cores behind an AsyncLLM's client (several under data parallelism)."""
    return len(getattr(getattr(engine, "engine_core", None), "core_engines", None) or ()) or 1


class _Link:
    via: str
    """'worker_extension_cls' or 'callable': how collective_rpc reaches the endpoint."""

    def __init__(self, engine: Any, via: str, default: type[Exception]) -> None:
        self.engine, self.via, self.default = engine, via, default
        self._target = METHOD if via == "worker_extension_cls" else endpoint.call


class SyncLink(_Link):
    """Link over a `vllm.LLM` (in-process or multi-process engine)."""

    @classmethod
    def open(cls, llm: Any, op: str, payload: Any, *, what: str, default: type[Exception],
             kwargs_fn: str) -> tuple["SyncLink", list[Any]]:
        """Install through `op` on every worker; returns the link and every worker's install reply."""
        try:
            replies = llm.collective_rpc(METHOD, args=(op, payload))
            via = "worker_extension_cls"
        except Exception as e:
            if METHOD not in str(e):
                raise
            try:
                replies = llm.collective_rpc(endpoint.call, args=(op, payload))
            except Exception as e2:
                raise CaptureHookError(
                    f"cannot reach the engine's workers for {what} ({type(e2).__name__}: {e2}); build the engine "
                    f"with LLM(..., **{kwargs_fn}()) (worker_extension_cls={EXTENSION!r})") from e2
            via = "callable"
        return cls(llm, via, default), _values(replies, f"installing {what} on the engine failed", default)

    def call(self, op: str, payload: Any = None, what: str | None = None) -> Any:
        """`op` on the workers; the first worker's value (they hold the same requests)."""
        return _values(self.engine.collective_rpc(self._target, args=(op, payload))[:1], what or op, self.default)[0]


async def _every_engine(engine: Any, op: str, payload: Any) -> list[list[dict[str, Any]]]:
    """Every worker's reply, engine by engine."""
    if engine_count(engine) > 1:
        check_release(parts=("data_parallel",))  # 0.26-0.31 have no call_utility_all_async: refused by name
        return await engine.engine_core.call_utility_all_async("collective_rpc", METHOD, None, (op, payload), None)
    return [await engine.collective_rpc(METHOD, args=(op, payload))]


class AsyncLink(_Link):
    """Link over a `vllm.v1.engine.async_llm.AsyncLLM` (built with the worker extension), to every
    engine core of a data-parallel one."""

    @classmethod
    async def open(cls, engine: Any, op: str, payload: Any, *, what: str, default: type[Exception],
                   kwargs_fn: str) -> tuple["AsyncLink", list[Any]]:
        try:
            per_engine = await _every_engine(engine, op, payload)
        except Exception as e:
            raise CaptureHookError(
                f"cannot install {what} on this AsyncLLM ({type(e).__name__}: {e}); build it with "
                f"AsyncEngineArgs(..., **{kwargs_fn}())") from e
        replies = [r for workers in per_engine for r in workers]
        return cls(engine, "worker_extension_cls", default), _values(replies, f"installing {what} on the engine failed", default)

    async def call(self, op: str, payload: Any = None, what: str | None = None) -> Any:
        """`op` on the workers; per engine the first worker's value, merged over engines (merge_engines)."""
        per_engine = await _every_engine(self.engine, op, payload)
        return merge_engines(op, [_values(workers[:1], what or op, self.default)[0] for workers in per_engine])
