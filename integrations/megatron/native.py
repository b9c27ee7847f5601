"""`trainer_path: megatron_native`: the plan's routes through Megatron's own process-global RouterReplay API.

This is how verl's and NeMo-RL's R3 drive Megatron-core (>= 0.16, `moe_enable_routing_replay`):
every `TopKRouter` appends its `RouterReplay` to one process-global list as it is built, and the
caller hands `RouterReplay.set_replay_data([...])` one [num_tokens, topk] tensor per entry, in that
list's order, then switches every entry with `set_global_router_replay_action(REPLAY_FORWARD)` for
the forward and `REPLAY_BACKWARD` before the backward (whose activation recompute pops a FIFO). The
list is positional, so a wrong entry gets another layer's routes silently; `NativeSession` maps
it before any forward:

  * every entry is identified by the router that owns it (`registry_layout`): this process's
    decoder routers (PP stage, VPP chunks) by global layer id, multi-token-prediction routers by
    name (excluded: they keep their own routing, never a decoder layer's routes, Megatron #7404 /
    NeMo-RL #3903). An entry no router of the model owns (another model in the process, a decoder
    that was rebuilt and discarded) or a router missing from the list is refused by name;
  * at each forward of a model chunk (a hook on the chunk): the chunk's micro-batch ids go in
    with `set_replay_data` when the list is exactly this one chunk's decoder routers, and with the
    same per-entry `set_target_indices` for that chunk's entries otherwise (VPP chunks: the global
    call would queue every chunk's ids at once, while each chunk runs its micro-batches at its own
    time; what verl does per chunk); then the action is REPLAY_FORWARD, through
    `set_global_router_replay_action` unless the list holds excluded MTP entries (then per entry);
    after the chunk's forward, REPLAY_BACKWARD the same way;
  * every router call is checked against what was delivered: before it, the action and the target
    (or the FIFO head, in recompute) are this micro-batch's; after it, the routing map is the ids'
    and a recompute popped exactly one tensor (`replay.check_consumed`); after each chunk forward,
    every router of the chunk did so once. A silent no-op replay (verl #7340) is an error.

Everything the project's path checks (replay.ReplaySession: geometry, refused router settings,
packed sequences, SP slices, the allgather shape check, the exactly-once ledger) applies unchanged:
the two paths differ only in how the instances are addressed and switched, and both make Megatron
gather its own scores at the replayed ids, so their logits and gradients are bit-identical
(tests/test_megatron_native.py).

Legend: M = S * B sequence-first positions, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from torch import nn

from moe_replay.replay.errors import RouteConsumptionError, UnsupportedRouterError
from moe_replay.replay.plan import RoutePlan

from .replay import ReplaySession, _actions
from .routers import ModelOrRouters, RouterSite, find_routers, mtp_routers, router_base_class

REGISTRY_ATTRS = ("global_router_replay_instances", "router_instances")
"""Where a RouterReplay class keeps its process-global list: Megatron-core's name, and verl 0.9.1's
(`verl.utils.megatron.router_replay_patch.RouterReplay`, which verl's R3 patch puts on every
TopKRouter it builds)."""


@dataclass
class RegistryLayout:
    """Megatron's process-global RouterReplay list, each entry identified by the router that owns it."""

    cls: type
    """The RouterReplay class whose list it is (Megatron's, or verl's)."""
    attr: str
    instances: list
    """The class's own list object (read by position, never copied)."""
    layer_at: dict[int, int]
    """List position -> global layer id of the decoder router owning that entry."""
    excluded: dict[int, str] = field(default_factory=dict)
    """List position -> name of the multi-token-prediction router owning it (left alone)."""

    @property
    def where(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__name__}.{self.attr}"


def registry_layout(sites: dict[int, RouterSite], mtp: dict[str, nn.Module]) -> RegistryLayout:
    """Identify every entry of the process-global list these routers' RouterReplay instances are in.
    Refuses (UnsupportedRouterError) routers without a RouterReplay, instances of several classes,
    entries that no router of the model owns, and routers whose instance is not in the list."""
    missing = [s.name for s in sites.values() if s.module.router_replay is None]
    if missing:
        raise UnsupportedRouterError(
            f"trainer_path 'megatron_native': routers {missing[:4]} have no RouterReplay "
            "(TransformerConfig.moe_enable_routing_replay=False); set it True, or use trainer_path 'project'")
    classes = {type(s.module.router_replay) for s in sites.values()}
    if len(classes) != 1:
        raise UnsupportedRouterError(
            f"trainer_path 'megatron_native': the routers' RouterReplay instances are of {len(classes)} classes "
            f"({sorted(f'{c.__module__}.{c.__name__}' for c in classes)}); one process-global list is expected")
    (cls,) = classes
    attr = next((a for a in REGISTRY_ATTRS if isinstance(getattr(cls, a, None), list)), None)
    if attr is None or not hasattr(cls, "set_replay_data"):
        raise UnsupportedRouterError(
            f"trainer_path 'megatron_native': {cls.__module__}.{cls.__name__} has no process-global list "
            f"({' or '.join(REGISTRY_ATTRS)}) and set_replay_data; use trainer_path 'project'")
    instances = getattr(cls, attr)
    owner = {id(s.module.router_replay): lid for lid, s in sites.items()}
    mtp_owner = {id(m.router_replay): name for name, m in mtp.items() if getattr(m, "router_replay", None) is not None}
    layer_at, excluded, foreign = {}, {}, []
    for pos, inst in enumerate(instances):
        if id(inst) in owner:
            layer_at[pos] = owner[id(inst)]
        elif id(inst) in mtp_owner:
            excluded[pos] = mtp_owner[id(inst)]
        else:
            foreign.append(pos)
    layout = RegistryLayout(cls, attr, instances, layer_at, excluded)
    if foreign:
        raise UnsupportedRouterError(
            f"trainer_path 'megatron_native': {layout.where} holds {len(instances)} RouterReplay instances, "
            f"{len(foreign)} of them (positions {foreign[:8]}) owned by no router of this model; set_replay_data "
            f"addresses the list by position, so another model's (or a discarded decoder's) routers would take "
            f"these routes. Expected exactly this process's {len(sites)} decoder routers"
            f"{f' and {len(mtp_owner)} MTP routers' if mtp_owner else ''}: build one Megatron model per process "
            f"after {layout.cls.__name__}.clear_global_router_replay_instances(), or use trainer_path 'project' "
            "(addresses each router by its layer id)")
    unlisted = [sites[lid].name for lid in sites if lid not in layer_at.values()]
    if unlisted:
        raise UnsupportedRouterError(
            f"trainer_path 'megatron_native': the RouterReplay of routers {unlisted[:4]} is not in {layout.where} "
            f"({len(instances)} entries), so set_replay_data cannot reach it; was the list cleared after the model "
            "was built? Use trainer_path 'project'")
    return layout


