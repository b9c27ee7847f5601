"""Replay recorded routes in a Megatron-core MoE model through Megatron's own `RouterReplay`: the project's path.

`with replay(model, plan):` drives each `TopKRouter`'s own `RouterReplay` instance, keyed by the
router's global layer id (no class is patched, Megatron's process-global list is not used). A router
built without `TransformerConfig.moe_enable_routing_replay` has none; the session lends it a private
one (out of the global list) and takes it back on exit, so this path does not need that setting.
On entry, before any forward, it checks every `TopKRouter` against the plan's geometry
(MoE layer ids = `layer_number - 1`, experts, top-k, layer count) and that its routing goes through
RouterReplay; then, router by router in global-layer order, it queues each micro-batch's ids
(converted to Megatron's sequence-first order, see `layout`) with `set_target_indices`. Under
sequence parallelism each TP rank's router sees its slice of the sequence, so each rank queues
the same slice of the ids (`routers.sequence_share`); the plan's padded length must divide by the
TP size (PlanConfig.pad_to_multiple_of). Multi-token-prediction routers are left out by
construction and named (`session.excluded`).

A forward pre-hook on each router picks the action per call:
  * a forward outside backward -> REPLAY_FORWARD with that micro-batch's ids;
  * a call inside backward (activation recompute: Megatron's `CheckpointFunction`, `recompute_granularity`
    "full" or selective "moe") -> REPLAY_BACKWARD, which pops the same ids from the router's queue.
So recompute needs no extra call: `loss.backward()` (or Megatron's schedule) inside the context
is enough. Megatron gathers probabilities from its own scores at the replayed ids (softmax before
or after top-k, sigmoid with the selection-only expert bias left out, top-k scaling), so the
router keeps its gradient (invariant 4). The hook also does the exactly-once accounting
(`RouteLedger`, invariant 6), keyed by layer id; a forward hook checks after every call that the
router consumed exactly its tensor (`check_consumed`: the routing map is the ids', a recompute popped
one), and a hook on each model chunk that each of its routers did so once per chunk forward. On
exit every router's RouterReplay state (action, targets, queue, recorded ids) is put back as it
was. A forward given packed sequences (`packed_seq_params`) is refused by name before any layer
runs (`_refuse_packed`). `native.NativeSession` drives the same instances through Megatron's
process-global API (`trainer_path: megatron_native`) with these same checks.

Legend: B batch rows, S padded length, M = S * B sequence-first positions, K top-k.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
from torch import nn

from moe_replay.collectives import collective_device
from moe_replay.errors import GeometryMismatchError, Where
from moe_replay.replay.errors import BatchLayoutError, RouteConsumptionError, UnsupportedRouterError
from moe_replay.replay.scoring import TokenScores, VocabShard
from moe_replay.replay.ledger import RouteLedger, in_backward
from moe_replay.replay.plan import RoutePlan

from .layout import sequence_first_ids
from .routers import (ModelOrRouters, RouterSite, check_geometry, check_replayable, find_routers, mtp_routers,
                      router_base_class, sequence_share)

_ACTIVE: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
"""Routers currently under a replay session (sessions do not nest)."""


def _actions(rr):
    """The RouterReplayAction enum that `rr`'s class compares against: the one defined beside it.
    verl's R3 patch (`verl.utils.megatron.router_replay_patch`) puts its own RouterReplay class, with
    its own RouterReplayAction, on every TopKRouter; given Megatron's enum instead, its
    `get_replay_topk` matches no action and routes freely (measured: 26 of 27 positions off the
    replayed ids, caught by `check_consumed`), so the action is always taken from `rr`'s module."""
    import sys

    actions = getattr(sys.modules.get(type(rr).__module__), "RouterReplayAction", None)
    if actions is None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction as actions  # lazy: megatron is optional
    return actions


def _recompute_configured(site: RouterSite) -> bool:
    cfg = site.module.config
    return cfg.recompute_granularity == "full" or (cfg.recompute_granularity == "selective" and "moe" in (cfg.recompute_modules or ()))


