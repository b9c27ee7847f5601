"""Capture from SGLang: one trace per sample, from SGLang's own outputs, for an Engine or a running server.

    from moe_replay.integrations.sglang import SglangCapture
    cap = SglangCapture(engine)                       # sglang.Engine(..., enable_return_routed_experts=True)
    cap = SglangCapture("http://127.0.0.1:30000")     # python -m sglang.launch_server ... --enable-return-routed-experts
    outputs, traces = cap.generate(prompts, {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "max_new_tokens": 64})

What differs between the two sits behind one small seam (`Transport`: engine.py, server.py): send a
generate request, read the model's config, name the engine. Everything else is here: the request's
fields (request.py), the checks of every output (payload.py), the traces. SGLang has no worker hooks
for moe_replay to install: routes, kept sets and logprobs all come from its outputs, so
`CaptureConfig(source="hooks")` is refused by name, and `uninstall()` has nothing to undo.
"""

from __future__ import annotations

import time
from typing import Any, Protocol, Sequence

import numpy as np

from ...capture_config import CaptureConfig
from ...errors import Where
from ...geometry import EngineInfo, ModelGeometry
from ...trace import RolloutTrace, Sampling
from .errors import SglangCollectError, SglangPayloadError, SglangSourceError
from .payload import decode_logprobs, decode_routes, decode_support
from .request import per_prompt, request_fields, sampling_of
from .served import served_geometry

DEFAULT_WEIGHT_VERSION = "default"
"""SGLang's `weight_version` until an update names one (`update_weights_from_disk(..., weight_version=)`)."""


class Transport(Protocol):
    """How capture reaches one SGLang engine (engine.EngineTransport, server.HttpTransport)."""

    where: str
    """How the engine is named in errors (its model path, or the server's URL)."""

    def generate(self, fields: dict[str, Any]) -> list[dict[str, Any]]:
        """Run one batch request; one output dict per sample ({"output_ids", "meta_info", "prompt_token_ids"})."""

    def model_config(self) -> Any:
        """The served model's HF config (object or dict)."""

    def engine_info(self) -> EngineInfo:
        """name "sglang", its version and compute dtype."""

    def radix_cache_disabled(self) -> bool:
        """Whether the engine runs without its radix (prefix) cache (forced scoring needs it off)."""


def transport_for(engine: Any, model: Any = None, timeout_s: float = 600.0) -> Transport:
    """An `sglang.Engine`, or a server's base URL (str)."""
    if isinstance(engine, str):
        from .server import HttpTransport

        return HttpTransport(engine, model=model, timeout_s=timeout_s)
    from .engine import EngineTransport

    return EngineTransport(engine)


