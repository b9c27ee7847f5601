"""Find Megatron-core `TopKRouter` modules, key them by global layer id, check what replay needs.

Megatron numbers decoder layers from 1 across pipeline stages (`TransformerLayer.layer_number`
includes the stage offset) and hands that number to its MoE router; our global layer id
(invariant 2) is `layer_number - 1`. Routers are never matched by creation order.

Everything here runs before any forward: a router whose routing would bypass `RouterReplay`
(fused TE top-k returns from `topk_routing_with_score_function` before RouterReplay is consulted;
sinkhorn; a Router that is not a TopKRouter, or a TopKRouter subclass with its own routing), whose
logits are replaced (`moe_router_force_load_balancing`: random logits would weigh the replayed ids),
whose tokens go through a dispatcher replay was never run with (`REPLAYED_DISPATCHERS`: "flex" is refused),
or whose sequences are split into reordered chunks across ranks (context parallel), is refused with the setting to
change; so is a `TopKRouter.routing` / `forward` that another library replaced at class level, unless it is one
known to pass RouterReplay on (`KNOWN_ROUTING`: verl's R3 patch).

Multi-token-prediction routers (Megatron numbers an MTP layer num_layers + k and builds it inside a
`MultiTokenPredictionBlock`, `model.mtp`) are excluded by construction: the walk never enters that
block (`mtp_routers` names what it skipped), so no MTP router takes a decoder layer's routes; traces
hold decoder layers only and MTP routes freely. A router numbered past the decoder stack outside
that block is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Union

from torch import nn

from moe_replay.errors import GeometryMismatchError, Where
from moe_replay.geometry import ModelGeometry
from moe_replay.replay.errors import UnsupportedRouterError

ModelOrRouters = Union[nn.Module, Iterable[nn.Module]]
"""A Megatron model, a list of model chunks (virtual pipeline), or the routers themselves."""


REPLAYED_DISPATCHERS = frozenset({"allgather", "alltoall"})
"""Token dispatchers replay is tested with (tests/test_megatron_parallel.py, EP = 2): the others
(Megatron-core 0.16's "flex", over DeepEP / HybridEP) are refused by name at attach."""


def _topk_router_class() -> type:
    from megatron.core.transformer.moe.router import TopKRouter  # lazy: megatron is optional

    return TopKRouter


def router_base_class() -> type:
    from megatron.core.transformer.moe.router import Router

    return Router


KNOWN_ROUTING = frozenset({"megatron.core.transformer.moe.router", "verl.utils.megatron.router_replay_patch"})
"""Modules whose `TopKRouter.routing` / `forward` replay accepts: Megatron's own, and verl's R3 patch
(`apply_router_replay_patch`, which replaces `TopKRouter.routing` with one that passes the router's
RouterReplay on; read in verl 0.9.1). Any other class-level replacement is refused by name."""


def _mtp_prefixes(root: nn.Module) -> list[str]:
    """Module names (with a trailing dot) of the MultiTokenPredictionBlocks under `root`."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    return [f"{name}." for name, m in root.named_modules() if isinstance(m, MultiTokenPredictionBlock)]


@dataclass(frozen=True)
class RouterSite:
    """One Megatron router and the global layer id it routes."""

    layer_id: int
    name: str
    module: nn.Module
    chunk: int = 0
    """Index of the model chunk (virtual-pipeline stage) holding it; 0 for a model or routers."""

    @property
    def num_experts(self) -> int:
        return int(self.module.config.num_moe_experts)

    @property
    def top_k(self) -> int:
        return int(self.module.topk)


def _walk(model_or_routers: ModelOrRouters):
    """(chunk index, display name, router, under an MTP block) for every Router under the roots."""
    router_base = router_base_class()
    roots = [model_or_routers] if isinstance(model_or_routers, nn.Module) else list(model_or_routers)
    for c, root in enumerate(roots):
        if not isinstance(root, nn.Module):
            raise TypeError(f"replay needs a Megatron model, model chunks or routers (nn.Module), got {type(root).__name__} at {c}")
        prefix = f"chunk{c}." if len(roots) > 1 else ""
        mtp = _mtp_prefixes(root)
        for name, module in root.named_modules():
            if isinstance(module, router_base):
                yield c, f"{prefix}{name or type(module).__name__}", module, any(name.startswith(p) for p in mtp)


def mtp_routers(model_or_routers: ModelOrRouters) -> dict[str, nn.Module]:
    """{name: router} of the multi-token-prediction routers replay leaves alone (free routing)."""
    return {where: module for _, where, module, in_mtp in _walk(model_or_routers) if in_mtp}


def find_routers(model_or_routers: ModelOrRouters) -> dict[int, RouterSite]:
    """{global layer id: RouterSite} in increasing layer order, for every decoder TopKRouter found
    (MTP routers excluded: `mtp_routers`)."""
    topk_router = _topk_router_class()
    sites: dict[int, RouterSite] = {}
    for c, where, module, in_mtp in _walk(model_or_routers):
        if in_mtp:
            continue
        if not isinstance(module, topk_router):
            raise UnsupportedRouterError(
                f"router {where!r} is a {type(module).__name__}, not a TopKRouter: it has no RouterReplay, "
                "so its experts would be chosen freely"
            )
        if module.layer_number is None:
            raise UnsupportedRouterError(
                f"router {where!r} has no layer_number; Megatron sets it through MoELayer.set_layer_number "
                "(TransformerLayer does this) and replay keys routes by it"
            )
        lid = int(module.layer_number) - 1
        num_layers = int(module.config.num_layers)
        if lid >= num_layers:
            raise UnsupportedRouterError(
                f"router {where!r} has layer_number {lid + 1} > num_layers {num_layers}: a multi-token-prediction "
                "layer outside the decoder stack; traces hold decoder layers only, so it cannot be replayed "
                "(a MultiTokenPredictionBlock's routers are excluded; this one is outside any)"
            )
        if lid in sites:
            raise UnsupportedRouterError(
                f"routers {sites[lid].name!r} and {where!r} both claim global layer {lid} (layer_number {lid + 1}); "
                "one router per decoder layer is required"
            )
        sites[lid] = RouterSite(lid, where, module, c)
    if not sites:
        raise UnsupportedRouterError(f"no megatron TopKRouter found in {type(model_or_routers).__name__}; is this an MoE model?")
    return dict(sorted(sites.items()))


def check_replayable(site: RouterSite, *, native: bool = False) -> None:
    """Refuse routers whose routing would not go through RouterReplay or sees a slice of the tokens.
    `native`: Megatron's own RouterReplay instance is required (the project's path lends one)."""
    cfg, m = site.module.config, site.module

    def refuse(setting: str, found, why: str) -> None:
        raise UnsupportedRouterError(f"router {site.name!r} (layer {site.layer_id}): {setting}={found!r} {why}")

    if native and m.router_replay is None:
        refuse("moe_enable_routing_replay", cfg.moe_enable_routing_replay,
               "gives the router no RouterReplay, which trainer_path 'megatron_native' drives; set it True in "
               "TransformerConfig (or use trainer_path 'project', which lends the router one for the session)")
    if cfg.moe_router_fusion:
        refuse("moe_router_fusion", True, "routes through TE's fused top-k, which returns before RouterReplay is consulted; set it False")
    if getattr(cfg, "moe_router_force_load_balancing", False):
        refuse("moe_router_force_load_balancing", True, "replaces the router logits with random ones, so replayed ids would get random weights")
    base = _topk_router_class()
    for method in ("forward", "routing"):
        if getattr(type(m), method) is not getattr(base, method):
            refuse(f"{type(m).__name__}.{method}", "overridden", "may route without passing RouterReplay; replay drives TopKRouter's own routing only")
        owner = getattr(getattr(base, method), "__module__", None)
        if owner not in KNOWN_ROUTING:
            refuse(f"TopKRouter.{method}", f"replaced by {owner}",
                   f"at class level; replay knows only routing from {sorted(KNOWN_ROUTING)} to pass RouterReplay on")
    if m.routing_type == "sinkhorn":
        refuse("moe_router_load_balancing_type", "sinkhorn", "picks experts without RouterReplay")
    dispatcher = getattr(cfg, "moe_token_dispatcher_type", None)
    if dispatcher not in REPLAYED_DISPATCHERS:
        refuse("moe_token_dispatcher_type", dispatcher,
               f"is not one replay was run and checked with (expected one of {sorted(REPLAYED_DISPATCHERS)}): 'flex' hands "
               "the routing map to DeepEP / HybridEP fused kernels, which need a GPU and have no test here; set "
               "'alltoall' (replayed across EP ranks of unequal shapes) or 'allgather'")
    if cfg.moe_expert_capacity_factor is not None:
        refuse("moe_expert_capacity_factor", cfg.moe_expert_capacity_factor, "may drop replayed tokens the engine kept; set it None")
    cp = m.cp_group.size()
    if cp > 1:
        refuse("context_parallel_size", cp,
               f"splits each sequence over {cp} ranks (each holds 2 of its {2 * cp} chunks, reordered for load balance), "
               f"so this router would see S / {cp} positions that the plan's [S, B] routes are not laid out for; "
               "expected 1 (replay does not support context parallelism)")


def sequence_share(site: RouterSite) -> tuple[int, int]:
    """(ranks, this rank) that split each micro-batch's sequence before this router: Megatron's
    sequence parallelism hands TP rank r the positions [r * S / ranks, (r + 1) * S / ranks) of the
    sequence-first [S, B, H] hidden states (scatter_to_sequence_parallel_region: dim 0); (1, 0)
    when the router sees the whole sequence."""
    m = site.module
    if m.config.sequence_parallel and m.tp_group.size() > 1:
        return m.tp_group.size(), m.tp_group.rank()
    return 1, 0


def model_geometry(model_or_routers: ModelOrRouters, *, vocab_size: int | None = None, family: str = "megatron") -> ModelGeometry:
    """The ModelGeometry of a Megatron MoE model (all its MoE layers on this rank), for build_plan."""
    sites = find_routers(model_or_routers)
    first = next(iter(sites.values()))
    if vocab_size is None:
        vocab_size = getattr(model_or_routers, "vocab_size", None)
    if vocab_size is None:
        raise ValueError(f"model_geometry needs vocab_size for a {type(model_or_routers).__name__} (no .vocab_size attribute)")
    return ModelGeometry(
        num_layers=int(first.module.config.num_layers),
        moe_layer_ids=tuple(sites),
        num_experts=first.num_experts,
        top_k=first.top_k,
        vocab_size=int(vocab_size),
        family=family,
    )


def check_geometry(sites: dict[int, RouterSite], geometry: ModelGeometry, *, partial: bool, vocab_size: int | None) -> None:
    """Compare the routers with the plan's geometry; `partial` allows a pipeline stage's subset of layers."""
    found = tuple(sites)
    expected = geometry.moe_layer_ids
    if (not partial and found != expected) or (partial and not set(found) <= set(expected)):
        raise GeometryMismatchError(
            Where(field="geometry.moe_layer_ids"),
            f"{'a subset of ' if partial else ''}{expected}",
            found,
            "Megatron routers (layer_number - 1) vs plan" + ("" if partial else "; a pipeline stage passes partial=True"),
        )
    for lid, site in sites.items():
        if (site.num_experts, site.top_k) != (geometry.num_experts, geometry.top_k):
            raise GeometryMismatchError(
                Where(field=f"layer {lid} (num_experts, top_k)"),
                (geometry.num_experts, geometry.top_k),
                (site.num_experts, site.top_k),
                f"Megatron router {site.name!r} vs plan",
            )
    num_layers = int(next(iter(sites.values())).module.config.num_layers)
    if num_layers != geometry.num_layers:
        raise GeometryMismatchError(Where(field="geometry.num_layers"), geometry.num_layers, num_layers, "Megatron config.num_layers vs plan")
    if vocab_size is not None and int(vocab_size) != geometry.vocab_size:
        raise GeometryMismatchError(Where(field="geometry.vocab_size"), geometry.vocab_size, int(vocab_size), "Megatron model vs plan")
