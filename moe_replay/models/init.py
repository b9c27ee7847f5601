"""Deterministic random weights, chosen so tiny random models behave usefully in tests.

Each tensor gets its own generator seeded from (seed, tensor name): the bytes do not depend on
module construction order or on transformers' own init code, so the same seed gives
bit-identical safetensors across runs and versions. Two scales are deliberately wide:
router weights (clear top-k gaps, so engines agree on routes instead of flipping near-ties) and
lm_head (peaked next-token distributions, so top_p=0.9 keeps a handful of tokens, not most of
the vocabulary).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from .families import Family


@dataclass(frozen=True)
class InitSpec:
    """Standard deviations of the random init (logit stds are for unit-RMS inputs)."""

    weight_gain: float = 1.0
    """Every other matrix and the embedding get std weight_gain / sqrt(hidden): sublayer outputs
    are as large as the residual stream, so routing visibly changes logprobs (0.02 would let the
    embedding -> lm_head path dominate and make replay tests weak)."""
    router_logit_std: float = 2.5
    """Std of router logits; 2.5 at hidden 128 is ~x10 the usual 0.02 weight std."""
    router_bias_std: float = 0.1
    """Biases that take part in expert choice (GPT-OSS router bias, DeepSeek correction bias)."""
    lm_head_logit_std: float = 4.0
    """Std of next-token logits: peaked enough that top_p=0.9 keeps a small set."""
    bias_std: float = 0.02
    """Other biases (small but non-zero, so a loader that drops them is caught)."""
    norm_std: float = 0.02
    """Norm weights are 1 + N(0, norm_std) (non-trivial, so a loader that drops them is caught)."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"InitSpec.{name} must be a finite float >= 0, got {value!r}")


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _std(name: str, t: torch.Tensor, family: Family, hidden: int, spec: InitSpec) -> tuple[float, float]:
    """(mean, std) for one state-dict entry, by role."""
    if name.endswith(family.router_weights):
        return 0.0, spec.router_logit_std / math.sqrt(hidden)
    if family.router_biases and name.endswith(family.router_biases):
        return 0.0, spec.router_bias_std
    if name.endswith("lm_head.weight"):
        return 0.0, spec.lm_head_logit_std / math.sqrt(hidden)
    if t.dim() == 1 and "norm" in name.rsplit(".", 2)[-2]:
        return 1.0, spec.norm_std
    if t.dim() == 1 or name.endswith("bias"):
        return 0.0, spec.bias_std
    return 0.0, spec.weight_gain / math.sqrt(hidden)


@torch.no_grad()
def init_weights_(model: torch.nn.Module, family: Family, seed: int, spec: InitSpec = InitSpec()) -> None:
    """Overwrite every floating-point state-dict entry of `model` in place."""
    hidden = model.config.hidden_size
    for name, t in model.state_dict().items():  # persistent buffers too (e_score_correction_bias)
        if not t.is_floating_point():
            continue
        mean, std = _std(name, t, family, hidden, spec)
        values = torch.randn(t.shape, generator=_generator(seed, name), dtype=torch.float32)
        t.copy_(values.mul_(std).add_(mean))
