"""The multi-sample arm's π_old: re-score each rollout n times on the rollout engine itself."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..estimator import EstimatorConfig, estimate
from ..presets import Preset
from ..trace import RolloutTrace
from .config import DemoConfig


class PiOldEstimator:
    """n forced-route, support-renormalised re-scorings per rollout, averaged in probability space."""

    def __init__(self, engine: Any, preset: Preset, cfg: DemoConfig) -> None:
        import dataclasses

        from ..integrations.vllm.scoring.scorer import VllmScorer, VllmScorerConfig

        settings = preset.estimator
        self.config: EstimatorConfig = settings.config
        if cfg.estimator_n is not None:
            self.config = dataclasses.replace(self.config, n=cfg.estimator_n)
        self.scorer = VllmScorer(engine.llm, VllmScorerConfig(
            force_routes=settings.force_routes, use_support=settings.use_support))  # at each trace's temperature
        self.batch_size = cfg.prompts_per_step * cfg.samples_per_prompt

    def pi_old_G(self, traces: Sequence[RolloutTrace]) -> np.ndarray:
        """Flat [G] log π_old over the traces' generated tokens, in trace order."""
        estimates = estimate(traces, self.scorer, self.config, batch_size=self.batch_size)
        return np.concatenate([e.logprob_G for e in estimates])

    def close(self) -> None:
        """Take the scorer off the engine (forced-route scoring and the noise section's route flips
        wrap the same router attribute, so they never share it)."""
        self.scorer.uninstall()
