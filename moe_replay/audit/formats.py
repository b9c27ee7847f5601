"""Readers of routes in the formats users' pipelines hold them, each into a `RoutesBatch`.

| format | what the pipeline holds | rows | columns |
| --- | --- | --- | --- |
| `trace` | the project's `RolloutTrace`s | positions route_start .. S - 2 | its MoE layers (`route_layers`) |
| `vllm` | `CompletionOutput.routed_experts` (vLLM >= 0.32, `enable_return_routed_experts`): uint8/uint16 [S - 1 - prompt_start, num_hidden_layers, K], with the request's `routed_experts_prompt_start` | prompt_start .. S - 2 | every decoder layer (dense ones hold zeros) |
| `sglang` | `meta_info["routed_experts"]`: base64 of int32 [S - 1 - start_len, num_hidden_layers, K] (start_len: the request's `routed_experts_start_len`, 0 = the whole sequence) | start_len .. S - 2 | every decoder layer |
| `verl` | the batch's `routed_experts`: padded [B, P + R, L, K] aligned with `input_ids` / `attention_mask` (verl's agent loop), or jagged nested [T_b, L, K] per sample with nested `input_ids` | the real tokens' columns but the last | verl's rule (`LayerAxis.AUTO`) |
| `megatron` | RouterReplay's per-router lists: one [M, K] tensor per entry of the process-global list, M = S * B sequence-first over the padded micro-batch (`layout="sbhd"`), or the packed tokens (`"thd"`) | positions 0 .. S - 2 | the MoE layers in list order, or the ids given |

Every reader keeps the values as they are (no range, distinctness or row-count check: those are findings,
not errors; SGLang capture's own strict decoder is integrations/sglang/payload.py) and refuses only what
cannot be read at all (a payload whose length is no whole number of
rows, token ids that are not a sequence) with a typed error naming the sample and field.

Legend: B samples, S tokens, P prompt columns, R response columns, T rows, C columns, K top-k, M a
micro-batch's flat positions.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import TraceFormatError, Where
from ..registry import Registry
from .routes import LayerAxis, RoutesBatch, SampleRoutes, as_rows, as_tokens

ROUTE_FORMATS: Registry[Callable[..., RoutesBatch]] = Registry("route format")


def _keys(keys: Sequence[str] | None, n: int, fmt: str) -> list[str]:
    if keys is None:
        return [f"{fmt}-{i}" for i in range(n)]
    keys = [str(k) for k in keys]
    if len(keys) != n:
        raise TraceFormatError(Where(field=f"keys ({fmt})"), f"{n} keys (one per sample)", len(keys))
    return keys


def _per_sample(value: Any, n: int, name: str, fmt: str) -> list[int]:
    if isinstance(value, (int, np.integer)):
        return [int(value)] * n
    values = [int(v) for v in value]
    if len(values) != n:
        raise TraceFormatError(Where(field=f"{name} ({fmt})"), f"one value or {n} (one per sample)", len(values))
    return values


def _per_request(n: int, token_ids: Any, start: Any, start_name: str, keys: Sequence[str] | None,
                 fmt: str) -> tuple[list[np.ndarray], list[int], list[str]]:
    """(tokens, starts, keys) of an engine's n per-request outputs: one token sequence per request (or one
    sequence for one request), the requests' row starts (one value or one each), their keys."""
    tokens = [token_ids] if _is_one_sequence(token_ids) else list(token_ids)
    if len(tokens) != n:
        raise TraceFormatError(Where(field=f"token_ids ({fmt})"), f"{n} token sequences (one per request's routes)",
                               len(tokens))
    names = _keys(keys, n, fmt)
    return ([as_tokens(t, Where(record=names[b], field="token_ids")) for b, t in enumerate(tokens)],
            _per_sample(start, n, start_name, fmt), names)


def _with_prompts(samples: Sequence[SampleRoutes], prompt_len: Any, fmt: str) -> tuple[SampleRoutes, ...]:
    """The samples with their prompt lengths (one value or one each; None: not known) as their boundary."""
    if prompt_len is None:
        return tuple(samples)
    lengths = _per_sample(prompt_len, len(samples), "prompt_len", fmt)
    return tuple(dataclasses.replace(s, prompt_len=p, boundaries=(p,) if 0 < p < len(s.token_ids_S) else ())
                 for s, p in zip(samples, lengths))


def _listed(routes: Any) -> list:
    """A list of per-sample arrays from one array (a single sample) or a sequence of them."""
    if isinstance(routes, (list, tuple)):
        return list(routes)
    arr = routes.detach().cpu().numpy() if hasattr(routes, "detach") else np.asarray(routes)
    return [arr] if arr.ndim == 3 else list(arr)


