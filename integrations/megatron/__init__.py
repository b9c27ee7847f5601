"""moe_replay megatron adapter: replay recorded routes through Megatron-core's `RouterReplay`.

    from moe_replay.integrations.megatron import model_geometry, replay
    from moe_replay.replay import build_plan

Importing this package does not import megatron; the first call does.
"""

from .layout import fill_ids_MK, megatron_inputs, sequence_first_ids
from .replay import ReplaySession, replay, score_tokens
from .routers import RouterSite, check_geometry, check_replayable, find_routers, model_geometry

__all__ = [
    "ReplaySession",
    "RouterSite",
    "check_geometry",
    "check_replayable",
    "fill_ids_MK",
    "find_routers",
    "megatron_inputs",
    "model_geometry",
    "replay",
    "score_tokens",
    "sequence_first_ids",
]