def native_unavailable(model_or_chunks: ModelOrRouters) -> str | None:
    """Why `megatron_native` cannot drive this model (None: it can). What `auto` decides with;
    settings both paths refuse are not reasons here (the session raises them)."""
    roots = [model_or_chunks] if isinstance(model_or_chunks, nn.Module) else list(model_or_chunks)
    if any(isinstance(r, router_base_class()) for r in roots):
        return "routers given alone (the native path hooks the model's or its chunks' forwards)"
    try:
        registry_layout(find_routers(model_or_chunks), mtp_routers(model_or_chunks))
    except UnsupportedRouterError as e:
        return str(e)
    return None


class NativeSession(ReplaySession):
    """A Megatron model (or its VPP chunks) under replay through Megatron's process-global
    RouterReplay API. Same arguments and attributes as ReplaySession, plus `layout`."""

    path = "megatron_native"
    native = True

    def __init__(self, model_or_chunks: Any, plans: RoutePlan | Sequence[RoutePlan], *, partial: bool = False,
                 expect_recompute: bool | None = None) -> None:
        super().__init__(model_or_chunks, plans, partial=partial, expect_recompute=expect_recompute)
        if not self.chunks:
            raise UnsupportedRouterError("trainer_path 'megatron_native': routers given alone (the native path hooks "
                                         "the model's or its chunks' forwards); pass the model or its chunks")
        self.layout = registry_layout(self.sites, mtp_routers(self.chunks))
        self._whole = not self.layout.excluded and len(self.chunks) == 1
        """The list is exactly one chunk's decoder routers: `set_replay_data` serves it verbatim."""

    def _prepare(self, lid: int, rr) -> None:
        """At entry: nothing queued, no action (the chunk hooks deliver each micro-batch's ids)."""
        rr.clear_indices()
        rr.clear_router_replay_action()

    def _chunk_forward_starts(self, c: int, m: int, lids: list[int]) -> None:
        if m >= len(self.plans):
            raise RouteConsumptionError(
                f"forward #{m + 1} of model chunk {c}, but the session holds {len(self.plans)} micro-batch plan(s); "
                "pass one plan per micro-batch, in schedule order")
        ids = self.ids_MK[m]
        layout = self.layout
        if self._whole:  # Megatron's own call, one tensor per list entry in build order
            layout.cls.set_replay_data([ids[layout.layer_at[pos]] for pos in range(len(layout.instances))])
        else:  # this chunk's entries only (set_replay_data's body, per entry)
            mine = set(lids)
            for pos, lid in layout.layer_at.items():
                if lid in mine:
                    layout.instances[pos].set_target_indices(ids[lid])
        self._set_action("REPLAY_FORWARD")

    def _chunk_forward_ends(self, c: int, lids: list[int]) -> None:
        self._set_action("REPLAY_BACKWARD")

    def _set_action(self, name: str) -> None:
        action = getattr(_actions(self.layout.instances[next(iter(self.layout.layer_at))]), name)
        if not self.layout.excluded:
            self.layout.cls.set_global_router_replay_action(action)
        else:  # MTP entries keep theirs
            for pos in self.layout.layer_at:
                self.layout.instances[pos].set_router_replay_action(action)

    def _deliver(self, site: RouterSite, rr, m: int, recompute: bool) -> None:
        """Check, before the call, what Megatron's API set: the action, and the forward's target or
        the recompute FIFO's head, are micro-batch `m`'s."""
        actions, ids_MK = _actions(rr), self.ids_MK[m][site.layer_id]
        want = actions.REPLAY_BACKWARD if recompute else actions.REPLAY_FORWARD
        what = "recompute" if recompute else "forward"
        if rr.router_replay_action != want:
            raise RouteConsumptionError(
                f"layer {site.layer_id}: {what} of micro-batch {m}: router {site.name!r}'s RouterReplay action is "
                f"{rr.router_replay_action}, expected {want} (set at each forward of its model chunk); did the router "
                "run outside a forward of the model given to replay, or was the action changed?")
        held = (rr.replay_backward_list[0] if rr.replay_backward_list else None) if recompute else rr.target_topk_idx
        if held is not ids_MK:
            place = "recompute queue's head" if recompute else "target"
            raise RouteConsumptionError(
                f"layer {site.layer_id}: {what} of micro-batch {m}: router {site.name!r}'s RouterReplay {place} is not "
                f"this micro-batch's ids (queue length {len(rr.replay_backward_list)}); was it set outside this session?")