@ROUTE_FORMATS.register("trace")
def from_traces(traces: Any, token_ids: Any = None, **_: Any) -> RoutesBatch:
    """The project's RolloutTrace(s) (their own tokens; `token_ids` must be None)."""
    from ..trace import RolloutTrace

    traces = [traces] if isinstance(traces, RolloutTrace) else list(traces)
    if token_ids is not None:
        raise TraceFormatError(Where(field="token_ids (trace)"), "None (a trace holds its tokens)", type(token_ids).__name__)
    samples = []
    layers = None
    for b, t in enumerate(traces):
        where = Where(record=t.key, field="routes_TLK")
        if t.routes_TLK is None:
            raise TraceFormatError(where, "a trace with routes", "routes_TLK None (captured without routes)")
        if layers is None:
            layers = t.route_layers
        elif t.route_layers != layers:
            raise TraceFormatError(where.with_(field="route_layer_ids"), f"layers {list(layers)} as trace 0",
                                   list(t.route_layers))
        edges = sorted(p for p in {t.prompt_len, *(p for span in t.spans for p in span)} if 0 < p < t.num_tokens)
        samples.append(SampleRoutes(t.key, t.token_ids_S.astype(np.int64), t.routes_TLK.astype(np.int64), t.route_start,
                                    prompt_len=t.prompt_len, boundaries=tuple(edges)))
    return RoutesBatch("trace", tuple(samples), tuple(layers or ()))


@ROUTE_FORMATS.register("vllm")
def from_vllm(routed_experts: Any, token_ids: Any, prompt_start: int | Sequence[int] = 0,
              keys: Sequence[str] | None = None, prompt_len: int | Sequence[int] | None = None, **_: Any) -> RoutesBatch:
    """vLLM's `routed_experts` (one [S - 1 - prompt_start, num_hidden_layers, K] array per request, or one
    array for one request) with each request's tokens (prompt_token_ids + the completion's token_ids)
    and its `routed_experts_prompt_start`; `prompt_len` (len(prompt_token_ids), per request or one value)
    lets the audit check the rows at the prompt / completion boundary."""
    arrays = _listed(routed_experts)
    tokens, starts, names = _per_request(len(arrays), token_ids, prompt_start, "routed_experts_prompt_start", keys, "vllm")
    samples = tuple(SampleRoutes(names[b], tokens[b], as_rows(arrays[b], Where(record=names[b], field="routed_experts")),
                                 starts[b]) for b in range(len(arrays)))
    return RoutesBatch("vllm", _with_prompts(samples, prompt_len, "vllm"), LayerAxis.DECODER)


@ROUTE_FORMATS.register("sglang")
def from_sglang(payload: Any, token_ids: Any, start_len: int | Sequence[int] = 0, *, num_layers: int, top_k: int,
                keys: Sequence[str] | None = None, prompt_len: int | Sequence[int] | None = None, **_: Any) -> RoutesBatch:
    """SGLang's `meta_info["routed_experts"]` (base64 of int32 [rows, num_layers, top_k], one string per
    request, or bytes already decoded) with each request's tokens and `routed_experts_start_len`.
    The payload does not carry its shape: `num_layers` (the config's num_hidden_layers) and `top_k` say
    it (`moe_replay.audit` passes the model's). `prompt_len`: as for vLLM."""
    payloads = [payload] if isinstance(payload, (str, bytes, bytearray)) else list(payload)
    tokens, starts, names = _per_request(len(payloads), token_ids, start_len, "routed_experts_start_len", keys, "sglang")
    samples = []
    for b in range(len(payloads)):
        where = Where(record=names[b], field="meta_info['routed_experts']")
        raw = payloads[b]
        try:
            data = base64.b64decode(raw, validate=True) if isinstance(raw, str) else bytes(raw)
        except (ValueError, TypeError) as e:
            raise TraceFormatError(where, "base64 of int32 routes", f"{type(raw).__name__} that does not decode", str(e)) from None
        row = 4 * num_layers * top_k
        if len(data) % row:
            raise TraceFormatError(where, f"a multiple of {row} bytes (int32 x {num_layers} layers x top_k {top_k})",
                                   f"{len(data)} bytes")
        rows = np.frombuffer(data, dtype="<i4").reshape(-1, num_layers, top_k).astype(np.int64)
        samples.append(SampleRoutes(names[b], tokens[b], rows, starts[b]))
    return RoutesBatch("sglang", _with_prompts(samples, prompt_len, "sglang"), LayerAxis.DECODER)


