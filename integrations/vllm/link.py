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
"""

from __future__ import annotations

from typing import Any, NoReturn

from . import endpoint
from .errors import CaptureHookError

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


class AsyncLink(_Link):
    """Link over a `vllm.v1.engine.async_llm.AsyncLLM` (built with the worker extension)."""

    @classmethod
    async def open(cls, engine: Any, op: str, payload: Any, *, what: str, default: type[Exception],
                   kwargs_fn: str) -> tuple["AsyncLink", list[Any]]:
        try:
            replies = await engine.collective_rpc(METHOD, args=(op, payload))
        except Exception as e:
            raise CaptureHookError(
                f"cannot install {what} on this AsyncLLM ({type(e).__name__}: {e}); build it with "
                f"AsyncEngineArgs(..., **{kwargs_fn}())") from e
        return cls(engine, "worker_extension_cls", default), _values(replies, f"installing {what} on the engine failed", default)

    async def call(self, op: str, payload: Any = None, what: str | None = None) -> Any:
        return _values((await self.engine.collective_rpc(METHOD, args=(op, payload)))[:1], what or op, self.default)[0]