class ReplaySession:
    """A Megatron model under replay for one or more micro-batch plans. Use as a context manager.

    The project's path (`path` "project"): each router's own RouterReplay is driven per call, keyed by
    the router's global layer id. A router built without `moe_enable_routing_replay` is lent a private
    RouterReplay for the session (never put in Megatron's process-global list, taken back on exit), so
    this path does not depend on that setting. `NativeSession` (native.py) drives the same instances
    through Megatron's process-global API instead; both share the checks and the consumption guard."""

    path = "project"
    path_reason = "asked for"
    """Why this path runs (paths.open_replay: what `auto` decided)."""
    native = False
    """Whether Megatron's own RouterReplay instances are required (check_replayable's `native`)."""

    def __init__(
        self,
        model_or_routers: ModelOrRouters,
        plans: RoutePlan | Sequence[RoutePlan],
        *,
        partial: bool = False,
        expect_recompute: bool | None = None,
    ) -> None:
        if not isinstance(model_or_routers, nn.Module):
            model_or_routers = list(model_or_routers)  # walked twice: routers, then the forwards to watch
        self.plans: tuple[RoutePlan, ...] = (plans,) if isinstance(plans, RoutePlan) else tuple(plans)
        if not self.plans:
            raise ValueError("replay needs at least one RoutePlan, got 0")
        geometry = self.plans[0].geometry
        for m, plan in enumerate(self.plans[1:], 1):  # every field, family included
            geometry.check_matches(plan.geometry, Where(), f"micro-batch plans[0] vs plans[{m}] of one session")
            geometry = geometry.with_family_of(plan.geometry)
        self.sites = find_routers(model_or_routers)
        self.excluded: tuple[str, ...] = tuple(mtp_routers(model_or_routers))
        """Names of the multi-token-prediction routers left to route freely (traces hold decoder layers only)."""
        self.entries = _forward_entries(model_or_routers)
        self.chunks = _chunk_roots(model_or_routers)
        for site in self.sites.values():
            check_replayable(site, native=self.native)
        vocab = getattr(model_or_routers, "vocab_size", None) if isinstance(model_or_routers, nn.Module) else None
        check_geometry(self.sites, geometry, partial=partial, vocab_size=vocab)

        check_allgather_shapes(model_or_routers, self.plans)
        self.ledgers = [RouteLedger(plan) for plan in self.plans]
        if partial:  # a pipeline stage accounts for its own layers only
            for ledger in self.ledgers:
                ledger.forward_takes = {lid: 0 for lid in self.sites}
                ledger.recompute_takes = {lid: 0 for lid in self.sites}
        self.shares = {lid: sequence_share(site) for lid, site in self.sites.items()}
        for (ranks, _), plan in ((s, p) for s in set(self.shares.values()) for p in self.plans):
            if plan.seq_len % ranks:
                raise RouteConsumptionError(
                    f"sequence parallelism splits each sequence over {ranks} TP ranks, but the plan for requests "
                    f"{list(plan.keys[:4])} is {plan.seq_len} positions long; expected a multiple of {ranks} "
                    f"(PlanConfig(pad_to_multiple_of={ranks}))")
        self.ids_MK: list[dict[int, torch.Tensor]] = [
            {
                lid: _rank_slice(sequence_first_ids(
                    plan.layer_ids(lid), plan.routed_N, plan.batch_size, plan.seq_len, geometry.num_experts
                ), plan, *self.shares[lid]).to(site.module.weight.device)
                for lid, site in self.sites.items()
            }
            for plan in self.plans
        ]
        self.expect_recompute = expect_recompute
        self.forwards = {lid: 0 for lid in self.sites}
        self.recomputes = {lid: 0 for lid in self.sites}
        self.chunk_forwards = [0] * len(self.chunks)
        self._pending: dict[int, tuple[bool, int, int]] = {}
        self._maps: dict[tuple[int, int], torch.Tensor] = {}
        self._saved: dict[int, tuple] = {}
        self._lent: list[nn.Module] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def plan(self) -> RoutePlan:
        """The first (or only) micro-batch plan."""
        return self.plans[0]

    def _deliver(self, site: RouterSite, rr, m: int, recompute: bool) -> None:
        """Make router `site` replay micro-batch `m`'s ids on this call: the project's path sets the
        action (and the forward's target) itself; NativeSession checks what Megatron's API set."""
        ids_MK, actions = self.ids_MK[m][site.layer_id], _actions(rr)
        if recompute:
            if not rr.replay_backward_list or rr.replay_backward_list[0] is not ids_MK:
                raise RouteConsumptionError(
                    f"layer {site.layer_id}: recompute of micro-batch {m} but RouterReplay's backward queue of router "
                    f"{site.name!r} does not hold its ids next (queue length {len(rr.replay_backward_list)}); "
                    "was the queue changed outside this session?"
                )
            rr.set_router_replay_action(actions.REPLAY_BACKWARD)
        else:
            rr.target_topk_idx = ids_MK
            rr.set_router_replay_action(actions.REPLAY_FORWARD)

    def _hook(self, site: RouterSite):
        lid = site.layer_id

        def pre_hook(module: nn.Module, args, kwargs):
            hidden = args[0] if args else kwargs.get("input")
            recompute = in_backward()
            counter = self.recomputes if recompute else self.forwards
            m = counter[lid]
            what = "recompute" if recompute else "forward"
            if m >= len(self.plans):
                raise RouteConsumptionError(
                    f"layer {lid}: {what} #{m + 1} of router {site.name!r}, but the session holds {len(self.plans)} "
                    f"micro-batch plan(s) (requests {list(self.plans[-1].keys[:4])}...); one plan serves one forward "
                    "(plus its recompute): pass one plan per micro-batch, in schedule order"
                )
            plan = self.plans[m]
            ranks = self.shares[lid][0]
            if hidden is None or tuple(hidden.shape[:2]) != (plan.seq_len // ranks, plan.batch_size):
                found = None if hidden is None else list(hidden.shape)
                split = f" / {ranks} sequence-parallel ranks" if ranks > 1 else ""
                raise RouteConsumptionError(
                    f"layer {lid}: router {site.name!r} got hidden states {found} in micro-batch {m}; the plan for "
                    f"requests {list(plan.keys[:4])} expects [S{split}, B, H] = [{plan.seq_len // ranks}, "
                    f"{plan.batch_size}, H] (Megatron is sequence-first; feed plan.input_ids_BS, without sequence packing)"
                )
            self.ledgers[m].take(lid, plan.num_positions)
            rr = module.router_replay
            self._deliver(site, rr, m, recompute)
            self._pending[lid] = (recompute, m, len(rr.replay_backward_list))
            counter[lid] = m + 1

        def post_hook(module: nn.Module, args, output) -> None:
            recompute, m, queued = self._pending.pop(lid)
            check_consumed(site, module.router_replay, output[1], self._routed_map(m, lid), m, recompute, queued)

        return pre_hook, post_hook

    def _routed_map(self, m: int, lid: int) -> torch.Tensor:
        """The routing map [M, E] that micro-batch `m`'s ids give layer `lid` (made once)."""
        key = (m, lid)
        if key not in self._maps:
            ids_MK = self.ids_MK[m][lid]
            num_experts = self.plans[m].geometry.num_experts
            self._maps[key] = torch.zeros(ids_MK.shape[0], num_experts, dtype=torch.bool, device=ids_MK.device).scatter(1, ids_MK, True)
        return self._maps[key]

    def _chunk_hooks(self, c: int):
        """Around each forward of model chunk `c`: count it, and after it check that every router of
        the chunk consumed exactly its micro-batch's ids once (a router its forward skipped is an error
        there, not at the end of the session)."""
        mine = [lid for lid, site in self.sites.items() if site.chunk == c]

        def pre_hook(module: nn.Module, args, kwargs) -> None:
            if not in_backward():
                self._chunk_forward_starts(c, self.chunk_forwards[c], mine)
                self.chunk_forwards[c] += 1

        def post_hook(module: nn.Module, args, kwargs, output) -> None:
            if in_backward():
                return
            m = self.chunk_forwards[c]
            skipped = [self.sites[lid].name for lid in mine if self.forwards[lid] != m]
            if skipped:
                raise RouteConsumptionError(
                    f"forward #{m} of model chunk {c} ended, but routers {skipped[:4]} did not replay micro-batch "
                    f"{m - 1}'s routes exactly once in it (forwards per layer: "
                    f"{ {lid: self.forwards[lid] for lid in mine} }); was a layer skipped or run outside the chunk?")
            self._chunk_forward_ends(c, mine)

        return pre_hook, post_hook

    def _chunk_forward_starts(self, c: int, m: int, lids: list[int]) -> None:
        """Before forward `m` of chunk `c`: nothing on the project's path (its router hooks set all)."""

    def _chunk_forward_ends(self, c: int, lids: list[int]) -> None:
        """After a chunk's forward: nothing on the project's path."""

    def _prepare(self, lid: int, rr) -> None:
        """At entry, after the router's state was saved: queue every micro-batch's ids (REPLAY_BACKWARD
        pops them first in, first out) and set the first forward's."""
        rr.clear_indices()
        for ids_by_layer in self.ids_MK:  # micro-batches in schedule order
            rr.set_target_indices(ids_by_layer[lid])
        rr.set_router_replay_action(_actions(rr).REPLAY_FORWARD)
        rr.target_topk_idx = self.ids_MK[0][lid]

    def __enter__(self) -> "ReplaySession":
        busy = [s.name for s in self.sites.values() if s.module in _ACTIVE]
        if busy:
            raise RouteConsumptionError(f"routers {busy[:4]} are already under a replay session; sessions do not nest")
        if self.expect_recompute is None:
            self.expect_recompute = torch.is_grad_enabled() and any(
                _recompute_configured(s) and s.module.training for s in self.sites.values()
            )
        try:
            for entry in self.entries:  # refused before anything is delivered
                self._handles.append(entry.register_forward_pre_hook(_refuse_packed, with_kwargs=True))
            for lid, site in self.sites.items():  # global-layer order, never creation order
                _ACTIVE.add(site.module)
                if site.module.router_replay is None:  # the project's path lends one (never in Megatron's list)
                    site.module.router_replay = _private_router_replay()
                    self._lent.append(site.module)
                rr = site.module.router_replay
                self._saved[lid] = (rr.router_replay_action, rr.target_topk_idx, rr.recorded_topk_idx, list(rr.replay_backward_list))
                self._prepare(lid, rr)
                pre, post = self._hook(site)
                self._handles.append(site.module.register_forward_pre_hook(pre, with_kwargs=True))
                self._handles.append(site.module.register_forward_hook(post))
            for c, chunk in enumerate(self.chunks):
                pre, post = self._chunk_hooks(c)
                self._handles.append(chunk.register_forward_pre_hook(pre, with_kwargs=True))
                self._handles.append(chunk.register_forward_hook(post, with_kwargs=True))
        except BaseException:
            self._restore()
            raise
        return self

    def _restore(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for lid, (action, target, recorded, queue) in self._saved.items():
            rr = self.sites[lid].module.router_replay
            rr.router_replay_action, rr.target_topk_idx, rr.recorded_topk_idx = action, target, recorded
            rr.replay_backward_list = queue
        self._saved.clear()
        for module in self._lent:
            module.router_replay = None
        self._lent.clear()
        for site in self.sites.values():
            _ACTIVE.discard(site.module)

    def __exit__(self, exc_type, exc, tb) -> None:
        self._restore()
        if exc_type is None:
            for ledger in self.ledgers:
                ledger.finish(expect_recompute=bool(self.expect_recompute))


def check_consumed(site: RouterSite, rr, map_ME: torch.Tensor, want_ME: torch.Tensor, m: int, recompute: bool,
                   queued: int) -> None:
    """After one router call: its RouterReplay consumed exactly micro-batch `m`'s ids. A recompute pops
    exactly one tensor from the FIFO, a forward none, and the routing map is the ids' own: a call
    that routed freely (a silent no-op replay: an action or target not set, verl #7340; a fused or
    patched routing that never asked RouterReplay) is an error naming the router, not a quiet
    off-policy forward. One [M, E] comparison per call."""
    what = "recompute" if recompute else "forward"
    popped = queued - len(rr.replay_backward_list)
    if popped != int(recompute):
        raise RouteConsumptionError(
            f"layer {site.layer_id}: {what} of micro-batch {m}: router {site.name!r}'s RouterReplay took {popped} "
            f"tensors from its recompute queue, expected {int(recompute)}; was its action changed during the call?")
    if map_ME.shape != want_ME.shape or not torch.equal(map_ME, want_ME):
        moved = int((map_ME != want_ME).any(-1).sum()) if map_ME.shape == want_ME.shape else None
        raise RouteConsumptionError(
            f"layer {site.layer_id}: {what} of micro-batch {m}: router {site.name!r} routed "
            f"{'a map of shape ' + str(list(map_ME.shape)) if moved is None else f'{moved} of {want_ME.shape[0]} positions'} "
            f"other than the replayed ids (expected {list(want_ME.shape)}, exactly its RouterReplay's tensor): "
            "its replay was a no-op (RouterReplay not consulted, or its action / target not set)")


def _private_router_replay():
    """A RouterReplay that only its router holds: Megatron's constructor appends every instance to
    the process-global list (set_replay_data's addressing), so it is taken out again at once."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    rr = RouterReplay()
    registry = RouterReplay.global_router_replay_instances
    for i in range(len(registry) - 1, -1, -1):
        if registry[i] is rr:
            del registry[i]
            break
    return rr


def _chunk_roots(model_or_routers: ModelOrRouters) -> list[nn.Module]:
    """The model chunks whose forwards the session watches (none when routers are given alone)."""
    roots = [model_or_routers] if isinstance(model_or_routers, nn.Module) else list(model_or_routers)
    router = router_base_class()
    return [r for r in roots if not isinstance(r, router)]


def _forward_entries(model_or_routers: ModelOrRouters) -> list[nn.Module]:
    """Where a forward's keyword arguments are seen before any layer runs: each model root (a
    GPTModel, a chunk, or a wrapper around one) and each TransformerBlock under it (GPTModel hands
    it `packed_seq_params` by keyword whatever wraps the model). Routers given alone have none."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    entries = _chunk_roots(model_or_routers)
    entries += [m for r in entries for m in r.modules() if isinstance(m, TransformerBlock) and m is not r]
    return entries


def _refuse_packed(module: nn.Module, args, kwargs) -> None:
    """Packed sequences (PackedSeqParams, THD: every sequence of the micro-batch back to back in one
    [T, 1, H] row) do not line up with a plan's padded [S, B] routes: refused by name before the
    forward, not at the first router (where the hidden states would be [T, 1, H] instead of
    [S, B, H]) nor inside attention (Megatron-core's non-TE DotProductAttention asserts
    packed_seq_params is None)."""
    packed = kwargs.get("packed_seq_params")
    if packed is None:
        return
    cu_seqlens = getattr(packed, "cu_seqlens_q", None)
    count = f", {len(cu_seqlens) - 1} sequences" if cu_seqlens is not None else ""
    raise BatchLayoutError(
        Where(field="packed_seq_params"),
        "None: a padded [S, B] batch, one request per row, as megatron_inputs(plan) gives",
        f"PackedSeqParams(qkv_format={getattr(packed, 'qkv_format', None)!r}{count}) passed to {type(module).__name__}",
        "replay lays each plan's routes out per padded row (sequence-first [S * B, K]); packed sequences are not supported",
    )


def check_allgather_shapes(model_or_chunks: ModelOrRouters, plans: Sequence[RoutePlan]) -> None:
    """Megatron's allgather dispatcher gathers every rank's [S, B] tokens over the tensor x expert
    parallel group and assumes equal shapes; unequal ones abort the process inside gloo ("Received
    data size doesn't match") or hang NCCL. Before any forward, every rank of that group shares its
    micro-batch shapes (one all_gather of 2 ints per plan, once per session) and all refuse by name
    if they differ. `model_or_chunks`: a model or its virtual-pipeline chunks (Megatron-LM's
    `get_model` returns that list; every chunk's dispatchers share the group). The tensors go on the
    device the group serves (`collective_device`: CUDA under NCCL, CPU under gloo). A no-op without
    such a dispatcher, with a group of one rank, or given routers alone (a router holds no dispatcher)."""
    roots = [model_or_chunks] if isinstance(model_or_chunks, nn.Module) else list(model_or_chunks)
    dispatcher = next((m.token_dispatcher for root in roots for m in root.modules()
                       if type(getattr(m, "token_dispatcher", None)).__name__ == "MoEAllGatherTokenDispatcher"), None)
    if dispatcher is None:
        return
    group = dispatcher.tp_ep_group
    ranks = group.size() if group is not None else 1
    if ranks <= 1:
        return
    device = collective_device(group)
    mine = torch.tensor([[p.seq_len, p.batch_size] for p in plans], dtype=torch.int64, device=device)
    counts = torch.tensor([len(plans)], dtype=torch.int64, device=device)
    all_counts = [torch.empty_like(counts) for _ in range(ranks)]
    torch.distributed.all_gather(all_counts, counts, group=group)
    if len({int(c) for c in all_counts}) == 1:
        shapes = [torch.empty_like(mine) for _ in range(ranks)]
        torch.distributed.all_gather(shapes, mine, group=group)
        if all(torch.equal(s, shapes[0]) for s in shapes):
            return
        found = [s.tolist() for s in shapes]
    else:
        found = [f"{int(c)} micro-batches" for c in all_counts]
    raise UnsupportedRouterError(
        f"moe_token_dispatcher_type='allgather' over {ranks} tensor x expert parallel ranks: expected every rank's "
        f"micro-batches to have one [S, B] shape (Megatron gathers them as equal), found per rank {found}; pad "
        "every rank's micro-batches to one shape (build_plan with the same batch size and PlanConfig.pad_to_multiple_of)")


def _rank_slice(ids_MK: torch.Tensor, plan: RoutePlan, ranks: int, rank: int) -> torch.Tensor:
    """The rows of sequence-first ids [S * B, K] whose positions this sequence-parallel rank holds."""
    if ranks == 1:
        return ids_MK
    rows = plan.seq_len // ranks * plan.batch_size
    return ids_MK[rank * rows:(rank + 1) * rows]


def replay(
    model_or_routers: ModelOrRouters,
    plan: RoutePlan | Sequence[RoutePlan],
    *,
    partial: bool = False,
    expect_recompute: bool | None = None,
) -> ReplaySession:
    """Context manager: inside it, every Megatron TopKRouter routes with the plan's recorded experts.

    `model_or_routers`: a Megatron model (e.g. GPTModel), its virtual-pipeline chunks, or routers.
    `plan`: one RoutePlan, or one per micro-batch in schedule order (each serves one forward and
    one activation recompute). `partial=True` on a pipeline stage that holds only some MoE layers.
    With recompute configured (and training with grad), backward must run inside the context.
    Requires `moe_enable_routing_replay=True`; checks run on creation, before any forward.

        plan = build_plan(traces, model_geometry(model, family="qwen3_moe"))
        with replay(model, plan):
            logits_BSV = model(**megatron_inputs(plan))          # vocab-parallel with TP > 1
            logp_G = score_tokens(logits_BSV, plan).logprobs_G   # normalised across TP ranks
            loss = ...
            loss.backward()
    """
    return ReplaySession(model_or_routers, plan, partial=partial, expect_recompute=expect_recompute)


def score_tokens(
    logits_BSV: torch.Tensor,
    plan: RoutePlan,
    *,
    temperature: float | torch.Tensor | None = None,
    use_support: bool = True,
    full: bool = False,
) -> TokenScores:
    """Score the plan's generated tokens from a Megatron GPTModel's logits [B, S, V or V / TP].

    With `parallel_output=True` (Megatron's default) each tensor-parallel rank holds V / TP
    vocabulary columns (rank r: [r * V/TP, (r + 1) * V/TP)); the log-sum-exps and entropies are then
    all-reduced over the tensor-parallel group, so every rank gets the scores of the whole
    vocabulary (renormalised over the kept set), like Megatron's own vocab_parallel_cross_entropy.
    Gathered logits (width V) are scored locally. Every tensor-parallel rank must call this with
    the same plan. Other arguments as `moe_replay.replay.score_tokens`.
    """
    from moe_replay.replay.support import score_tokens as score_core

    vocab, width = plan.geometry.vocab_size, logits_BSV.shape[-1]
    if width == vocab:
        return score_core(logits_BSV, plan, temperature=temperature, use_support=use_support, full=full)
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    if width * tp != vocab:
        raise GeometryMismatchError(
            Where(field="logits.shape[-1]"), f"{vocab} (gathered) or {vocab} / TP columns (tensor-parallel size {tp})", width,
            "logits vs the plan's vocab_size; pass the model's padded vocab size to model_geometry",
        )
    shard = VocabShard(parallel_state.get_tensor_model_parallel_rank() * width, vocab,
                       parallel_state.get_tensor_model_parallel_group())
    return score_core(logits_BSV, plan, temperature=temperature, use_support=use_support, full=full, shard=shard)
