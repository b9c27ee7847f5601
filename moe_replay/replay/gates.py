"""Gate-weight rules: recompute routing weights from the trainer's own router logits at replayed ids.

Invariant 4: weights are never replayed. Given router logits [T, E] and the engine's expert ids
[T, K], each rule returns the weights [T, K] the family's router would have produced had it chosen
those ids, in the ids' column order and differentiable w.r.t. the logits, so the router keeps its
gradient even where it would have chosen other experts.

Each rule also knows how to *select* (free routing), used to measure route flips and as the
reference the rule is tested against. Selection-only inputs (DeepSeek-V3's correction bias, its
expert groups) influence `select` and never `weights`.

Legend: T tokens, E experts, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..registry import Registry


@dataclass(frozen=True)
class GateSpec:
    """What a family's router does, in numbers; read from the model by its adapter."""

    rule: str
    """Name in GATE_RULES."""
    top_k: int
    """Experts per token."""
    renormalize: bool = True
    """Divide the K weights by their sum (softmax_topk and sigmoid_bias_group)."""
    routed_scaling_factor: float = 1.0
    """Multiplier applied to the final weights (DeepSeek-V3: 2.5)."""
    num_groups: int = 1
    """Expert groups for group-limited selection (DeepSeek-V3 n_group)."""
    topk_group: int = 1
    """Groups kept per token before the expert top-k."""
    renorm_eps: float | None = None
    """Added to the K-weight sum before dividing; None: the rule's own (softmax 0, sigmoid 1e-20; LFM2 uses 1e-6)."""
    group_score: str = "top2_sum"
    """How a group is scored for selection: sum of its top-2 (DeepSeek-V3, Mistral4) or its max (DeepSeek-V2)."""
    scoring: str = "sigmoid"
    """Score function of the score rule: sigmoid (DeepSeek-V3, MiniMax-M2) or sqrtsoftplus (DeepSeek-V4)."""
    group_fill: float | None = None
    """What experts outside the kept groups score in selection; None: the rule's own (-inf for sigmoid scores,
    0 for softmax probabilities). AXK2 fills 0.0 after adding its bias, so a kept expert scoring below 0 loses."""
    upcast: bool = True
    """Scores from fp32 logits, as HF's `.float()` / `softmax(dtype=float32)` does (Qwen, Mixtral, MiniMax-M2);
    False: in the logits' own dtype, every later op too, as HF's bare `logits.sigmoid()` does (DeepSeek-V3,
    LFM2-MoE, GPT-OSS): bf16 where the router's linear returns bf16 (bf16 weights, or fp32 weights under
    bf16 autocast). In fp32 both are the same arithmetic."""

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"GateSpec.top_k must be >= 1, got {self.top_k}")
        if self.num_groups < 1 or not 1 <= self.topk_group <= self.num_groups:
            raise ValueError(
                f"GateSpec needs 1 <= topk_group ({self.topk_group}) <= num_groups ({self.num_groups})"
            )
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"GateSpec.routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")
        if self.renorm_eps is not None and not self.renorm_eps >= 0:
            raise ValueError(f"GateSpec.renorm_eps must be None or >= 0, got {self.renorm_eps}")
        if self.group_score not in _GROUP_SCORES:
            raise ValueError(f"GateSpec.group_score must be one of {sorted(_GROUP_SCORES)}, got {self.group_score!r}")
        if self.scoring not in _SCORINGS:
            raise ValueError(f"GateSpec.scoring must be one of {sorted(_SCORINGS)}, got {self.scoring!r}")


_SCORINGS = {
    "sigmoid": lambda x: x.sigmoid(),
    "sqrtsoftplus": lambda x: torch.nn.functional.softplus(x).sqrt(),
}
"""Per-expert score functions of the score rule (elementwise, so top-k of scores = top-k of their logits)."""
_GROUP_SCORES = ("top2_sum", "max")


def _scores_in(logits_TE: torch.Tensor, spec: GateSpec) -> torch.Tensor:
    """The logits the rule computes from: fp32 (`spec.upcast`) or as given."""
    return logits_TE.float() if spec.upcast else logits_TE


def _renorm(w_TK: torch.Tensor, spec: GateSpec, default_eps: float) -> torch.Tensor:
    eps = default_eps if spec.renorm_eps is None else spec.renorm_eps
    total_T1 = w_TK.sum(dim=-1, keepdim=True)
    return w_TK / (total_T1 + eps) if eps else w_TK / total_T1


