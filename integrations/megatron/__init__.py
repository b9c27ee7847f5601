"""moe_replay megatron adapter: replay recorded routes through Megatron-core's `RouterReplay`.

    from moe_replay.integrations.megatron import model_geometry, open_replay, replay
    from moe_replay.replay import build_plan

`replay` is the project's path; `open_replay(model, plan, path=...)` picks it or `megatron_native`
(Megatron's process-global RouterReplay API) by the preset switch `replay.trainer_path` (paths.py).

Importing this package does not import megatron; the first call does.
"""

from .layout import fill_ids_MK, megatron_inputs, sequence_first_ids
from .native import NativeSession, registry_layout
from .paths import TRAINER_PATHS, open_replay, resolve_path
from .replay import ReplaySession, check_consumed, replay, score_tokens
from .routers import RouterSite, check_geometry, check_replayable, find_routers, model_geometry, mtp_routers

__all__ = [
    "NativeSession",
    "ReplaySession",
    "RouterSite",
    "TRAINER_PATHS",
    "check_consumed",
    "check_geometry",
    "check_replayable",
    "fill_ids_MK",
    "find_routers",
    "megatron_inputs",
    "model_geometry",
    "mtp_routers",
    "open_replay",
    "registry_layout",
    "replay",
    "resolve_path",
    "score_tokens",
    "sequence_first_ids",
]
