"""Client side: turn a finished vLLM RequestOutput plus the worker's record into RolloutTraces.

The RequestOutput is the ground truth for the final tokens (stop strings and async scheduling can
make the worker see more steps than the sequence keeps): routes are cut to S-1-route_start rows,
sampling rows to G = len(completion.token_ids), and the worker's sampled tokens must equal the
completion's tokens, row for row, or the trace is refused (CaptureAlignmentError).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import Where
from ...geometry import EngineInfo, ModelGeometry
from ...trace import RolloutTrace, SamplingSupport
from ...capture_config import CaptureConfig
from .records import unpack_array
from .errors import (
    CaptureAlignmentError,
    CaptureEvictedError,
    CaptureHookError,
    RequestAbortedError,
    SupportOverflowError,
    UnknownRequestError,
)


def trace_key(request_id: str, index: int, n: int) -> str:
    """Store key of one sample: the request id for n == 1, '<request id>#<index>' for n > 1."""
    return request_id if n == 1 else f"{request_id}#{index}"


def worker_key(request_id: str, index: int, n: int) -> str:
    """vLLM's engine-side id of one sample, without the random suffix (child ids are 'i_<id>')."""
    return request_id if n == 1 else f"{index}_{request_id}"


def completions_of(output: Any) -> list[tuple[str, str, Any]]:
    """(trace key, worker key, CompletionOutput) for every sample of one RequestOutput."""
    n = len(output.outputs)
    return [(trace_key(output.request_id, c.index, n), worker_key(output.request_id, c.index, n), c) for c in output.outputs]


def check_payload(payload: dict[str, Any], key: str) -> None:
    status = payload.get("status")
    if status == "ok":
        return
    if status == "evicted":
        raise CaptureEvictedError(
            f"request {key!r}: its capture record was evicted on the worker before collection "
            "(more finished requests than CaptureConfig.max_unclaimed were left uncollected)"
        )
    if status == "ambiguous":
        raise UnknownRequestError(f"request {key!r} matches several engine requests {payload['matches']}; use unique request ids")
    raise UnknownRequestError(
        f"request {key!r}: no capture record on the worker ({payload.get('known', 0)} records held); "
        "it was never run with capture installed, or was already collected"
    )


def normalise_payload(payload: dict[str, Any], geometry: ModelGeometry) -> dict[str, Any]:
    """Arrays back to their dtypes and shapes (RPC serialisation may turn some into lists)."""
    p = dict(payload)
    L, K = geometry.num_moe_layers, geometry.top_k
    p["routes"] = unpack_array(p["routes"]).astype(geometry.route_dtype, copy=False).reshape(-1, L, K)
    p["routes_filled"] = unpack_array(p["routes_filled"]).astype(bool, copy=False).reshape(-1)
    for name, dtype in (("tokens", np.int64), ("logprobs", np.float32), ("support_sizes", np.int64),
                        ("support_offsets", np.int64), ("support_ids", np.int32)):
        p[name] = unpack_array(p[name]).astype(dtype, copy=False).reshape(-1)
    return p


def build_trace(
    key: str,
    prompt_token_ids: list[int],
    completion: Any,
    payload: dict[str, Any],
    geometry: ModelGeometry,
    config: CaptureConfig,
    engine: EngineInfo,
) -> RolloutTrace:
    """One RolloutTrace from one completion and its worker payload; raises a typed error on any gap."""
    if getattr(completion, "finish_reason", None) == "abort":
        raise RequestAbortedError(f"request {key!r} was aborted after {len(completion.token_ids)} tokens: no trace")
    check_payload(payload, key)
    payload = normalise_payload(payload, geometry)
    if payload["problems"]:
        raise CaptureAlignmentError(f"request {key!r}: {payload['problems'][0]}")
    prompt = np.asarray(prompt_token_ids, dtype=np.int64)
    gen = np.asarray(completion.token_ids, dtype=np.int64)
    tokens_S = np.concatenate([prompt, gen])
    P, G, S = len(prompt), len(gen), len(prompt) + len(gen)
    if payload["prompt_len"] != P:
        raise CaptureAlignmentError(f"request {key!r}: worker saw a prompt of {payload['prompt_len']} tokens, output has {P}")
    route_start = int(payload["route_start"])
    extra: dict[str, Any] = {}

    routes = None
    if config.routes:
        need = max(S - 1 - route_start, 0)
        filled = payload["routes_filled"][:need]
        if len(filled) < need or not filled.all():
            gap = int(np.flatnonzero(~filled)[0]) if len(filled) and not filled.all() else len(filled)
            raise CaptureAlignmentError(
                f"request {key!r}: routes cover {gap} of {need} positions from {route_start}; "
                f"position {route_start + gap} was never captured"
            )
        routes = payload["routes"][:need]

    support = logprobs = None
    if config.support or config.logprobs:
        got = payload["tokens"]
        if len(got) < G or not np.array_equal(got[:G], gen):
            bad = next((g for g in range(min(len(got), G)) if got[g] != gen[g]), min(len(got), G))
            raise CaptureAlignmentError(
                f"request {key!r}: sampler rows disagree with the output at generated token {bad} "
                f"(captured {len(got)} samples, output has {G} tokens)"
            )
        if config.logprobs:
            logprobs = payload["logprobs"][:G]
        if config.support:
            sizes = payload["support_sizes"][:G]
            over = np.flatnonzero(sizes > config.max_support)
            if len(over):
                g = int(over[0])
                msg = (f"request {key!r}: sampling support of generated token {g} has {int(sizes[g])} tokens, "
                       f"above CaptureConfig.max_support={config.max_support}")
                if config.on_support_overflow == "error":
                    raise SupportOverflowError(msg + " (policy 'error'; raise max_support or use 'omit')")
                extra["support_omitted"] = {"row": g, "size": int(sizes[g]), "max_support": config.max_support}
            else:
                off = payload["support_offsets"][: G + 1]
                support = SamplingSupport(off.copy(), payload["support_ids"][: off[-1]].copy())
    trace = RolloutTrace(
        key=key,
        token_ids_S=tokens_S,
        prompt_len=P,
        geometry=geometry,
        routes_TLK=routes,
        route_start=route_start,
        support=support,
        logprobs_G=logprobs,
        engine=engine,
        extra=extra,
    )
    return trace.validate(Where(record=key))


def raise_install_error(reply: dict[str, Any]) -> None:
    from . import errors

    cls = getattr(errors, reply.get("kind", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = CaptureHookError
    raise cls(f"installing capture on the engine failed: {reply.get('error')}")
