"""Score rollouts' generated tokens with an HF causal LM (a BatchScorer for the π_old estimator).

With `force_routes` the forward runs under the traces' recorded experts (replay), and with
`use_support` each token is scored over its recorded sampling support, so the only thing left to
vary between replicas is the kernels' numerics. In bf16 on a GPU, padding and batch composition
change reduction order, which is real engine-like noise; fp32 on CPU is deterministic.

Legend: B batch, S padded length, V vocab, G generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from moe_replay.trace import RolloutTrace


@dataclass(frozen=True)
class HFScorerConfig:
    model_dir: str
    """A local HF checkpoint directory."""
    dtype: str = "float32"
    """torch dtype name of the model weights and compute."""
    device: str = "cpu"
    force_routes: bool = False
    """Run the forward under each trace's recorded routes (traces must carry them)."""
    use_support: bool = False
    """Renormalise over each token's recorded sampling support (rows without one use all of V)."""
    weights_version: str | int | None = None
    """The version of the checkpoint's weights (None: not tracked); a trace of another version is
    refused (WeightsVersionError) unless `off_policy` (moe_replay/identity.py, build_plan's check)."""
    off_policy: bool = False
    """Score traces of other weights versions under these weights on purpose."""
    allow_adjusted_sampling: bool = False
    """Score traces whose sampler's logits were shifted (penalties, logit_bias: `sampling.adjusted`)
    instead of refusing them; their scores are then of the model's own logits, not the engine's
    (build_plan's option of that name)."""

    def __post_init__(self) -> None:
        if not Path(self.model_dir).is_dir():
            raise ValueError(f"HFScorerConfig.model_dir: expected a checkpoint directory, found {self.model_dir!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"HFScorerConfig.dtype must be float32/bfloat16/float16, got {self.dtype!r}")


class HFScorer:
    """`score_batch(traces) -> [logprobs_G]`, one forward per batch (right-padded)."""

    def __init__(self, config: HFScorerConfig) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from .replay import model_geometry

        self.config = config
        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(config.model_dir, dtype=getattr(torch, config.dtype))
        self.model.to(config.device).eval()
        self.geometry = model_geometry(self.model)

    @property
    def weights_version(self) -> str | int | None:
        """The weights this scorer scores under (config.weights_version; identity.py)."""
        return self.config.weights_version

    @property
    def off_policy(self) -> bool:
        return self.config.off_policy

    def score_batch(self, traces: Sequence[RolloutTrace]) -> list[np.ndarray]:
        """log p of each trace's generated tokens at its recorded sampling temperature (trace.sampling)."""
        import contextlib

        from moe_replay.replay import PlanConfig, build_plan, score_tokens

        from .replay import replay

        if not traces:
            return []
        plan = build_plan(traces, self.geometry, routes=self.config.force_routes,  # checks identity and sampling
                          weights_version=self.config.weights_version, off_policy=self.config.off_policy,
                          config=PlanConfig(allow_adjusted_sampling=self.config.allow_adjusted_sampling)
                          ).to(self.config.device)
        ctx = replay(self.model, plan) if self.config.force_routes else contextlib.nullcontext()
        with self._torch.no_grad(), ctx:
            logits_BSV = self.model(**plan.model_inputs()).logits
            scores = score_tokens(logits_BSV, plan, use_support=self.config.use_support)
        return [lp.double().cpu().numpy() for lp in scores.split(plan)]
