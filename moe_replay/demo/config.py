"""Settings of the end-to-end GRPO demo (one dataclass, validated on construction)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..noise import EngineNoise
from ..report.schema import NOISE_SECTION

DEFAULT_ARMS: dict[str, str] = {
    "none": "none",
    "r3_support": "r3_support",
    "r3_support_multisample": "r3_support_multisample",
}
"""Arm name -> preset name (configs/*.yaml)."""


@dataclass(frozen=True)
class NoiseSection:
    """The demo's engine-noise section (moe_replay/demo/noisy.py): rollouts of one more step under the
    engine-noise instrument, then π_old re-scored `replicas` times per studied rollout.

    Sized for well under a minute on 2 loaded cores: the scoring is `replicas` rounds of `studied /
    score_batch` engine batches (32 x 4 = 128; 96 of them took 25 s at a load of 7.5 on 2 cores)."""

    scale: float = 1.0
    """EngineNoise.scale (1.0: the calibrated setting, NOISE_LEVELS['calibrated'])."""
    prompts: int = 5
    samples_per_prompt: int = 4
    """Rollouts of the section: prompts x samples (20: decode steps of 20 requests run a perturbed variant at
    seed 0, and the filler pool reaches the 16-request bucket, a clean one)."""
    studied: int = 16
    """Rollouts whose π_old is estimated (the first ones); every rollout of the section is filler traffic."""
    score_batch: int = 4
    """Rollouts per estimator batch, before fillers (the lab's setting)."""
    replicas: int = 32
    """Re-scorings per studied rollout, in estimate() calls of max(ns) replicas each; the n-replica
    estimates are their disjoint groups of n (32 estimates at n = 1, 16 at 2, 8 at 4, 4 at 8)."""
    ns: tuple[int, ...] = (1, 2, 4, 8)
    clip_n: int | None = 4
    """The n whose estimate's phantom-clip fraction is reported next to the rollout logprobs' (None: skip, no trainer pass)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ns", tuple(int(n) for n in self.ns))
        for name in ("prompts", "samples_per_prompt", "studied", "score_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"NoiseSection.{name} must be >= 1, got {getattr(self, name)}")
        if not (self.ns and self.ns[0] == 1 and list(self.ns) == sorted(set(self.ns))):
            raise ValueError(f"NoiseSection.ns must be ascending distinct replica counts starting at 1 (the ratio's base), got {self.ns}")
        top = max(self.ns)
        if self.replicas < 2 * top or any(self.replicas % n for n in self.ns):
            raise ValueError(f"NoiseSection.replicas must be a multiple of every n in {self.ns} and give at least two "
                             f"estimates at n = {top} (a variance needs two), got {self.replicas}")
        if self.clip_n is not None and self.clip_n not in self.ns:
            raise ValueError(f"NoiseSection.clip_n must be one of ns {self.ns} or None, got {self.clip_n}")
        rollouts = self.prompts * self.samples_per_prompt
        if self.studied > rollouts:
            raise ValueError(f"NoiseSection.studied ({self.studied}) must be <= the section's rollouts "
                             f"(prompts x samples_per_prompt = {rollouts})")
        noise = self.noise(0)  # the variant depends on the seed only through a rotation: any seed tells
        sizes = self.placement_sizes(noise)
        if len({noise.variant_of(s) for s in sizes}) < 2:
            raise ValueError(
                f"NoiseSection: batches of {self.score_batch} rollouts among {rollouts} can only be placed in batches of "
                f"{sizes} requests, which run one numerics variant of EngineNoise.buckets {list(noise.buckets)}: every "
                "replica would agree and there would be no variance to reduce; use more rollouts or another score_batch")

    @property
    def rollouts(self) -> int:
        return self.prompts * self.samples_per_prompt

    def noise(self, seed: int) -> EngineNoise:
        """The rollouts' noise setting (logit variants and route flips)."""
        return EngineNoise(seed=seed, scale=self.scale)

    def placement_sizes(self, noise: EngineNoise) -> list[int]:
        """Batch sizes a scoring batch can be filled to (moe_replay/lab/engine.placing_scorer: the
        noise buckets between the batch and the whole pool of rollouts)."""
        return [b for b in noise.buckets if self.score_batch <= b <= self.rollouts] or [self.score_batch]

    @property
    def blocks(self) -> int:
        """estimate() calls of max(ns) replicas each."""
        return self.replicas // max(self.ns)

    def progress_ticks(self) -> int:
        """Progress-bar ticks of the section: the rollouts, each estimate() call, the trainer pass."""
        return 1 + self.blocks + int(self.clip_n is not None)


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
    noise: NoiseSection | None = field(default_factory=NoiseSection)
    """The engine-noise section after the arms (None: skipped, `demo --no-noise`)."""

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
        if self.noise is not None and NOISE_SECTION in self.arms:
            raise ValueError(f"DemoConfig.arms: {NOISE_SECTION!r} names the engine-noise section in the report; "
                             "call the arm something else")
        if self.estimator_n is not None and self.estimator_n < 1:
            raise ValueError(f"DemoConfig.estimator_n must be >= 1, got {self.estimator_n}")

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    def progress_ticks(self) -> int:
        """Progress-bar ticks of a run: every step of every arm, then the noise section's."""
        return len(self.arms) * self.steps + (self.noise.progress_ticks() if self.noise is not None else 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
