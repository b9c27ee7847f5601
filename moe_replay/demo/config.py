"""Settings of the end-to-end GRPO demo (one dataclass, validated on construction)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_ARMS: dict[str, str] = {
    "none": "none",
    "r3_support": "r3_support",
    "r3_support_multisample": "r3_support_multisample",
}
"""Arm name -> preset name (configs/*.yaml)."""


@dataclass(frozen=True)
class DemoConfig:
    family: str = "qwen3_moe"
    """Tiny model family built by moe_replay.models (the embedded default)."""
    seed: int = 0
    steps: int = 16
    """GRPO steps per arm."""
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    """GRPO group size (n samples of each prompt)."""
    max_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 0.9
    lr: float = 1e-3
    clip_eps: float = 0.2
    engine_dtype: str = "bfloat16"
    """The rollout engine's precision: bf16 against an fp32 trainer is the mismatch to remove."""
    trainer_dtype: str = "float32"
    estimator_n: int | None = None
    """Override the multi-sample preset's n (None keeps the preset's)."""
    arms: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_ARMS))
    max_operand: int = 9

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "samples_per_prompt", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"DemoConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.samples_per_prompt < 2:
            raise ValueError(f"DemoConfig.samples_per_prompt must be >= 2 (GRPO compares within a group), got {self.samples_per_prompt}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"DemoConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.temperature <= 0:
            raise ValueError(f"DemoConfig.temperature must be > 0 (the demo samples), got {self.temperature}")
        if self.engine_dtype not in ("bfloat16", "float32", "float16") or self.trainer_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"DemoConfig dtypes: engine in bfloat16/float32/float16, trainer in float32/bfloat16; got {self.engine_dtype}, {self.trainer_dtype}")
        if not self.arms:
            raise ValueError("DemoConfig.arms must name at least one arm")
        if self.estimator_n is not None and self.estimator_n < 1:
            raise ValueError(f"DemoConfig.estimator_n must be >= 1, got {self.estimator_n}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