def _group_limited(choice_TE: torch.Tensor, spec: GateSpec, fill: float) -> torch.Tensor:
    """Mask experts outside each token's `topk_group` best groups (selection only)."""
    if spec.num_groups <= 1:
        return choice_TE
    t, e = choice_TE.shape
    grouped_TGX = choice_TE.view(t, spec.num_groups, e // spec.num_groups)
    if spec.group_score == "max":
        group_TG = grouped_TGX.max(dim=-1).values
    else:
        group_TG = grouped_TGX.topk(2, dim=-1)[0].sum(dim=-1)
    keep_TG = torch.zeros_like(group_TG)
    keep_TG.scatter_(1, torch.topk(group_TG, spec.topk_group, dim=-1, sorted=False)[1], 1)
    keep_TE = keep_TG.unsqueeze(-1).expand(t, spec.num_groups, e // spec.num_groups).reshape(t, e)
    return choice_TE.masked_fill(~keep_TE.bool(), fill if spec.group_fill is None else spec.group_fill)


class GateRule(Protocol):
    def select(self, logits_TE: torch.Tensor, spec: GateSpec, bias_E: torch.Tensor | None = None) -> torch.Tensor:
        """Free routing: expert ids [T, K] (int64)."""

    def weights(
        self, logits_TE: torch.Tensor, ids_TK: torch.Tensor, spec: GateSpec, bias_E: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Gate weights [T, K] at `ids_TK`, in its column order: float32, or the logits' dtype where `spec.upcast` is False."""


GATE_RULES: Registry[GateRule] = Registry("gate rule")


class SoftmaxTopK:
    """Softmax over all E experts (fp32, or the logits' dtype), gather at the ids; renormalise over K when asked; scale.

    Qwen3-MoE / OLMoE (norm_topk_prob), Mixtral (always), Qwen2-MoE (norm_topk_prob=False),
    DeepSeek-V2 and LongCat (no renormalisation, scaled), Mistral4 (groups), ERNIE-4.5 (a
    selection-only bias added to the probabilities). Bias and groups choose, never weigh.
    """

    def __init__(self, force_renormalize: bool | None = None) -> None:
        self.force_renormalize = force_renormalize

    def select(self, logits_TE, spec, bias_E=None):
        choice_TE = torch.softmax(_scores_in(logits_TE, spec), dim=-1)
        if bias_E is not None:
            choice_TE = choice_TE + bias_E.reshape(-1)
        return torch.topk(_group_limited(choice_TE, spec, 0.0), spec.top_k, dim=-1).indices

    def weights(self, logits_TE, ids_TK, spec, bias_E=None):
        probs_TE = torch.softmax(_scores_in(logits_TE, spec), dim=-1)
        w_TK = probs_TE.gather(1, ids_TK)
        renorm = spec.renormalize if self.force_renormalize is None else self.force_renormalize
        if renorm:
            w_TK = _renorm(w_TK, spec, 0.0)
        return w_TK * spec.routed_scaling_factor if spec.routed_scaling_factor != 1.0 else w_TK


class TopKSoftmax:
    """Top-k of the raw logits, then softmax over those K only (fp32, or the logits' dtype: GPT-OSS, Aria)."""

    def select(self, logits_TE, spec, bias_E=None):
        return torch.topk(logits_TE, spec.top_k, dim=-1).indices

    def weights(self, logits_TE, ids_TK, spec, bias_E=None):
        w_TK = torch.softmax(_scores_in(logits_TE, spec).gather(1, ids_TK), dim=-1)
        return w_TK * spec.routed_scaling_factor if spec.routed_scaling_factor != 1.0 else w_TK


class SigmoidBiasGroup:
    """DeepSeek-V3 and its kin: per-expert scores; the correction bias and expert groups choose, never weigh.

    Scores: `spec.scoring` of the logits (fp32, or their own dtype; sigmoid, DeepSeek-V4's sqrt(softplus)). Selection:
    per group the sum of its top-2 `score + bias`, keep `topk_group` groups, top-k of `score + bias`
    inside them. Weights: `score[ids]`, renormalised (+1e-20 unless spec.renorm_eps says otherwise),
    times routed_scaling_factor. Also MiniMax-M2, Hunyuan-V3, AFMoE, LFM2-MoE, Laguna, Cohere2-MoE's
    sigmoid mode (no bias, no groups).
    """

    def select(self, logits_TE, spec, bias_E=None):
        scores_TE = _SCORINGS[spec.scoring](_scores_in(logits_TE, spec))
        choice_TE = scores_TE if bias_E is None else scores_TE + bias_E.reshape(-1)
        return torch.topk(_group_limited(choice_TE, spec, float("-inf")), spec.top_k, dim=-1, sorted=False)[1]

    def weights(self, logits_TE, ids_TK, spec, bias_E=None):
        w_TK = _SCORINGS[spec.scoring](_scores_in(logits_TE, spec)).gather(1, ids_TK)
        if spec.renormalize:
            w_TK = _renorm(w_TK, spec, 1e-20)
        return w_TK * spec.routed_scaling_factor


GATE_RULES.add("softmax_topk", SoftmaxTopK())
"""Softmax before top-k; renormalisation as GateSpec.renormalize says."""
GATE_RULES.add("softmax_topk_renorm", SoftmaxTopK(force_renormalize=True))
"""Softmax before top-k, always renormalised (Mixtral)."""
GATE_RULES.add("topk_softmax", TopKSoftmax())
GATE_RULES.add("sigmoid_bias_group", SigmoidBiasGroup())


def gate_weights(
    logits_TE: torch.Tensor, ids_TK: torch.Tensor, spec: GateSpec, bias_E: torch.Tensor | None = None
) -> torch.Tensor:
    """Weights [T, K] of `spec.rule` at `ids_TK` (float32 unless `spec.upcast` is False; differentiable w.r.t. logits_TE)."""
    return GATE_RULES.get(spec.rule).weights(logits_TE, ids_TK, spec, bias_E)


def select_experts(logits_TE: torch.Tensor, spec: GateSpec, bias_E: torch.Tensor | None = None) -> torch.Tensor:
    """Free top-k ids [T, K] of `spec.rule` (what the router picks without replay)."""
    return GATE_RULES.get(spec.rule).select(logits_TE, spec, bias_E)