@ROUTE_FORMATS.register("verl")
def from_verl(routed_experts: Any, input_ids: Any, attention_mask: Any = None, keys: Sequence[str] | None = None,
              prompt_len: int | Sequence[int] | None = None, **_: Any) -> RoutesBatch:
    """verl's batch field: padded `routed_experts` [B, P + R, L, K] with `input_ids` and `attention_mask`
    [B, P + R] (a sample's rows are its real tokens' columns, but the last, whose row verl fills with a
    placeholder), or a jagged nested `routed_experts` with nested `input_ids` (verl's no-padding layout;
    a sample's rows as they stand, T_b - 1 or T_b of them). `prompt_len`: each sample's real prompt tokens
    (the prompts' attention mask summed), as for vLLM."""
    if getattr(routed_experts, "is_nested", False):
        parts = list(routed_experts.unbind())
        tokens = list(input_ids.unbind()) if getattr(input_ids, "is_nested", False) else list(input_ids)
        if len(tokens) != len(parts):
            raise TraceFormatError(Where(field="input_ids (verl)"), f"{len(parts)} sequences", len(tokens))
        names = _keys(keys, len(parts), "verl")
        samples = []
        for b, (r, t) in enumerate(zip(parts, tokens)):
            tok = as_tokens(t, Where(record=names[b], field="input_ids"))
            rows = as_rows(r, Where(record=names[b], field="routed_experts"))
            samples.append(SampleRoutes(names[b], tok, rows[: len(tok) - 1] if len(rows) == len(tok) else rows))
        return RoutesBatch("verl", _with_prompts(samples, prompt_len, "verl"), LayerAxis.AUTO)
    re_BSLK = routed_experts.detach().cpu().numpy() if hasattr(routed_experts, "detach") else np.asarray(routed_experts)
    ids_BS = input_ids.detach().cpu().numpy() if hasattr(input_ids, "detach") else np.asarray(input_ids)
    if re_BSLK.ndim != 4 or ids_BS.ndim != 2 or re_BSLK.shape[:2] != ids_BS.shape:
        raise TraceFormatError(Where(field="routed_experts (verl)"), f"[B, S, layers, top_k] over input_ids {list(ids_BS.shape)}",
                               list(re_BSLK.shape))
    if attention_mask is None:
        mask_BS = np.ones(ids_BS.shape, dtype=bool)
    else:
        mask_BS = (attention_mask.detach().cpu().numpy() if hasattr(attention_mask, "detach") else np.asarray(attention_mask)) != 0
    names = _keys(keys, len(ids_BS), "verl")
    samples = []
    for b in range(len(ids_BS)):
        cols = np.flatnonzero(mask_BS[b])
        where = Where(record=names[b], field="routed_experts")
        samples.append(SampleRoutes(names[b], as_tokens(ids_BS[b, cols], where.with_(field="input_ids")),
                                    as_rows(re_BSLK[b, cols[:-1]], where)))
    return RoutesBatch("verl", _with_prompts(samples, prompt_len, "verl"), LayerAxis.AUTO)


