"""Client side: turn a finished vLLM RequestOutput plus the worker's CaptureRecord into RolloutTraces.

The RequestOutput is the ground truth for the final tokens (stop strings and async scheduling can
make the worker see more steps than the sequence keeps): routes are cut to S-1-route_start rows,
sampling rows to G = len(completion.token_ids), and the worker's sampled tokens must equal the
completion's tokens, row for row, or the trace is refused (CaptureAlignmentError).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ....capture_config import CaptureConfig
from ....errors import Where
from ....geometry import EngineInfo, ModelGeometry
from ....trace import Rerouted, RolloutTrace, SamplingSupport
from ..errors import (CaptureAlignmentError, CaptureEvictedError, RequestAbortedError, SupportOverflowError,
                      UnknownRequestError)
from ..wire import CaptureRecord


def trace_key(request_id: str, index: int, n: int) -> str:
    """Store key of one sample: the request id for n == 1, '<request id>#<index>' for n > 1."""
    return request_id if n == 1 else f"{request_id}#{index}"


def worker_key(request_id: str, index: int, n: int) -> str:
    """vLLM's engine-side id of one sample, without the random suffix (child ids are 'i_<id>')."""
    return request_id if n == 1 else f"{index}_{request_id}"


def merge_stream(outputs: list[Any], n_of: dict[str, int]) -> tuple[list[tuple[str, str, Any, Any]], dict[str, Exception]]:
    """Items (trace key, worker key, completion, its RequestOutput) from final or streamed outputs.

    Outputs of one request id (streamed chunks, in arrival order) are grouped; each sample keeps
    its last finished completion (cumulative streaming, vLLM's default, carries every token in
    it). A request with n in `n_of` must show all n samples finished, or each missing one is a
    failure (never a shorter trace list)."""
    order: list[str] = []
    last: dict[str, dict[int, tuple[Any, Any]]] = {}
    for out in outputs:
        if out.request_id not in last:
            order.append(out.request_id)
            last[out.request_id] = {}
        for c in out.outputs:
            prev = last[out.request_id].get(c.index)
            if prev is None or c.finish_reason is not None or prev[0].finish_reason is None:
                last[out.request_id][c.index] = (c, out)
    items, missing = [], {}
    for rid in order:
        got = last[rid]
        n = n_of.get(rid, len(got))
        for i in sorted(got):
            c, out = got[i]
            items.append((trace_key(rid, i, n), worker_key(rid, i, n), c, out))
        for i in sorted(set(range(n)) - set(got)):
            missing[trace_key(rid, i, n)] = UnknownRequestError(
                f"request {rid!r} asked for n={n} samples; sample {i} is not in the outputs passed "
                f"(samples {sorted(got)} are): pass every output the stream yielded, or its final-only output")
    return items, missing


def support_overflow(key: str, sizes_G: np.ndarray, config: CaptureConfig, prompt_len: int | None = None,
                     vocab_size: int | None = None) -> dict[str, int] | None:
    """Apply `config.on_support_overflow` to a request's support row sizes (hooks and native sources
    alike): None when every row fits, the `extra["support_omitted"]` entry under 'omit'; 'error' raises.
    A row of `vocab_size` ids never overflows: it is kept whole (SamplingSupport.whole_G), at no cost."""
    if not len(sizes_G) or int(sizes_G.max()) <= config.max_support:  # one reduction when every row fits
        return None
    over_G = (sizes_G > config.max_support) & (sizes_G != (-1 if vocab_size is None else vocab_size))
    if not over_G.any():
        return None
    g = int(np.flatnonzero(over_G)[0])
    at = "" if prompt_len is None else f" (position {prompt_len + g})"
    msg = (f"request {key!r}: sampling support of generated token {g}{at} has {int(sizes_G[g])} tokens, "
           f"above CaptureConfig.max_support={config.max_support}")
    if config.on_support_overflow == "error":
        raise SupportOverflowError(msg + " (policy 'error'; raise max_support or use 'omit')")
    return {"row": g, "size": int(sizes_G[g]), "max_support": config.max_support}


def check_record(record: CaptureRecord, key: str) -> None:
    if record.status == "ok":
        return
    if record.status == "evicted":
        raise CaptureEvictedError(
            f"request {key!r}: its capture record was evicted on the worker before collection "
            "(more finished requests than CaptureConfig.max_unclaimed were left uncollected)"
        )
    if record.status == "ambiguous":
        raise UnknownRequestError(f"request {key!r} matches several engine requests {record.matches}; use unique request ids")
    raise UnknownRequestError(
        f"request {key!r}: no capture record on the worker ({record.known} records held); "
        "it was never run with capture installed, or was already collected"
    )


_WIDTHS = (("routes_filled_T", np.dtype(bool)), ("tokens_G", np.dtype(np.int64)), ("logprobs_G", np.dtype(np.float32)),
           ("support_sizes_G", np.dtype(np.int64)), ("support_offsets_G1", np.dtype(np.int64)),
           ("support_ids_N", np.dtype(np.int32)))
