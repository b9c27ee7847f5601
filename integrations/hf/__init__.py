"""moe_replay hf adapter: replay recorded routes in HF transformers MoE models.

    from moe_replay.integrations.hf import replay, model_geometry
    from moe_replay.replay import build_plan, score_tokens
"""

from .replay import FlipStats, ReplayedRoutes, ReplaySession, capture_routes, model_geometry, replay, self_routed_trace
from .routers import ROUTER_ADAPTERS, RouterAdapter, RouterSite, adapter_for, find_routers, register_router

__all__ = [
    "ROUTER_ADAPTERS",
    "FlipStats",
    "ReplaySession",
    "ReplayedRoutes",
    "RouterAdapter",
    "RouterSite",
    "adapter_for",
    "capture_routes",
    "find_routers",
    "model_geometry",
    "register_router",
    "replay",
    "self_routed_trace",
]
