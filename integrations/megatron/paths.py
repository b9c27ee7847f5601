"""The preset switch `replay.trainer_path` on Megatron: which driver replays the routes.

  project          `replay.ReplaySession`: each router's own RouterReplay, addressed by its global
                   layer id, its action set per call; works with or without
                   `moe_enable_routing_replay` (lends a private instance), with several models in
                   one process, and with routers given alone.
  megatron_native  `native.NativeSession`: Megatron's process-global RouterReplay list and its
                   `set_replay_data` / `set_global_router_replay_action` (what verl's and NeMo-RL's
                   R3 call), each entry identified by its owner first.
  auto (default)   `megatron_native` where it can drive the model (`native.native_unavailable` is
                   None: every decoder router has a RouterReplay, the process-global list holds no
                   entry another model owns and misses none of this one's, the model or its chunks
                   are given), `project` otherwise.

The rule: both paths make Megatron gather its own scores at the replayed ids in the forward's own
precision, so each is exact on every config it accepts (tests/test_megatron_native.py: logits and
router gradients bit-identical, fp32 and bf16, recompute on and off, EP = 2); `auto` therefore picks
by where each applies, preferring the user's own native path. Settings neither can replay exactly
(fused top-k, sinkhorn, forced load balancing, token dropping, context parallelism, the flex
dispatcher, unknown routing) are refused by both, by name, before any forward.
"""

from __future__ import annotations

from typing import Callable, Sequence

from moe_replay.registry import Registry
from moe_replay.replay.plan import RoutePlan

from .native import NativeSession, native_unavailable
from .replay import ReplaySession
from .routers import ModelOrRouters

TRAINER_PATHS: Registry[Callable[..., ReplaySession]] = Registry("Megatron trainer path")
TRAINER_PATHS.add("project", ReplaySession)
TRAINER_PATHS.add("megatron_native", NativeSession)
AUTO = "auto"


def resolve_path(model_or_routers: ModelOrRouters, path: str = AUTO) -> tuple[str, str]:
    """(the path that will run, why): `path` itself, or what `auto` picks and the reason."""
    if path != AUTO:
        TRAINER_PATHS.get(path)  # RegistryError naming the supported paths
        return path, "asked for"
    reason = native_unavailable(model_or_routers)
    if reason is None:
        return "megatron_native", "auto: Megatron's process-global RouterReplay list holds exactly this model's routers"
    return "project", f"auto: megatron_native does not apply ({reason})"


def open_replay(model_or_routers: ModelOrRouters, plan: RoutePlan | Sequence[RoutePlan], *, path: str = AUTO,
                partial: bool = False, expect_recompute: bool | None = None) -> ReplaySession:
    """A replay session on the path `path` names (see the module docstring); `session.path` and
    `session.path_reason` say which ran and why. Other arguments as `replay.replay`."""
    if not isinstance(model_or_routers, (list, tuple)) and not hasattr(model_or_routers, "named_modules"):
        model_or_routers = list(model_or_routers)
    chosen, reason = resolve_path(model_or_routers, path)
    session = TRAINER_PATHS.get(chosen)(model_or_routers, plan, partial=partial, expect_recompute=expect_recompute)
    session.path_reason = reason
    return session