"""The 1-D arrays of a CaptureRecord and their dtypes (routes_TLK: the geometry's route dtype)."""


def normalise(record: CaptureRecord, geometry: ModelGeometry) -> CaptureRecord:
    """Arrays in their dtypes and shapes (an RPC serialiser may hand back lists or other widths);
    a record that already has them is returned as it is (the worker's arrays, packed as they were)."""
    L, K = geometry.num_moe_layers, geometry.top_k
    r = record.routes_TLK
    if (isinstance(r, np.ndarray) and r.dtype == geometry.route_dtype and r.shape[1:] == (L, K)
            and all(isinstance(a, np.ndarray) and a.dtype == dt and a.ndim == 1
                    for a, dt in ((getattr(record, name), dt) for name, dt in _WIDTHS))):
        return record
    flat = lambda a, dtype: np.asarray(a).astype(dtype, copy=False).reshape(-1)  # noqa: E731
    return dataclasses.replace(
        record,
        routes_TLK=np.asarray(record.routes_TLK).astype(geometry.route_dtype, copy=False).reshape(-1, L, K),
        routes_filled_T=flat(record.routes_filled_T, bool), tokens_G=flat(record.tokens_G, np.int64),
        logprobs_G=flat(record.logprobs_G, np.float32), support_sizes_G=flat(record.support_sizes_G, np.int64),
        support_offsets_G1=flat(record.support_offsets_G1, np.int64), support_ids_N=flat(record.support_ids_N, np.int32),
    )


def build_trace(
    key: str,
    prompt_token_ids: list[int],
    completion: Any,
    record: CaptureRecord,
    geometry: ModelGeometry,
    config: CaptureConfig,
    engine: EngineInfo,
    validate: bool = True,
) -> RolloutTrace:
    """One RolloutTrace from one completion and its worker record; raises a typed error on any gap.
    `validate` False leaves `trace.validate()` to the caller (collect validates its traces
    together: moe_replay.trace.validate_traces)."""
    if getattr(completion, "finish_reason", None) == "abort":
        raise RequestAbortedError(f"request {key!r} was aborted after {len(completion.token_ids)} tokens: no trace")
    check_record(record, key)
    rec = normalise(record, geometry)
    if rec.problems:
        raise CaptureAlignmentError(f"request {key!r}: {rec.problems[0]}")
    tokens_S = np.array([*prompt_token_ids, *completion.token_ids], dtype=np.int64)  # one conversion, not two and a concat
    P = len(prompt_token_ids)
    gen = tokens_S[P:]
    G, S = len(gen), len(tokens_S)
    if rec.prompt_len != P:
        raise CaptureAlignmentError(f"request {key!r}: worker saw a prompt of {rec.prompt_len} tokens, output has {P}")
    route_start = int(rec.route_start)
    extra: dict[str, Any] = {}

    routes = None
    if config.routes:
        need = max(S - 1 - route_start, 0)
        filled = rec.routes_filled_T[:need]
        if len(filled) < need or not filled.all():
            gap = int(np.flatnonzero(~filled)[0]) if len(filled) and not filled.all() else len(filled)
            raise CaptureAlignmentError(
                f"request {key!r}: routes cover {gap} of {need} positions from {route_start}; "
                f"position {route_start + gap} was never captured"
            )
        routes = rec.routes_TLK[:need].copy()  # the record's arrays may be read-only views of the reply (wire.py)

    support = logprobs = None
    if config.support or config.logprobs:
        got = rec.tokens_G
        if len(got) < G or not (got[:G] == gen).all():
            bad = next((g for g in range(min(len(got), G)) if got[g] != gen[g]), min(len(got), G))
            raise CaptureAlignmentError(
                f"request {key!r}: sampler rows disagree with the output at generated token {bad} "
                f"(captured {len(got)} samples, output has {G} tokens)"
            )
        if config.logprobs:
            logprobs = rec.logprobs_G[:G].copy()
        if config.support:
            sizes_G = rec.support_sizes_G[:G]
            omitted = support_overflow(key, sizes_G, config, vocab_size=geometry.vocab_size)
            if omitted:
                extra["support_omitted"] = omitted
            else:  # rows of every id hold no ids (sampler_hook.py): kept whole
                off = rec.support_offsets_G1[: G + 1]
                support = SamplingSupport(off.copy(), rec.support_ids_N[: off[-1]].copy(), sizes_G == geometry.vocab_size)
    rerouted = None
    if rec.rerouted and config.routes:  # provenance (capture/row_log.py): kept only inside the final sequence
        positions = tuple(p for p in rec.rerouted if p < S - 1)
        stale = tuple(g for g in rec.stale if g < G)
        if positions or stale:
            rerouted = Rerouted(positions, stale)
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
        rerouted=rerouted,
    )
    return trace.validate(Where(record=key)) if validate else trace
