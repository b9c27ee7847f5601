"""SGLang's per-request outputs, decoded and checked: routes, kept sets, logprobs.

What SGLang 0.5.23 returns in `meta_info` (../shared/notes/sglang-cpu.md; engine and HTTP server alike):
  routed_experts                   base64 of int32 [S - 1 - start, num_hidden_layers, K]: rows for every
                                   position of prompt + completion but the last (never forwarded) from
                                   `routed_experts_start_len` on, radix-cache hits included; K in top-k order.
                                   4 bytes an id: 32 B per token-layer at top-8, where a trace holds uint8.
  output_token_sampling_mask       one list of kept token ids per generated token (in no order)
  output_token_sampling_logprobs   the sampled token's logprob renormalised over that list
                                   (sampling_logprobs_mode "selected": one float per token)
That is a RolloutTrace's layout (T = S - 1 - route_start rows, CSR support of G rows, the sampled logprob),
so a trace is a checked re-packing: every refusal names the request and the position.

Legend: S tokens, T route rows, H decoder layers SGLang reports, L MoE layers, K top-k, G generated, N kept ids.
"""

from __future__ import annotations

import binascii
import math
from typing import Any, Sequence

import numpy as np

from ...capture_config import CaptureConfig
from ...errors import ExpertIdOutOfRangeError, Where
from ...geometry import ModelGeometry
from ...trace import SamplingSupport
from .errors import SglangPayloadError


