"""Gate-weight rules: recompute routing weights from the trainer's own router logits at replayed ids.

Invariant 4: weights are never replayed. Given router logits [T, E] and the engine's expert ids
[T, K], each rule returns the weights [T, K] the family's router would have produced had it chosen
those ids, in the ids' column order and differentiable w.r.t. the logits, so the router keeps its
gradient even where it would have chosen other experts.

Each rule also knows how to *select* (free routing), used to measure route flips and as the
reference the rule is tested against. Selection-only inputs (DeepSeek-V3's correction bias, its
expert groups) influence `select` and never `weights`. A per-expert scale that weighs (Gemma 4's
`per_expert_scale`, a trained parameter) is passed as a tensor at each call, as the bias is, so a
rule reads its live value and the scale gets its gradient (GateSpec.expert_scale).

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
    bias_on: str = "scores"
    """What the selection-only bias is added to before the top-k: the scores (DeepSeek-V3: sigmoid + bias) or the
    raw logits (Kolibri1: `topk(logits + bias)`). They choose differently: a bias of std 0.23 on logits of spread 2
    moves 2402 of 4096 probe rows of Kolibri1's tiny model between the two."""
    expert_scale: bool = False
    """Multiply each weight by the router's per-expert scale at its id, last (Gemma 4's `per_expert_scale`): the
    tensor is passed to `weights` as `scale_E` at each call."""
    renorm_p: float | None = None
    """Renormalise by the K weights' p-norm (`torch.norm(w, p)`) instead of their sum: DBRX's
    moe_normalize_expert_weights (1.0 in its configs). Used where `renormalize` is; None: the sum."""
    jitter_eps: float | None = None
    """Sparsemixer's `router_jitter_noise` (Phi-3.5-MoE: 0.01): each stage's softmax keeps only the experts whose
    logit is within a relative gap of 2 * jitter_eps of that stage's maximum. Required by that rule, unused by others."""

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"GateSpec.top_k must be >= 1, got {self.top_k}")
        if self.num_groups < 1 or not 1 <= self.topk_group <= self.num_groups:
            raise ValueError(
                f"GateSpec needs 1 <= topk_group ({self.topk_group}) <= num_groups ({self.num_groups})"
            )
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"GateSpec.routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")
        if self.renorm_p is not None and (not self.renorm_p > 0 or self.renorm_eps is not None):
            raise ValueError(f"GateSpec.renorm_p must be None or > 0, without renorm_eps; got {self.renorm_p}, {self.renorm_eps}")
        if self.renorm_eps is not None and not self.renorm_eps >= 0:
            raise ValueError(f"GateSpec.renorm_eps must be None or >= 0, got {self.renorm_eps}")
        if self.group_score not in _GROUP_SCORES:
            raise ValueError(f"GateSpec.group_score must be one of {sorted(_GROUP_SCORES)}, got {self.group_score!r}")
        if self.scoring not in _SCORINGS:
            raise ValueError(f"GateSpec.scoring must be one of {sorted(_SCORINGS)}, got {self.scoring!r}")
        if self.bias_on not in ("scores", "logits"):
            raise ValueError(f"GateSpec.bias_on must be 'scores' or 'logits', got {self.bias_on!r}")
        if self.bias_on == "logits" and self.rule != "sigmoid_bias_group":
            raise ValueError(f"GateSpec.bias_on='logits' is a sigmoid_bias_group selection, not {self.rule!r}'s")
        if self.rule == "sparsemixer" and (self.top_k != 2 or self.jitter_eps is None or not self.jitter_eps >= 0):
            raise ValueError(f"sparsemixer selects in two stages (top_k=2) and needs jitter_eps >= 0; "
                             f"got top_k={self.top_k}, jitter_eps={self.jitter_eps}")


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
    if spec.renorm_p is not None:  # DBRX: `w / torch.norm(w, p=..., dim=-1, keepdim=True)`
        return w_TK / torch.norm(w_TK, p=spec.renorm_p, dim=-1, keepdim=True)
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


def _per_expert(w_TK: torch.Tensor, ids_TK: torch.Tensor, spec: GateSpec, scale_E: torch.Tensor | None) -> torch.Tensor:
    """`w_TK` times the per-expert scale at the ids where `spec.expert_scale` (HF: `w * per_expert_scale[ids]`, the
    scale in its own dtype, fp32 weights times bf16 scale promoting to fp32 as HF's does)."""
    if spec.expert_scale != (scale_E is not None):
        raise ValueError(f"GateSpec.expert_scale={spec.expert_scale} but the per-expert scale given is "
                         f"{'None' if scale_E is None else f'a tensor of {scale_E.numel()}'}: a rule that weighs by it needs it, one that does not takes none")
    return w_TK if scale_E is None else w_TK * scale_E.reshape(-1)[ids_TK]


