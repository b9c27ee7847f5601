"""One SGLang generate request as capture sends it, and the sampling parameters a trace records from it.

The same JSON fields go to `sglang.Engine` (as a `GenerateReqInput`) and to a server's `/generate`:
`return_routed_experts`, `return_sampling_mask` (the kept set per token, with the sampled token's logprob
renormalised over it: `sampling_logprobs_mode` "selected") and `return_prompt_token_ids` (the ids SGLang
tokenised a text prompt into), each only when the capture config wants the part.
"""

from __future__ import annotations

from typing import Any, Sequence

from ...capture_config import CaptureConfig
from ...trace import Sampling

LOGIT_ADJUSTMENTS: tuple[tuple[str, Any], ...] = (
    ("repetition_penalty", lambda v: v is not None and float(v) != 1.0),
    ("presence_penalty", lambda v: bool(v)),
    ("frequency_penalty", lambda v: bool(v)),
    ("logit_bias", lambda v: bool(v)),
    ("min_new_tokens", lambda v: bool(v)),
    ("json_schema", lambda v: bool(v)),
    ("regex", lambda v: bool(v)),
    ("ebnf", lambda v: bool(v)),
    ("structural_tag", lambda v: bool(v)),
    ("watermark", lambda v: bool(v)),
)
"""SGLang sampling parameters that change the logits the sampler draws from (and whose recorded logprob
is of), each with its test for "set"; recorded by name in Sampling.adjusted (a request's
`custom_logit_processor` is recorded as "custom_logit_processor")."""

SAMPLING_EPS = 1e-6
"""SGLang turns a temperature below it into greedy decoding (top_k 1): the trace records temperature 0."""


def sampling_of(params: dict[str, Any] | None, custom_logit_processor: Any = None) -> Sampling:
    """The trace's Sampling from an SGLang sampling-params dict (SGLang's defaults where a key is absent)."""
    p = dict(params or {})
    t = p.get("temperature")
    t = 1.0 if t is None else float(t)
    top_k = p.get("top_k")
    top_k = -1 if top_k is None or int(top_k) >= 1 << 30 else int(top_k)
    if 0 <= t < SAMPLING_EPS:
        t, top_k = 0.0, -1
    adjusted = [name for name, is_set in LOGIT_ADJUSTMENTS if is_set(p.get(name))]
    if custom_logit_processor:
        adjusted.append("custom_logit_processor")
    seed = p.get("sampling_seed")
    return Sampling(temperature=t, top_k=top_k, top_p=float(p.get("top_p") if p.get("top_p") is not None else 1.0),
                    min_p=float(p.get("min_p") or 0.0), seed=None if seed is None else int(seed), adjusted=tuple(adjusted))


def per_prompt(sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None, num_prompts: int) -> list[dict[str, Any]]:
    """One sampling-params dict per prompt (a single dict serves every prompt); ValueError on a count mismatch."""
    if sampling_params is None or isinstance(sampling_params, dict):
        return [dict(sampling_params or {}) for _ in range(num_prompts)]
    params = [dict(p) for p in sampling_params]
    if len(params) != num_prompts:
        raise ValueError(f"sampling_params: expected one dict or {num_prompts} (one per prompt), got {len(params)}")
    ns = {int(p.get("n") or 1) for p in params}
    if len(ns) > 1:  # SGLang's own rule: one n for a batch
        raise ValueError(f"sampling_params: SGLang takes one n for a batch, got {sorted(ns)}")
    return params


def request_fields(config: CaptureConfig, prompts: Sequence[Any], params: list[dict[str, Any]], *,
                   route_start: int | Sequence[int] = 0, rid: Sequence[str] | None = None,
                   custom_logit_processor: Any = None) -> dict[str, Any]:
    """The generate request's fields (GenerateReqInput's names) for a batch of prompts: text (str) or
    token ids (lists of ints), never mixed."""
    texts = [isinstance(p, str) for p in prompts]
    if any(texts) and not all(texts):
        raise ValueError("prompts: all text (str) or all token ids (lists of ints), not both in one batch")
    fields: dict[str, Any] = {"sampling_params": params, "return_prompt_token_ids": True}
    if all(texts):
        fields["text"] = list(prompts)
    else:
        fields["input_ids"] = [[int(t) for t in p] for p in prompts]
    if config.routes:
        fields["return_routed_experts"] = True
        starts = [route_start] * len(prompts) if isinstance(route_start, int) else list(route_start)
        if len(set(starts)) > 1:
            raise ValueError(f"route_start: SGLang takes one routed_experts_start_len for a batch, got {sorted(set(starts))}")
        fields["routed_experts_start_len"] = int(starts[0]) if starts else 0
    if config.support or config.logprobs:
        fields["return_sampling_mask"] = True
        fields["sampling_logprobs_mode"] = "selected"
    if rid is not None:
        fields["rid"] = list(rid)
    if custom_logit_processor is not None:
        fields["custom_logit_processor"] = custom_logit_processor
    return fields