@ROUTE_FORMATS.register("megatron")
def from_megatron(entries: Any, token_ids: Any, attention_mask: Any = None, *, layout: str = "sbhd",
                  layers: LayerAxis | Sequence[int | None] = LayerAxis.MOE, keys: Sequence[str] | None = None,
                  prompt_len: int | Sequence[int] | None = None, **_: Any) -> RoutesBatch:
    """Megatron RouterReplay's per-router lists: one [M, K] tensor per entry of the process-global list,
    in list order (what `RouterReplay.set_replay_data` takes), for the micro-batch `token_ids`.

    `layout="sbhd"` (Megatron's default, what a GPTModel's routers see): `token_ids` [B, S] padded with
    `attention_mask` (1 = a real token), M = S * B, the row of sample b at column s is m = s * B + b;
    the batch-first reading (m = b * S + s) is kept as an alternative the audit tries. `layout="thd"`
    (packed sequences): `token_ids` a list of sequences, M their total length, sample b's rows at its
    offset in the packed order. `layers`: what each entry claims, the MoE layers in list order unless
    given (integrations/megatron/audit.py passes the ids Megatron's registry layout names). `prompt_len`: as
    for vLLM."""
    cols = [_entry(e, i) for i, e in enumerate(entries)]
    if not cols:
        raise TraceFormatError(Where(field="router replay entries"), "one [M, K] tensor per router", "none")
    m = len(cols[0])
    if any(len(c) != m for c in cols):
        raise TraceFormatError(Where(field="router replay entries"), f"[{m}, K] in every entry", [len(c) for c in cols])
    flat_MCK = np.stack(cols, 1)
    axis = layers if isinstance(layers, LayerAxis) else tuple(None if x is None else int(x) for x in layers)
    if layout == "thd":
        tokens = [as_tokens(t, Where(field=f"token_ids[{b}]")) for b, t in enumerate(token_ids)]
        total = sum(len(t) for t in tokens)
        if m < total:  # packing may pad the tail (to a multiple of the TP size); never shorten it
            raise TraceFormatError(Where(field="router replay entries (thd)"), f">= {total} rows (the packed tokens)", m)
        names = _keys(keys, len(tokens), "megatron")
        offsets = np.concatenate([[0], np.cumsum([len(t) for t in tokens])])
        samples = tuple(SampleRoutes(names[b], tokens[b], flat_MCK[offsets[b]: offsets[b + 1] - 1],
                                     slots_T=np.arange(offsets[b], offsets[b + 1] - 1)) for b in range(len(tokens)))
        return RoutesBatch("megatron", _with_prompts(samples, prompt_len, "megatron"), axis)
    if layout != "sbhd":
        raise TraceFormatError(Where(field="layout (megatron)"), "'sbhd' or 'thd'", repr(layout))
    ids_BS = token_ids.detach().cpu().numpy() if hasattr(token_ids, "detach") else np.asarray(token_ids)
    if ids_BS.ndim != 2:
        raise TraceFormatError(Where(field="token_ids (megatron sbhd)"), "a padded [B, S] batch", list(ids_BS.shape))
    b_count, s_len = ids_BS.shape
    if b_count * s_len != m:
        raise TraceFormatError(Where(field="router replay entries (sbhd)"), f"S * B = {s_len * b_count} rows", m)
    mask_BS = np.ones(ids_BS.shape, bool) if attention_mask is None else (
        (attention_mask.detach().cpu().numpy() if hasattr(attention_mask, "detach") else np.asarray(attention_mask)) != 0)
    names = _keys(keys, b_count, "megatron")

    def read(rows_of: Callable[[int, np.ndarray], np.ndarray]) -> tuple[SampleRoutes, ...]:
        out = []
        for b in range(b_count):
            cols_b = np.flatnonzero(mask_BS[b])
            slots = rows_of(b, cols_b[:-1])
            out.append(SampleRoutes(names[b], ids_BS[b, cols_b].astype(np.int64), flat_MCK[slots], slots_T=slots))
        return _with_prompts(out, prompt_len, "megatron")

    seq_first = read(lambda b, s: s * b_count + b)
    batch_first = RoutesBatch("megatron", read(lambda b, s: b * s_len + s), axis)
    return RoutesBatch("megatron", seq_first, axis, readings=(("batch-first", batch_first),))


def _entry(entry: Any, i: int) -> np.ndarray:
    """One RouterReplay entry's ids as int64 [M, K]."""
    arr = entry.detach().cpu().numpy() if hasattr(entry, "detach") else np.asarray(entry)
    if arr.ndim != 2 or arr.dtype.kind not in "iu":
        raise TraceFormatError(Where(field=f"router replay entry {i}"), "integer ids [M, top_k]", f"{arr.dtype} {list(arr.shape)}")
    return arr.astype(np.int64)


def _is_one_sequence(token_ids: Any) -> bool:
    """Whether `token_ids` is one sequence of ints (not a list of sequences)."""
    if hasattr(token_ids, "ndim"):
        return token_ids.ndim == 1
    return len(token_ids) > 0 and isinstance(token_ids[0], (int, np.integer))


def guess_format(routes: Any) -> str:
    """The format of `routes` where its type says it (traces, base64 text, a 4-D or nested tensor);
    else ValueError asking for `format=`."""
    from ..trace import RolloutTrace

    first = routes[0] if isinstance(routes, (list, tuple)) and routes else routes
    if isinstance(first, RolloutTrace):
        return "trace"
    if isinstance(first, (str, bytes, bytearray)):
        return "sglang"
    if getattr(routes, "is_nested", False) or getattr(routes, "ndim", 0) == 4:
        return "verl"
    if getattr(first, "ndim", 0) == 3 or getattr(routes, "ndim", 0) == 3:
        return "vllm"
    raise ValueError(f"cannot tell the format of routes given as {type(routes).__name__}; pass format= one of "
                     f"{ROUTE_FORMATS.names()}")


def read_routes(routes: Any, token_ids: Any = None, *, format: str | None = None, **kwargs: Any) -> RoutesBatch:
    """`routes` (in `format`, or the one its type says) as a RoutesBatch; a RoutesBatch as it is."""
    if isinstance(routes, RoutesBatch):
        return routes
    return ROUTE_FORMATS.get(format or guess_format(routes))(routes, token_ids, **kwargs)