class GateRule(Protocol):
    def select(self, logits_TE: torch.Tensor, spec: GateSpec, bias_E: torch.Tensor | None = None) -> torch.Tensor:
        """Free routing: expert ids [T, K] (int64)."""

    def weights(
        self, logits_TE: torch.Tensor, ids_TK: torch.Tensor, spec: GateSpec, bias_E: torch.Tensor | None = None,
        scale_E: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Gate weights [T, K] at `ids_TK`, in its column order: float32, or the logits' dtype where `spec.upcast` is False.
        `scale_E`: the router's per-expert scale, given exactly where `spec.expert_scale`."""


GATE_RULES: Registry[GateRule] = Registry("gate rule")


class SoftmaxTopK:
    """Softmax over all E experts (fp32, or the logits' dtype), gather at the ids; renormalise over K when asked; scale.

    Qwen3-MoE / OLMoE (norm_topk_prob), Mixtral (always), Qwen2-MoE (norm_topk_prob=False),
    DeepSeek-V2 and LongCat (no renormalisation, scaled), Mistral4 (groups), ERNIE-4.5 and ZAYA1 (a
    selection-only bias added to the probabilities in fp32: ZAYA1's `probs.to(float32) + balancing_biases`,
    whose bias loads in bf16 with bf16 weights, where a bf16 sum moves 13 of 4096 probe rows' experts).
    Bias and groups choose, never weigh.
    """

    def __init__(self, force_renormalize: bool | None = None) -> None:
        self.force_renormalize = force_renormalize

    def select(self, logits_TE, spec, bias_E=None):
        choice_TE = torch.softmax(_scores_in(logits_TE, spec), dim=-1)
        if bias_E is not None:
            choice_TE = choice_TE.float() + bias_E.reshape(-1)
        return torch.topk(_group_limited(choice_TE, spec, 0.0), spec.top_k, dim=-1).indices

    def weights(self, logits_TE, ids_TK, spec, bias_E=None, scale_E=None):
        probs_TE = torch.softmax(_scores_in(logits_TE, spec), dim=-1)
        w_TK = probs_TE.gather(1, ids_TK)
        renorm = spec.renormalize if self.force_renormalize is None else self.force_renormalize
        if renorm:
            w_TK = _renorm(w_TK, spec, 0.0)
        w_TK = w_TK * spec.routed_scaling_factor if spec.routed_scaling_factor != 1.0 else w_TK
        return _per_expert(w_TK, ids_TK, spec, scale_E)


class TopKSoftmax:
    """Top-k of the raw logits, then softmax over those K only (fp32, or the logits' dtype: GPT-OSS, Aria)."""

    def select(self, logits_TE, spec, bias_E=None):
        return torch.topk(logits_TE, spec.top_k, dim=-1).indices

    def weights(self, logits_TE, ids_TK, spec, bias_E=None, scale_E=None):
        w_TK = torch.softmax(_scores_in(logits_TE, spec).gather(1, ids_TK), dim=-1)
        w_TK = w_TK * spec.routed_scaling_factor if spec.routed_scaling_factor != 1.0 else w_TK
        return _per_expert(w_TK, ids_TK, spec, scale_E)


class TopKSigmoid:
    """Top-k of the raw logits, weighed by their sigmoid (fp32, or the logits' dtype), renormalised over K where
    asked, scaled. Llama 4 (no renormalisation): it selects on the logits, where a sigmoid-score top-k
    (sigmoid_bias_group) ties once fp32 sigmoids round to 1.0 (logits above ~17)."""

    def select(self, logits_TE, spec, bias_E=None):
        return torch.topk(logits_TE, spec.top_k, dim=-1).indices

    def weights(self, logits_TE, ids_TK, spec, bias_E=None, scale_E=None):
        # sigmoid over [T, E] then gather, as HF's dense sigmoid: CPU sigmoid rounds its vector body and scalar tail
        # differently (124 of ~1000 elements moved by the tensor's size alone), so [T, K] would differ in some bits
        w_TK = _scores_in(logits_TE, spec).sigmoid().gather(1, ids_TK)
        if spec.renormalize:
            w_TK = _renorm(w_TK, spec, 0.0)
        w_TK = w_TK * spec.routed_scaling_factor if spec.routed_scaling_factor != 1.0 else w_TK
        return _per_expert(w_TK, ids_TK, spec, scale_E)


class SigmoidBiasGroup:
    """DeepSeek-V3 and its kin: per-expert scores; the correction bias and expert groups choose, never weigh.

    Scores: `spec.scoring` of the logits (fp32, or their own dtype; sigmoid, DeepSeek-V4's sqrt(softplus)). Selection:
    per group the sum of its top-2 `score + bias`, keep `topk_group` groups, top-k of `score + bias`
    inside them. Weights: `score[ids]`, renormalised (+1e-20 unless spec.renorm_eps says otherwise),
    times routed_scaling_factor. Also MiniMax-M2, Hunyuan-V3, AFMoE, LFM2-MoE, Laguna, Cohere2-MoE's
    sigmoid mode (no bias, no groups). Kolibri1 adds its bias to the raw logits (`spec.bias_on`): it chooses
    by `topk(logits + bias)` and weighs by `sigmoid(logits[ids])`.
    """

    def select(self, logits_TE, spec, bias_E=None):
        if bias_E is not None and spec.bias_on == "logits":
            choice_TE = _scores_in(logits_TE, spec) + bias_E.reshape(-1)
        else:
            scores_TE = _SCORINGS[spec.scoring](_scores_in(logits_TE, spec))
            choice_TE = scores_TE if bias_E is None else scores_TE + bias_E.reshape(-1)
        return torch.topk(_group_limited(choice_TE, spec, float("-inf")), spec.top_k, dim=-1, sorted=False)[1]

    def weights(self, logits_TE, ids_TK, spec, bias_E=None, scale_E=None):
        w_TK = _SCORINGS[spec.scoring](_scores_in(logits_TE, spec)).gather(1, ids_TK)
        if spec.renormalize:
            w_TK = _renorm(w_TK, spec, 1e-20)
        return _per_expert(w_TK * spec.routed_scaling_factor, ids_TK, spec, scale_E)


class ProbsTopK:
    """The router's first output is already its softmax probabilities (Gemma 4, DiffusionGemma: `router_probabilities`,
    fp32): gather them at the ids, renormalise over K when asked (plain sum, as HF's `/=`), scale; weigh by the
    per-expert scale last (`per_expert_scale[ids]`) where `spec.expert_scale`. Softmax-of-logits rules cannot
    reproduce these routers, as they would apply a second softmax (max abs weight error 0.24 on the tiny model).
    A selection-only bias, if given, is added to the probabilities."""

    def select(self, logits_TE, spec, bias_E=None):
        choice_TE = _scores_in(logits_TE, spec)
        if bias_E is not None:
            choice_TE = choice_TE + bias_E.reshape(-1)
        return torch.topk(_group_limited(choice_TE, spec, 0.0), spec.top_k, dim=-1).indices

    def weights(self, logits_TE, ids_TK, spec, bias_E=None, scale_E=None):
        w_TK = _scores_in(logits_TE, spec).gather(1, ids_TK)
        if spec.renormalize:
            w_TK = _renorm(w_TK, spec, 0.0)
        w_TK = w_TK * spec.routed_scaling_factor if spec.routed_scaling_factor != 1.0 else w_TK
        return _per_expert(w_TK, ids_TK, spec, scale_E)


class SparseMixer:
    """Phi-3.5-MoE's sparsemixer (HF PhimoeTopKRouter), top-2 in two stages, in the logits' dtype (`spec.upcast`).

    The router, in eval mode: stage 1 picks the max logit and keeps the experts within a relative gap of
    2 * jitter_eps of it (`(top - x) / max(|x|, top) <= 2 eps`), the rest at -inf; expert 1 weighs the softmax of
    those at its id. Stage 2 removes expert 1, picks the max of the rest and weighs it likewise against its own
    window. The window is computed without gradient (HF's `no_grad`); the logits get the softmax's gradient
    through the kept entries.

    At given ids each stage's window is centred on the given expert's own logit (`top` = its logit): at the
    router's own ids that is its max, so the weights are HF's bit for bit; at other ids it is the weight the
    router gives an expert it ranks first, which is what an engine that chose that expert computed, and
    every replayed expert keeps a weight > 0 and its gradient. Centred on the row's max instead, a replayed
    expert outside its 2% window (every shifted route of the tiny model) would weigh 0 and the router would get
    no gradient. Column order matters: column 0 is stage 1's expert (removed before stage 2), column 1 stage 2's;
    the router returns them in that order and traces keep it (codec).

    Training mode: HF samples each stage's expert (Gumbel, within the max's window) and multiplies the weight of
    one that is not its stage's max by 1/3 with probability 3/4 (Heun's midpoint), with a custom backward. Replay
    replaces the choice by the recorded ids, so nothing is sampled and these deterministic weights are used in
    either mode. Where the recorded expert is its stage's max (every row an eval-mode engine routed, up to the
    trainer's own flips), they equal HF's training forward value too (its midpoint factor is then 1.0), and
    autograd through this softmax-gather is PhimoeMultiplier's backward (`p_s * (onehot_s - p)`; equal to 6e-8,
    the two sum in other orders). The random 1/3
    of the other rows is a gradient estimator for *choosing* experts, which replay does not do. Hence
    `random_in_training`: the HF integration verifies this rule on the router in eval mode and does not compare
    it with HF's own training-mode output, a random draw.
    """

    random_in_training = True

    @staticmethod
    def _kept(scores_TE: torch.Tensor, stage_TE: torch.Tensor, top_T1: torch.Tensor, eps: float) -> torch.Tensor:
        """`stage_TE` with the experts farther than 2 * eps (relative) below `top_T1` at -inf (HF's expression)."""
        with torch.no_grad():
            factor_TE = scores_TE.abs().clamp(min=top_T1)
            far_TE = ((top_T1 - scores_TE) / factor_TE) > (2 * eps)
        return stage_TE.masked_fill(far_TE, float("-inf"))

    def select(self, logits_TE, spec, bias_E=None):
        if bias_E is not None:
            raise ValueError("sparsemixer takes no selection bias")
        x_TE = _scores_in(logits_TE, spec)
        first_T1 = x_TE.max(dim=-1, keepdim=True)[1]
        second_T1 = torch.scatter(x_TE, -1, first_T1, float("-inf")).max(dim=-1, keepdim=True)[1]
        return torch.cat((first_T1, second_T1), dim=-1)

    def weights(self, logits_TE, ids_TK, spec, bias_E=None, scale_E=None):
        if bias_E is not None:
            raise ValueError("sparsemixer takes no selection bias")
        x_TE = _scores_in(logits_TE, spec)
        first_T1, second_T1 = ids_TK[:, :1], ids_TK[:, 1:2]
        with torch.no_grad():
            top1_T1, top2_T1 = x_TE.gather(-1, first_T1), x_TE.gather(-1, second_T1)
        w1_T1 = torch.softmax(self._kept(x_TE, x_TE, top1_T1, spec.jitter_eps), dim=-1).gather(-1, first_T1)
        rest_TE = torch.scatter(x_TE, -1, first_T1, float("-inf"))
        w2_T1 = torch.softmax(self._kept(x_TE, rest_TE, top2_T1, spec.jitter_eps), dim=-1).gather(-1, second_T1)
        w_TK = torch.cat((w1_T1, w2_T1), dim=-1)
        w_TK = w_TK * spec.routed_scaling_factor if spec.routed_scaling_factor != 1.0 else w_TK
        return _per_expert(w_TK, ids_TK, spec, scale_E)


GATE_RULES.add("softmax_topk", SoftmaxTopK())
"""Softmax before top-k; renormalisation as GateSpec.renormalize says."""
GATE_RULES.add("softmax_topk_renorm", SoftmaxTopK(force_renormalize=True))
"""Softmax before top-k, always renormalised (Mixtral)."""
GATE_RULES.add("topk_softmax", TopKSoftmax())
GATE_RULES.add("sigmoid_bias_group", SigmoidBiasGroup())
GATE_RULES.add("topk_sigmoid", TopKSigmoid())
"""Top-k of the logits, sigmoid of those (Llama 4)."""
GATE_RULES.add("probs_topk", ProbsTopK())
"""The router returns probabilities, not logits (Gemma 4)."""
GATE_RULES.add("sparsemixer", SparseMixer())
"""Phi-3.5-MoE's two-stage masked-softmax top-2."""


def gate_weights(
    logits_TE: torch.Tensor, ids_TK: torch.Tensor, spec: GateSpec, bias_E: torch.Tensor | None = None,
    scale_E: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weights [T, K] of `spec.rule` at `ids_TK` (float32 unless `spec.upcast` is False; differentiable w.r.t. logits_TE
    and `scale_E`, the per-expert scale, given exactly where `spec.expert_scale`)."""
    return GATE_RULES.get(spec.rule).weights(logits_TE, ids_TK, spec, bias_E, scale_E)


def select_experts(logits_TE: torch.Tensor, spec: GateSpec, bias_E: torch.Tensor | None = None) -> torch.Tensor:
    """Free top-k ids [T, K] of `spec.rule` (what the router picks without replay)."""
    return GATE_RULES.get(spec.rule).select(logits_TE, spec, bias_E)
