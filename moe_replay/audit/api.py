"""`moe_replay.audit(model, routes, token_ids, ...)`: one free-routing forward, then the verdict.

The model side goes through the trainer bindings (moe_replay/bindings.py: Megatron-core models and
chunks, else any torch module as a Hugging Face model, FSDP2-sharded included), whose `free_routes`
runs the forward with the adapter's own router discovery and hooks; nothing here imports a framework.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from .diagnose import diagnose
from .formats import guess_format, read_routes
from .routes import RoutesBatch
from .thresholds import THRESHOLDS, Thresholds
from .verdict import AuditReport


def audit(model: Any, routes: Any, token_ids: Any = None, *, format: str | None = None,
          context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
          thresholds: Thresholds = THRESHOLDS, **format_kwargs: Any) -> AuditReport:
    """Check that `routes` line up with their tokens on `model`, and name the cause where they do not.

    `routes` as the pipeline holds them, in `format` (moe_replay/audit/formats.py: "trace", "vllm",
    "sglang", "verl", "megatron"; guessed from the type where it says, e.g. RolloutTraces or base64
    text), with their `token_ids` and the format's own arguments (`prompt_start=` for vLLM,
    `start_len=` for SGLang, `attention_mask=` for verl, `layout=` for Megatron lists), or a
    RoutesBatch already read. `model`: the trainer's model (HF, FSDP2-sharded HF, a Megatron-core
    GPTModel), run once without gradients and with free routing, inside `context()` (the trainer's
    autocast, so the audit routes in the trainer's precision).

    Returns the AuditReport (never raises on misaligned routes; `.raise_if_misaligned()` does):

        moe_replay.audit(model, out.routed_experts, ids, format="vllm", prompt_start=0).raise_if_misaligned()
    """
    from ..bindings import TRAINER_BINDINGS, binding_for

    _, binding = binding_for(TRAINER_BINDINGS, model, "trainer")
    if binding.free_routes is None:
        raise ValueError(f"audit: the trainer binding for a {type(model).__name__} offers no free-routing forward")
    if not isinstance(routes, RoutesBatch) and (format or guess_format(routes)) == "sglang":
        geometry = binding.geometry(model, "")  # the payload does not say its shape; the model does
        format_kwargs = {"num_layers": geometry.num_layers, "top_k": geometry.top_k, **format_kwargs}
    batch = read_routes(routes, token_ids, format=format, **format_kwargs)
    free = binding.free_routes(model, [s.token_ids_S for s in batch.samples], context)
    return diagnose(batch, free, thresholds)
