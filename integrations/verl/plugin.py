"""verl's `model.external_lib` target: importing it registers moe_replay's FSDP engine (see registry.py).

    actor_rollout_ref.model.external_lib=moe_replay.integrations.verl.plugin

On a machine without an accelerator set MOE_REPLAY_VERL_CPU=1 as well: verl then runs on the CPU
platform of cpu.py (tests, examples).
"""

from __future__ import annotations

from ...extras import require

require("verl", "the verl plugin (actor_rollout_ref.model.external_lib=moe_replay.integrations.verl.plugin)")
from .cpu import use_cpu_if_asked  # noqa: E402
from .registry import install  # noqa: E402

use_cpu_if_asked()
install()
