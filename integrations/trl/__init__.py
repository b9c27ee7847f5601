"""TRL adapter: moe_replay in TRL's `GRPOTrainer`, switched on with a preset.

    from moe_replay.integrations.trl import MoeReplayGRPOTrainer
    trainer = MoeReplayGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(use_vllm=True, ...),
                                   train_dataset=..., moe_replay="r3_support")

Importing this package does not import TRL; TRL (and vLLM) are imported when the trainer is used.
"""

from __future__ import annotations

from .options import TrlOptionError, check_options

__all__ = ["MoeReplayGRPOTrainer", "TrlOptionError", "check_options"]


def __getattr__(name: str):
    if name == "MoeReplayGRPOTrainer":
        from .trainer import MoeReplayGRPOTrainer

        return MoeReplayGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