def decode_routes(key: str, payload: Any, num_tokens: int, route_start: int, geometry: ModelGeometry) -> np.ndarray:
    """routes_TLK (geometry's narrow dtype, MoE layers only) from SGLang's base64 int32 payload, checked:
    decodable, a whole number of [H, K] rows, exactly S - 1 - route_start rows, ids in [0, E)."""
    w = Where(record=key, field="meta_info.routed_experts")
    if not isinstance(payload, (str, bytes)):
        raise SglangPayloadError(w, "base64 of int32 expert ids (request sent with return_routed_experts)",
                                 type(payload).__name__)
    try:
        raw = binascii.a2b_base64(payload.encode("ascii") if isinstance(payload, str) else payload, strict_mode=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as e:
        raise SglangPayloadError(w, "base64 text", f"undecodable ({e})", f"{len(payload)} characters") from None
    H, K = geometry.num_layers, geometry.top_k
    T = max(num_tokens - 1 - route_start, 0)
    row_bytes = 4 * H * K
    if len(raw) % row_bytes:
        raise SglangPayloadError(w, f"whole rows of {H} layers x top-{K} int32 ids ({row_bytes} bytes each)",
                                 f"{len(raw)} bytes", "the payload's layer count or top-k is not the model's")
    if len(raw) != T * row_bytes:
        raise SglangPayloadError(
            w, f"{T} rows (positions {route_start}..{route_start + T - 1} of {num_tokens} tokens; the last is never "
               "forwarded)", f"{len(raw) // row_bytes} rows")
    ids_THK = np.frombuffer(raw, dtype="<i4").reshape(T, H, K)
    routes_TLK = ids_THK[:, list(geometry.moe_layer_ids), :]
    bad = np.argwhere((routes_TLK < 0) | (routes_TLK >= geometry.num_experts))
    if len(bad):
        t, j, k = (int(x) for x in bad[0])
        raise ExpertIdOutOfRangeError(
            w.with_(field=f"meta_info.routed_experts[position {route_start + t}, layer {geometry.moe_layer_ids[j]}, "
                          f"column {k}]"), f"expert ids in [0, {geometry.num_experts})", int(routes_TLK[t, j, k]))
    return np.ascontiguousarray(routes_TLK).astype(geometry.route_dtype)


def support_overflow(key: str, sizes_G: np.ndarray, config: CaptureConfig, prompt_len: int) -> dict[str, int] | None:
    """`config.on_support_overflow` on a request's kept-set sizes: None when every row fits, the
    extra["support_omitted"] entry under 'omit'; under 'error' a SglangPayloadError naming the row."""
    if not len(sizes_G) or int(sizes_G.max()) <= config.max_support:
        return None
    g = int(np.flatnonzero(sizes_G > config.max_support)[0])
    if config.on_support_overflow == "error":
        raise SglangPayloadError(
            Where(record=key, field=f"meta_info.output_token_sampling_mask[row {g}, position {prompt_len + g}]"),
            f"<= CaptureConfig.max_support={config.max_support} kept ids", int(sizes_G[g]),
            "policy 'error': raise max_support, use 'omit', or sample with a finite top_k")
    return {"row": g, "size": int(sizes_G[g]), "max_support": config.max_support}


def decode_support(key: str, mask: Any, gen_G: np.ndarray, prompt_len: int, geometry: ModelGeometry,
                   config: CaptureConfig) -> tuple[SamplingSupport | None, dict[str, Any]]:
    """CSR support (rows sorted ascending) from SGLang's per-token kept lists; each row must hold its
    sampled token. Oversized rows follow `config.on_support_overflow` (support None under 'omit')."""
    w = Where(record=key, field="meta_info.output_token_sampling_mask")
    G = len(gen_G)
    if not isinstance(mask, (list, tuple)) or len(mask) != G:
        raise SglangPayloadError(w, f"{G} kept-id lists, one per generated token (request sent with "
                                    "return_sampling_mask)", None if mask is None else f"{len(mask)} lists"
                                 if isinstance(mask, (list, tuple)) else type(mask).__name__)
    sizes_G = np.fromiter((len(r) for r in mask), dtype=np.int64, count=G)
    omitted = support_overflow(key, sizes_G, config, prompt_len)
    if omitted:
        return None, {"support_omitted": omitted}
    rows = [np.sort(np.asarray(r, dtype=np.int64).reshape(-1)) for r in mask]
    for g, row in enumerate(rows):
        at = w.with_(field=f"meta_info.output_token_sampling_mask[row {g}, position {prompt_len + g}]")
        if len(row) and (row[0] < 0 or row[-1] >= geometry.vocab_size):
            raise SglangPayloadError(at, f"token ids in [0, {geometry.vocab_size})", [int(row[0]), int(row[-1])])
        if len(row) > 1 and (row[1:] == row[:-1]).any():
            raise SglangPayloadError(at, "distinct token ids", row[:16].tolist())
        i = int(np.searchsorted(row, gen_G[g]))
        if i == len(row) or row[i] != gen_G[g]:
            raise SglangPayloadError(at, f"a kept set holding the sampled token {int(gen_G[g])}",
                                     f"{len(row)} ids {row[:16].tolist()}")
    return SamplingSupport.from_rows(rows), {}


def decode_logprobs(key: str, logprobs: Sequence[Any] | None, G: int, prompt_len: int) -> np.ndarray:
    """logprobs_G from `output_token_sampling_logprobs` (the sampled token's, over its kept set): G finite floats."""
    w = Where(record=key, field="meta_info.output_token_sampling_logprobs")
    if not isinstance(logprobs, (list, tuple)) or len(logprobs) != G:
        raise SglangPayloadError(w, f"{G} logprobs (return_sampling_mask with sampling_logprobs_mode 'selected')",
                                 None if logprobs is None else f"{len(logprobs)} values"
                                 if isinstance(logprobs, (list, tuple)) else type(logprobs).__name__)
    out_G = np.empty(G, dtype=np.float32)
    for g, v in enumerate(logprobs):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v > 1e-4:
            raise SglangPayloadError(w.with_(field=f"meta_info.output_token_sampling_logprobs[position {prompt_len + g}]"),
                                     "a finite logprob <= 0 of the sampled token", repr(v)[:40])
        out_G[g] = v
    return out_G
