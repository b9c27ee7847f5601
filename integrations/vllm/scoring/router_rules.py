"""The engine's own gate-weight rules at given ids: vLLM router kind -> the trainer's GateSpec.

Forcing replaces the ids a router chose and recomputes their weights from the router's logits by
the rule the router itself applies (invariant 4: ids are replayed, weights never). The rules are
the trainer's (moe_replay.replay.gates.GATE_RULES): this table only reads each vLLM router
class's settings into a GateSpec. Dispatch is by class name, so nothing here imports a router
module (cpu_router exists only in CPU builds, the fused routers' kernels only in GPU builds).
Only CPURouter runs on this machine; the GPU kinds follow vLLM 0.32's sources and are untested.

Legend: T rows, E experts, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import torch

from ....registry import Registry
from ....replay.gates import GateSpec, gate_weights
from ..errors import ForceRouteError


@dataclass(frozen=True)
class RouterGate:
    """A vLLM router's weight rule: the trainer's GateSpec plus where the router rounds."""

    spec: GateSpec
    rounds_to_logits_dtype: bool = False
    """The router computes its weights in the logits' dtype (CPURouter's plain softmax: bf16
    logits give bf16 weights); the fp32 rule's result is rounded the same way."""


ROUTER_GATES: Registry[Callable[[Any], RouterGate]] = Registry("vLLM router kind")
"""vLLM router class name -> its RouterGate (raises ForceRouteError if not reproducible)."""


def _refuse(router: Any, why: str) -> NoReturn:
    raise ForceRouteError(f"router {type(router).__name__}: {why}; its routes cannot be forced "
                          "(free-routing scoring, force_routes=False, works on any router)")


def _groups(router: Any) -> dict[str, int]:
    g, k = int(router.num_expert_group or 1), int(router.topk_group or 1)
    return {"num_groups": g, "topk_group": min(k, g)}


@ROUTER_GATES.register("CPURouter")
def _cpu_router(r: Any) -> RouterGate:
    """vLLM-CPU's one router: plain softmax top-k, or grouped top-k (softmax / sigmoid + bias)."""
    if r.use_grouped_topk:  # computed in fp32 (gating_output.float())
        rule = {"softmax": "softmax_topk", "sigmoid": "sigmoid_bias_group"}.get(r.scoring_func)
        if rule is None:
            _refuse(r, f"grouped top-k with scoring_func={r.scoring_func!r}")
        return RouterGate(GateSpec(rule, r.top_k, bool(r.renormalize), float(r.routed_scaling_factor), **_groups(r)))
    if r.custom_routing_function is not None:
        _refuse(r, f"custom_routing_function {getattr(r.custom_routing_function, '__name__', r.custom_routing_function)!r}")
    if r.scoring_func != "softmax":
        _refuse(r, f"scoring_func={r.scoring_func!r} (DeepSeek-V4 sqrtsoftplus / hash routing has no gate rule)")
    # renormalised: softmax over the K chosen logits (what cpu_router._softmax_topk computes, bit
    # for bit); else softmax over all E experts gathered at the ids. Both in the logits' dtype.
    spec = GateSpec("topk_softmax", r.top_k) if r.renormalize else GateSpec("softmax_topk", r.top_k, renormalize=False)
    return RouterGate(spec, rounds_to_logits_dtype=True)


@ROUTER_GATES.register("FusedTopKRouter")
def _fused_topk(r: Any) -> RouterGate:
    """GPU default: topk_softmax / topk_sigmoid kernels (fp32 inside); no scaling (applied downstream)."""
    if r.scoring_func == "softmax":
        return RouterGate(GateSpec("softmax_topk", r.top_k, bool(r.renormalize)))
    if r.scoring_func == "sigmoid":
        return RouterGate(GateSpec("sigmoid_bias_group", r.top_k, bool(r.renormalize)))
    _refuse(r, f"scoring_func={r.scoring_func!r}")


@ROUTER_GATES.register("GroupedTopKRouter")
def _grouped_topk(r: Any) -> RouterGate:
    """DeepSeek-V2/V3 style: groups and the correction bias choose, the scores weigh."""
    if getattr(r, "num_fused_shared_experts", 0):
        _refuse(r, f"{r.num_fused_shared_experts} fused shared experts (ROCm AITER)")
    rule = {"softmax": "softmax_topk", "sigmoid": "sigmoid_bias_group"}.get(r.scoring_func)
    if rule is None:
        _refuse(r, f"scoring_func={r.scoring_func!r}")
    return RouterGate(GateSpec(rule, r.top_k, bool(r.renormalize), float(r.routed_scaling_factor), **_groups(r)))


@ROUTER_GATES.register("FusedTopKBiasRouter")
def _fused_topk_bias(r: Any) -> RouterGate:
    """Sigmoid + correction bias without groups (the bias chooses, sigmoid weighs)."""
    for attr, why in (("_hash_indices_table", "hash-routed layer"), ("bias_vl", "vision routing bias")):
        if getattr(r, attr, None) is not None:
            _refuse(r, why)
    if getattr(r, "num_fused_shared_experts", 0):
        _refuse(r, f"{r.num_fused_shared_experts} fused shared experts")
    if r.scoring_func != "sigmoid":
        _refuse(r, f"scoring_func={r.scoring_func!r} with a correction bias")
    return RouterGate(GateSpec("sigmoid_bias_group", r.top_k, bool(r.renormalize), float(r.routed_scaling_factor)))


def router_gate(router: Any, layer_id: int) -> RouterGate:
    """The rule reproducing `router`'s weights, or ForceRouteError naming its kind."""
    kind = type(router).__name__
    if kind not in ROUTER_GATES:
        raise ForceRouteError(
            f"MoE layer {layer_id}: router kind {kind} has no gate rule (known: {', '.join(ROUTER_GATES.names())}); "
            "its routes cannot be forced (free-routing scoring, force_routes=False, works on any router)")
    try:
        return ROUTER_GATES.get(kind)(router)
    except ForceRouteError as e:
        raise ForceRouteError(f"MoE layer {layer_id}: {e}") from None


def forced_gate_weights(gate: RouterGate, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """fp32 weights [T, K] the router's rule gives to experts ids_TK (column order kept)."""
    w_TK = gate_weights(logits_TE, ids_TK.long(), gate.spec)
    if gate.rounds_to_logits_dtype and logits_TE.dtype != torch.float32:
        w_TK = w_TK.to(logits_TE.dtype)
    return w_TK.to(torch.float32)
