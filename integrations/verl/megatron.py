"""The project's traces as verl's Megatron actor reads routes: `routed_experts` for verl's own R3.

verl 0.9.1's Megatron engine (`actor.strategy=megatron`, `actor.megatron.router_replay.mode=R3`)
replays `routed_experts` from the batch through its own helpers
(`verl.utils.megatron.router_replay_utils`): `align_r3_router_replay_data` takes one [T_b - 1, L, K]
route tensor per sample (the rollout has no route for the last sampled token: invariant 1) as a
jagged nested tensor and pads it to T_b; `build_r3_replay_mask` leaves that final row to the
router; `set_router_replay_data` packs the routes the way it packs the tokens (THD) and hands each
forwarded router its layer's rows (by `layer_number`: the layer axis is the MoE layers in order,
or every decoder layer). `routed_experts(traces)` builds exactly that tensor from the project's
traces (its store, stitched multi-turn records), so verl's own R3 runs on them;
`routed_experts_BSLK(plan)` is the padded form its non-nested path takes, laid out as a RoutePlan
pads the batch. A trace without the routes of every position before its last (a prefix-cache
hit whose routes were not stored: `route_start` > 0) is refused by name: verl would need rows it
does not have.

What moe_replay's verl engine does on FSDP2 (scores over the kept set in verl's loss, its guards)
is not wired into verl's Megatron engine: `megatron_engine(base)` is the class `registry.install`
puts under verl's "megatron" backend, verl's own engine unchanged unless the model config names a
moe_replay preset, which it refuses by name before building anything (verl's Megatron engine would
otherwise ignore the preset and train on free routes).

Legend: B samples, S padded length, T_b sample b's tokens, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...errors import Where
from ...replay import BatchLayoutError
from ...replay.plan import RoutePlan
from ...trace import RolloutTrace

ROUTE_DTYPE = torch.int16
"""What verl records routes in (`merge_router_topk_indices`); its replay widens them to int64."""


def routed_experts(traces: Sequence[RolloutTrace]) -> torch.Tensor:
    """verl's R3 `routed_experts`: a jagged nested tensor of one [T_b - 1, L, K] int16 tensor per trace."""
    parts = []
    for b, trace in enumerate(traces):
        where = Where(record=trace.key, field="routes_TLK")
        if trace.routes_TLK is None:
            raise BatchLayoutError(where, "the routes of every MoE layer", None, f"trace {b} was captured without routes")
        if trace.route_start != 0:
            raise BatchLayoutError(where.with_(field="route_start"), 0, trace.route_start,
                                   "verl's R3 replays every position before the last; this trace has no routes for its "
                                   f"first {trace.route_start} (a prefix-cache hit stored without them)")
        if trace.geometry.num_experts > torch.iinfo(ROUTE_DTYPE).max:
            raise BatchLayoutError(where, f"expert ids below {torch.iinfo(ROUTE_DTYPE).max}", trace.geometry.num_experts)
        parts.append(torch.from_numpy(trace.routes_TLK.astype("int16", copy=False)))
    return torch.nested.as_nested_tensor(parts, layout=torch.jagged)


def routed_experts_BSLK(plan: RoutePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(routes [B, S, L, K] int16, attention_mask [B, S] bool) of a plan's padded batch, for verl's
    non-nested `set_router_replay_data`; positions the plan leaves unrouted (each sequence's last
    token, padding) get Megatron replay's fill ids (`megatron.layout.fill_ids_MK`), the same ones
    moe_replay's own Megatron replay gives them."""
    from ..megatron.layout import sequence_first_ids

    b, s, k, e = plan.batch_size, plan.seq_len, plan.geometry.top_k, plan.geometry.num_experts
    layers = [sequence_first_ids(plan.layer_ids(lid), plan.routed_N, b, s, e).view(s, b, k).transpose(0, 1)
              for lid in plan.geometry.moe_layer_ids]
    return torch.stack(layers, 2).to(ROUTE_DTYPE), plan.attention_mask_BS.bool()


def packed_ids(plan: RoutePlan, layer_id: int) -> torch.Tensor:
    """One layer's ids [T, K] int64 in verl's packed (THD) order at TP = CP = 1: each sample's real
    tokens, sample after sample; what verl's `set_router_replay_data` hands that layer's router."""
    routes_BSLK, mask_BS = routed_experts_BSLK(plan)
    return routes_BSLK[:, :, plan.geometry.moe_layer_ids.index(layer_id)][mask_BS].to(torch.int64)


def megatron_engine(base: type) -> type:
    """verl's Megatron language-model engine `base`, refusing a moe_replay preset by name (VerlOptionError)."""
    from .engine import PRESET_KEY, preset_of
    from .options import VerlOptionError

    class MoeReplayMegatronEngine(base):
        __doc__ = f"verl's {base.__name__}; a model config naming a moe_replay preset is refused before anything is built."

        def __init__(self, model_config, *args, **kwargs) -> None:
            preset = preset_of(model_config)
            if preset is not None:
                raise VerlOptionError(
                    "actor_rollout_ref.actor.strategy", "megatron", "fsdp2 with "
                    f"+actor_rollout_ref.model.override_config.{PRESET_KEY}={preset.name}",
                    "moe_replay's verl engine (routes, kept-set scoring, guards) is the FSDP2 one; verl's Megatron engine "
                    "would ignore the preset and route freely. On Megatron, drop the preset and run verl's own R3 "
                    "(actor_rollout_ref.actor.megatron.router_replay.mode=R3) on the traces' routes: "
                    "moe_replay.integrations.verl.megatron.routed_experts (docs/megatron.md)")
            super().__init__(model_config, *args, **kwargs)

    MoeReplayMegatronEngine.__qualname__ = MoeReplayMegatronEngine.__name__ = f"MoeReplay{base.__name__}"
    return MoeReplayMegatronEngine
