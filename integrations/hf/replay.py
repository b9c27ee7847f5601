"""Force an HF transformers MoE model to route with recorded expert ids, reversibly.

`with replay(model, plan) as session:` hooks every router where it hands its experts their routes:
a forward hook on the router (PyTorch's own, removable extension point), or, where the parent block
routes the router's logits itself (DBRX), that block's routing method patched on the instance (never
the class) and undone on exit (outputs.py). The hook keeps HF's router logits, swaps the ids
for the plan's ids of that router's route layer (routers.route_layer), and recomputes the weights with the family's gate rule
from those logits, so gradients reach the router at the replayed experts; unpack and repack read
and write them in the router's own output convention. On exit the hooks are
removed and the ledger checks that every layer's routes were used exactly once (plus once per
activation recompute, which runs inside backward and gets the same ids: routes are keyed by the
layer id bound to each hook, not by call order).

Legend: N flattened positions (B * S), K top-k, E experts.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from moe_replay.errors import Where
from moe_replay.geometry import ModelGeometry
from moe_replay.replay.errors import RouteConsumptionError
from moe_replay.replay.gates import GATE_RULES
from moe_replay.replay.ledger import RouteLedger, check_layers, in_backward
from moe_replay.replay.plan import RoutePlan
from moe_replay.trace import RolloutTrace

from .infer import adapter_in_context, expert_scale_of
from .routers import RouterSite, find_routers, num_route_layers, routers_per_layer

_ACTIVE: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
"""Router modules currently under a replay or capture hook (nesting is refused)."""


def model_geometry(model: nn.Module, sites: dict[int, RouterSite] | None = None) -> ModelGeometry:
    """The ModelGeometry of an HF MoE causal LM, read from its routers (`sites`: find_routers's
    answer when the caller has it already) and config. Its layers are route layers (routers.route_layer):
    the decoder layers, or R per decoder layer for a family that routes R times in each (JetMoE: 2)."""
    sites = find_routers(model) if sites is None else sites
    first = next(iter(sites.values()))
    config = model.config
    out = model.get_output_embeddings()
    vocab = int(out.weight.shape[0]) if out is not None else int(config.vocab_size)
    return ModelGeometry(
        num_layers=num_route_layers(int(config.num_hidden_layers), sites),
        moe_layer_ids=tuple(sites),
        num_experts=first.adapter.num_experts(first.module),
        top_k=first.adapter.top_k(first.module),
        vocab_size=vocab,
        family=str(getattr(config, "model_type", "")),
    )


def _check_model(model: nn.Module, sites: dict[int, RouterSite], geometry: ModelGeometry) -> None:
    """The model against a plan's geometry, every router layer by layer, then every field (family included:
    the model's is its config.model_type); before any forward. A model routing R > 1 times per decoder layer
    names a route-layer count that differs first: a trace of its decoder layers (one router each) gets that wrong."""
    mine = model_geometry(model, sites)
    if routers_per_layer(sites) > 1 and mine.num_layers != geometry.num_layers:
        mine.check_matches(geometry, Where(), "model vs plan")
    check_layers({lid: (s.adapter.num_experts(s.module), s.adapter.top_k(s.module)) for lid, s in sites.items()}, geometry)
    mine.check_matches(geometry, Where(), "model vs plan")


def _claim(sites: dict[int, RouterSite]) -> None:
    busy = [s.name for s in sites.values() if s.module in _ACTIVE]
    if busy:
        raise RouteConsumptionError(f"routers {busy[:4]} are already under a replay/capture context; contexts do not nest")
    for s in sites.values():
        _ACTIVE.add(s.module)


def _release(sites: dict[int, RouterSite]) -> None:
    for s in sites.values():
        _ACTIVE.discard(s.module)


@dataclass
class FlipStats:
    """Per layer: routed positions seen and those where the trainer's own top-k set differs."""

    positions: dict[int, int] = field(default_factory=dict)
    flips: dict[int, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        total = sum(self.positions.values())
        return sum(self.flips.values()) / total if total else 0.0


@dataclass
class ReplayedRoutes:
    """What each MoE layer's experts actually received in the session's forward (backward
    recomputes reuse the same ids and are not recorded again). Legend: N = B * S positions."""

    used_ids: dict[int, torch.Tensor] = field(default_factory=dict)
    """layer id -> ids [N, K] the experts received: the plan's where `routed_N`, the model's own elsewhere."""
    own_ids: dict[int, torch.Tensor] = field(default_factory=dict)
    """layer id -> ids [N, K] the model's router chose itself in that forward (top-k of its own logits)."""
    routed_N: torch.Tensor | None = None
    """bool [N]: positions the plan forced (padding and positions without a recorded route are False)."""

    def flipped_N(self, layer_id: int) -> torch.Tensor:
        """bool [N]: forced positions of `layer_id` whose replayed expert set differs from the model's own."""
        return _differs_N(self.own_ids[layer_id], self.used_ids[layer_id], self.routed_N)

    def flips(self) -> dict[int, int]:
        """layer id -> number of flipped positions (the numbers FlipStats counts)."""
        return {lid: int(self.flipped_N(lid).sum()) for lid in self.used_ids}


class ReplaySession:
    """A model under replay for one plan. Use as a context manager (see `replay`).

    With `record_routes=True`, `session.routes` (ReplayedRoutes) holds per layer the ids the experts
    received and the model's own choice, once the forward has run."""

    def __init__(self, model: nn.Module, plan: RoutePlan, *, expect_recompute: bool | None = None, track_flips: bool = False,
                 record_routes: bool = False):
        self.model = model
        self.sites = find_routers(model)
        _check_model(model, self.sites, plan.geometry)  # before any forward
        device = next(model.parameters()).device
        self.plan = plan.to(device)
        self.ledger = RouteLedger(self.plan)
        self.expect_recompute = expect_recompute
        self.flips = FlipStats() if track_flips else None
        self.routes = ReplayedRoutes(routed_N=self.plan.routed_N) if record_routes else None
        self._routed_NK = None if self.plan.all_routed else self.plan.routed_N.unsqueeze(-1)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """input_ids, attention_mask, position_ids of the plan's batch, on the model's device."""
        return self.plan.model_inputs()

    def _hook(self, site: RouterSite):
        layer_id, routed_NK, flips, routes = site.layer_id, self._routed_NK, self.flips, self.routes
        rules: dict[int, tuple] = {}
        """id(adapter) -> (adapter, spec, rule) for each adapter a precision context was verified with."""

        def hook(module: nn.Module, args, output):
            # verified in this forward's input dtype and autocast state (probed on the first forward of each)
            adapter = adapter_in_context(module, args[0] if args else None, output)
            if id(adapter) not in rules:
                rules[id(adapter)] = (adapter, adapter.spec(module), GATE_RULES.get(adapter.spec(module).rule))
            _, spec, rule = rules[id(adapter)]
            logits_NE, _, free_NK = adapter.unpack(output)
            ids_NK = self.ledger.take(layer_id, logits_NE.shape[0])
            if routed_NK is not None:
                ids_NK = torch.where(routed_NK, ids_NK, free_NK)
            if flips is not None and not in_backward():
                _count_flips(flips, layer_id, free_NK, ids_NK, self.plan.routed_N)
            if routes is not None and not in_backward():
                routes.used_ids[layer_id], routes.own_ids[layer_id] = ids_NK.detach().clone(), free_NK.detach().clone()
            weights_NK = rule.weights(logits_NE, ids_NK, spec, adapter.selection_bias(module), expert_scale_of(adapter, module))
            return adapter.repack(output, logits_NE, weights_NK, ids_NK)

        return hook

    def __enter__(self) -> "ReplaySession":
        _claim(self.sites)
        if self.expect_recompute is None:
            self.expect_recompute = bool(
                _checkpointing(self.model) and self.model.training and torch.is_grad_enabled()
            )
        try:
            for site in self.sites.values():
                self._handles.append(site.adapter.register_hook(site.module, self._hook(site)))
        except BaseException:
            self._restore()
            raise
        return self

    def _restore(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        _release(self.sites)

    def __exit__(self, exc_type, exc, tb) -> None:
        self._restore()
        if exc_type is None:
            self.ledger.finish(expect_recompute=self.expect_recompute)


def _differs_N(free_NK: torch.Tensor, ids_NK: torch.Tensor, routed_N: torch.Tensor) -> torch.Tensor:
    """bool [N]: routed positions whose expert sets (order ignored) differ."""
    return (free_NK.sort(-1).values != ids_NK.sort(-1).values).any(-1) & routed_N


def _count_flips(stats: FlipStats, layer_id: int, free_NK: torch.Tensor, ids_NK: torch.Tensor, routed_N: torch.Tensor) -> None:
    differ_N = _differs_N(free_NK, ids_NK, routed_N)
    stats.positions[layer_id] = stats.positions.get(layer_id, 0) + int(routed_N.sum())
    stats.flips[layer_id] = stats.flips.get(layer_id, 0) + int(differ_N.sum())


def replay(model: nn.Module, plan: RoutePlan, *, expect_recompute: bool | None = None, track_flips: bool = False,
           record_routes: bool = False) -> ReplaySession:
    """Context manager: inside it, `model` routes every token with the plan's recorded expert ids.

    Checks the model against the plan's geometry on creation, before any forward. With
    activation checkpointing on (and training), run backward inside the context, or it raises.
    `track_flips` counts positions where the trainer's own top-k set differs from the replayed one.
    `record_routes` keeps the ids themselves: `session.routes.used_ids[layer]` [N, K] (what the
    experts received), `.own_ids[layer]` (the router's own top-k), `.flipped_N(layer)`, `.flips()`.

        plan = build_plan(traces, model_geometry(model))
        with replay(model, plan) as session:
            logits = model(**session.model_inputs()).logits
            scores = score_tokens(logits, session.plan)
            loss = -(scores.logprobs_G * adv_G).mean()
            loss.backward()
    """
    return ReplaySession(model, plan, expect_recompute=expect_recompute, track_flips=track_flips, record_routes=record_routes)


class capture_routes:
    """Context manager recording the model's own (free) routes: {layer id: ids [N, K]} of the last call.

    The trainer-side mirror of engine capture; used to measure route flips and in tests.
    """

    def __init__(self, model: nn.Module) -> None:
        self.sites = find_routers(model)
        self.ids: dict[int, torch.Tensor] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> dict[int, torch.Tensor]:
        _claim(self.sites)
        for lid, site in self.sites.items():
            def hook(module, args, output, lid=lid, unpack=site.adapter.unpack):
                if not in_backward():
                    self.ids[lid] = unpack(output)[2].detach().clone()

            self._handles.append(site.adapter.register_hook(site.module, hook))
        return self.ids

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        _release(self.sites)


def self_routed_trace(model: nn.Module, tokens_S: np.ndarray, prompt_len: int, request_id: str = "req-0") -> RolloutTrace:
    """A RolloutTrace of `tokens_S` whose routes are the model's own free routing of that sequence,
    run alone (batch of one, no padding: what an engine sees). Replaying it must reproduce the
    model's own logits bit for bit, which is how coverage and tests check a router adapter.
    """
    geometry = model_geometry(model)
    tokens_S = np.asarray(tokens_S)
    with torch.no_grad(), capture_routes(model) as cap:
        model(input_ids=torch.from_numpy(tokens_S).view(1, -1).to(_device(model)))
    # a trace holds routes of positions 0..S-2: the last token is sampled, never forwarded
    routes_TLK = torch.stack([cap[lid] for lid in geometry.moe_layer_ids], 1)[:-1].cpu().numpy()
    return RolloutTrace(request_id, tokens_S, prompt_len, geometry, routes_TLK=routes_TLK)


def _device(model: nn.Module) -> torch.device:
    """Where the model's inputs go: its first parameter's device (an FSDP2 shard's device is the mesh's)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def with_own_routes(plan: RoutePlan, own: dict[int, torch.Tensor]) -> RoutePlan:
    """`plan` routing each recorded position with the ids the model chose for it in this very batch (`own`:
    capture_routes's {layer id: ids [N, K]}): in bf16 a batch's padding changes rounding, so a sequence run
    alone may route otherwise than inside the batch."""
    ids_LNK = torch.stack([own[lid].reshape(plan.num_positions, -1) for lid in plan.geometry.moe_layer_ids])
    ids_LNK = ids_LNK.to(plan.ids_LNK.device, plan.ids_LNK.dtype)
    return replace(plan, ids_LNK=torch.where(plan.routed_N.view(1, -1, 1), ids_LNK, plan.ids_LNK))


def output_tensor(out) -> torch.Tensor:
    """A model output's logits, or its last hidden state for a model without an LM head."""
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def self_replay_gap(model: nn.Module, traces: Sequence[RolloutTrace],
                    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> float:
    """Largest |difference| between the model's own forward of `traces`' batch and a replay of the routes that
    same forward chose, both run inside `context()` (a trainer's autocast, say): 0.0 where replay is bit-identical
    in that precision mode, NaN where either output is not finite. Raises UnsupportedRouterError where no gate
    rule reproduces a router in that context."""
    from moe_replay.replay import build_plan

    plan = build_plan(list(traces), model_geometry(model)).to(_device(model))
    with torch.no_grad(), context(), capture_routes(model) as own:
        ref = output_tensor(model(**plan.model_inputs()))
    plan = with_own_routes(plan, own)
    with torch.no_grad(), context(), replay(model, plan) as session:
        out = output_tensor(model(**session.model_inputs()))
    mask_BS = plan.attention_mask_BS.bool()
    return (out[mask_BS].float() - ref[mask_BS].float()).abs().max().item()


def _checkpointing(model: nn.Module) -> bool:
    """Whether the model recomputes activations in backward: transformers >= 5.24 names it
    `is_activation_checkpointing` (`is_gradient_checkpointing` warns there), 5.19 the old name only."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))
