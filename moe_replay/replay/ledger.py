"""Exactly-once accounting of replayed routes (invariant 6), keyed by global layer id.

A plan serves one forward: each MoE layer takes its routes exactly once, plus once more for each
activation-checkpoint recompute (which runs inside backward and must get the very same ids).
Routes are looked up by the layer id bound to each router, never by call order, so recompute in
any order is safe. Leftovers and shortfalls raise RouteConsumptionError naming layer and requests.
"""

from __future__ import annotations

import torch

from ..geometry import ModelGeometry
from .errors import RouteConsumptionError
from .plan import RoutePlan


def in_backward() -> bool:
    """True while autograd runs a backward pass (where activation checkpointing recomputes)."""
    return torch._C._current_graph_task_id() != -1


class RouteLedger:
    """Hands out a plan's routes per layer and counts forward takes and recompute takes."""

    def __init__(self, plan: RoutePlan) -> None:
        self.plan = plan
        self.forward_takes: dict[int, int] = {lid: 0 for lid in plan.geometry.moe_layer_ids}
        self.recompute_takes: dict[int, int] = {lid: 0 for lid in plan.geometry.moe_layer_ids}

    def _requests(self) -> str:
        keys = self.plan.keys
        return ", ".join(repr(k) for k in keys[:8]) + (f" (+{len(keys) - 8} more)" if len(keys) > 8 else "")

    def take(self, layer_id: int, num_tokens: int) -> torch.Tensor:
        """Replay ids [N, K] of `layer_id` for a router call over `num_tokens` flattened positions."""
        if layer_id not in self.forward_takes:
            raise RouteConsumptionError(
                f"router at layer {layer_id} asked for routes, but the plan for requests [{self._requests()}] "
                f"has MoE layers {self.plan.geometry.moe_layer_ids} only"
            )
        if num_tokens != self.plan.num_positions:
            raise RouteConsumptionError(
                f"layer {layer_id}: router saw {num_tokens} tokens, the plan for requests [{self._requests()}] "
                f"has B*S = {self.plan.batch_size}*{self.plan.seq_len} = {self.plan.num_positions}; "
                "feed the model plan.model_inputs() (same batch, same padding)"
            )
        if in_backward():
            if self.recompute_takes[layer_id] >= max(self.forward_takes[layer_id], 1):
                raise RouteConsumptionError(
                    f"layer {layer_id}: routes of requests [{self._requests()}] recomputed "
                    f"{self.recompute_takes[layer_id] + 1} times after {self.forward_takes[layer_id]} forward(s)"
                )
            self.recompute_takes[layer_id] += 1
        else:
            if self.forward_takes[layer_id] >= 1:
                raise RouteConsumptionError(
                    f"layer {layer_id}: routes of requests [{self._requests()}] used by a second forward; "
                    "one plan serves one forward (plus its activation recompute): build a plan per micro-batch"
                )
            self.forward_takes[layer_id] += 1
        return self.plan.layer_ids(layer_id)

    def finish(self, *, expect_recompute: bool = False) -> None:
        """Raise if any layer's routes were never used (or never recomputed when that was due)."""
        unused = [lid for lid, n in self.forward_takes.items() if n == 0]
        if unused:
            raise RouteConsumptionError(
                f"routes of layers {unused} for requests [{self._requests()}] were never consumed "
                f"(consumed: {[lid for lid, n in self.forward_takes.items() if n]}); "
                "did the forward run inside the replay context, and does the model route those layers?"
            )
        if expect_recompute and not any(self.recompute_takes.values()):
            raise RouteConsumptionError(
                f"activation checkpointing is on but no recompute ran inside the replay context for requests "
                f"[{self._requests()}]: run loss.backward() inside it, or the recompute routes freely"
            )


def check_layers(model_layers: dict[int, tuple[int, int]], geometry: ModelGeometry) -> None:
    """Compare the model's routers {layer id: (num_experts, top_k)} with the plan's geometry."""
    from ..errors import GeometryMismatchError, Where

    found = tuple(sorted(model_layers))
    if found != geometry.moe_layer_ids:
        raise GeometryMismatchError(Where(field="geometry.moe_layer_ids"), found, geometry.moe_layer_ids, "model routers vs trace")
    for lid, (e, k) in model_layers.items():
        if (e, k) != (geometry.num_experts, geometry.top_k):
            raise GeometryMismatchError(
                Where(field=f"layer {lid} (num_experts, top_k)"), (e, k), (geometry.num_experts, geometry.top_k), "model router vs trace"
            )