class SglangCapture:
    """Capture on one SGLang engine or server: `generate` sends a batch and returns (outputs, traces).

    Checks at attach, before any rollout: the config (source "auto" or "native": SGLang's outputs are
    the only source) and the served model (served.py: checkpoints SGLang mis-serves are refused by name).
    """

    def __init__(self, engine: Any, config: CaptureConfig | None = None, *, model: Any = None,
                 timeout_s: float = 600.0) -> None:
        self.config = config or CaptureConfig()
        if self.config.source == "hooks":
            raise SglangSourceError("CaptureConfig(source='hooks'): SGLang has no worker hooks for moe_replay; its own "
                                    "outputs (return_routed_experts, return_sampling_mask) are the source: use "
                                    "source='auto' or 'native'")
        self.transport = transport_for(engine, model, timeout_s)
        self.geometry: ModelGeometry = served_geometry(self.transport.model_config(), self.transport.where)
        self.engine_info = self.transport.engine_info()
        self.weights_version: str | int | None = None
        """Recorded in every trace: set it (a step or checkpoint fingerprint) after each weight sync. SGLang's
        own `weight_version`, where an update named one, must agree with it (else the trace is refused)."""
        self.seconds = {"request": 0.0, "build": 0.0, "store": 0.0}
        """Host seconds since attach: the engine's requests, building traces, writing them to a store."""

    def generate(self, prompts: Any, sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None, *,
                 store: Any = None, route_start: int = 0, rid: Sequence[str] | None = None,
                 custom_logit_processor: Any = None) -> tuple[list[dict[str, Any]], list[RolloutTrace]]:
        """Generate for `prompts` (a str, a list of str, a list of token ids or a list of those) and return
        SGLang's outputs with one trace per sample, in SGLang's order (each prompt's n samples together).

        `route_start` is SGLang's `routed_experts_start_len`: a turn of a conversation returns only the routes
        of positions from it on (the previous turn's record holds the rest; join them with `stitch`). Traces
        go to `store` when given. Raises SglangCollectError (`.traces`: every good one) when some fail.
        """
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        prompts = list(prompts)
        params = per_prompt(sampling_params, len(prompts))
        n = int(params[0].get("n") or 1) if params else 1
        # SGLang 0.5.23 runs n > 1 as a prefix warm-up request with max_new_tokens=0, which samples nothing
        # and fails under return_sampling_mask ("The sampling backend did not return captured sampling
        # support"): each prompt goes n times with n=1 instead (what SGLang's own warning recommends), in
        # SGLang's order, each prompt's samples together; the radix cache shares their prompt.
        expanded = [q for q in prompts for _ in range(n)]
        params_1 = [{**p, "n": 1} for p in params for _ in range(n)]
        fields = request_fields(self.config, expanded, params_1, route_start=route_start, rid=rid,
                                custom_logit_processor=custom_logit_processor)
        t0 = time.perf_counter()
        outputs = self.transport.generate(fields)
        self.seconds["request"] += time.perf_counter() - t0
        if len(outputs) != len(expanded):
            raise SglangPayloadError(Where(field="outputs"), f"{len(expanded)} outputs ({len(prompts)} prompts x n={n})",
                                     len(outputs))
        samplings = [sampling_of(p, custom_logit_processor) for p in params_1]
        return outputs, self.collect(outputs, samplings, route_start=route_start, store=store)

    def collect(self, outputs: Sequence[dict[str, Any]], sampling: Sequence[Sampling] | None = None, *,
                route_start: int = 0, store: Any = None) -> list[RolloutTrace]:
        """One trace per SGLang output (sent with request.request_fields' flags); `sampling` per output."""
        t0 = time.perf_counter()
        traces, failures = [], {}
        for i, out in enumerate(outputs):
            meta = (out.get("meta_info") or {}) if isinstance(out, dict) else {}
            key = str(meta.get("id") or f"output-{i}")
            try:
                traces.append(self.trace(key, out, sampling[i] if sampling else Sampling(), route_start))
            except Exception as e:  # one bad request never costs the others their traces
                failures[key] = e
        t1 = time.perf_counter()
        self.seconds["build"] += t1 - t0
        if store is not None:
            store.put_many(traces)
            self.seconds["store"] += time.perf_counter() - t1
        if failures:
            raise SglangCollectError(traces, failures)
        return traces

    def trace(self, key: str, out: dict[str, Any], sampling: Sampling, route_start: int = 0) -> RolloutTrace:
        """One output -> RolloutTrace, every part checked (payload.py), the weights version guarded."""
        meta = out.get("meta_info") or {}
        w = Where(record=key)
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            raise SglangPayloadError(w.with_(field="meta_info.finish_reason"), "a finished request", reason)
        prompt_S = out.get("prompt_token_ids")
        if prompt_S is None:
            raise SglangPayloadError(w.with_(field="prompt_token_ids"), "the prompt's token ids (return_prompt_token_ids)",
                                     None)
        prompt = np.asarray(prompt_S, dtype=np.int64).reshape(-1)
        gen_G = np.asarray(out.get("output_ids") or [], dtype=np.int64).reshape(-1)
        if meta.get("completion_tokens", len(gen_G)) != len(gen_G):
            raise SglangPayloadError(w.with_(field="output_ids"), f"{meta['completion_tokens']} ids (completion_tokens)",
                                     len(gen_G))
        S, P = len(prompt) + len(gen_G), len(prompt)
        if not 0 <= route_start <= max(S - 1, 0):
            raise SglangPayloadError(w.with_(field="routed_experts_start_len"), f"in [0, {S - 1}]", route_start)
        c, extra = self.config, {}
        routes = decode_routes(key, meta.get("routed_experts"), S, route_start, self.geometry) if c.routes else None
        support = None
        if c.support:
            support, extra = decode_support(key, meta.get("output_token_sampling_mask"), gen_G, P, self.geometry, c)
        logprobs = decode_logprobs(key, meta.get("output_token_sampling_logprobs"), len(gen_G), P) if c.logprobs else None
        trace = RolloutTrace(key=key, token_ids_S=np.concatenate([prompt, gen_G]), prompt_len=P, geometry=self.geometry,
                             routes_TLK=routes, route_start=route_start if c.routes else 0, support=support,
                             logprobs_G=logprobs, engine=self.engine_info, extra=extra, sampling=sampling,
                             weights_version=self._weights_version(meta, w))
        return trace.validate()

    def _weights_version(self, meta: dict[str, Any], w: Where) -> str | int | None:
        """The capture's weights_version, checked against SGLang's: one version over the whole request,
        the same as the capture's where an update named one (else the engine's own name, if any)."""
        spans = meta.get("weight_versions") or []
        versions = list(dict.fromkeys(str(s["version"] if isinstance(s, dict) else s[0]) for s in spans))
        if len(versions) > 1:
            raise SglangPayloadError(w.with_(field="meta_info.weight_versions"), "one weight version over the request",
                                     spans, "the weights were updated while it was sampled: its tokens mix two policies")
        engine = str(meta.get("weight_version", versions[0] if versions else DEFAULT_WEIGHT_VERSION))
        if self.weights_version is None:
            return None if engine == DEFAULT_WEIGHT_VERSION else engine
        if engine != DEFAULT_WEIGHT_VERSION and engine != str(self.weights_version):
            raise SglangPayloadError(w.with_(field="meta_info.weight_version"), repr(str(self.weights_version)),
                                     repr(engine), "the capture's weights_version is not the engine's")
        return self.weights_version

    def uninstall(self) -> None:
        """Nothing to undo: capture installs nothing in SGLang (what `moe_replay.enable(...).close()` calls)."""

    def __enter__(self) -> "SglangCapture":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()
