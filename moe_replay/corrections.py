"""Off-policy corrections for the train/inference mismatch: IS weights and rejection masks.

The engine samples with π_rollout, the trainer computes π_train on the same tokens; each
correction turns the per-token log-ratio ``lr = log π_train - log π_rollout`` (verl's sign: the
IS weight ρ = exp(lr) re-weights engine samples towards the trainer) into a token log-weight
and/or a keep decision. A list of corrections runs in order through `apply_corrections`:

* log-weights add (weights multiply), keep masks AND;
* each correction sees only the tokens still kept by the ones before it: its sequence
  statistics (sum, mean, any) are over those tokens. That is what makes order matter, e.g.
  IcePop before a token veto removes the tokens the veto would have fired on;
* sequence-level decisions keep or reject every token of the sequence;
* weights are computed from detached logprobs (IS weights change the measure, not the
  objective: no gradient may flow through them), in log space; decisions compare the raw
  log-ratio with their thresholds, and only the summed log-weight is clamped to ``±log_clamp``
  before exp, so nothing overflows and no threshold has a dead zone beyond e^±log_clamp;
* a token whose logprob is NaN or ±inf on either side (a rollout logprob of -inf is a token the
  engine gave probability 0: a broken sample) is rejected and counted, as the metrics do; a batch
  where every response token is such a one is refused (`LogprobInputError`), since its loss would be
  exactly 0 with nothing said, and so is a logprob above 0 (beyond rounding, `LOGPROB_TOL`);
* logprobs, advantages and losses are floating point and masks torch.bool at every public entry
  point, else `InputDtypeError` (integer logprobs would give log-ratios of 0; a float mask would
  count 0.5 as True).

A rejected token either leaves the loss denominator (rejection sampling, verl's
``rollout_rs`` path) or stays in it with weight 0 (IcePop's paper and verl's IS-weight path);
each correction's decision says which. Aggregate with `aggregate_loss` over ``result.keep_BS``,
the tokens that count in the denominator; ``result.weights_BS`` is 0 on the zero-weighted ones.
Porting from verl and the papers, and where this differs on purpose: docs/corrections.md.

Shape legend: B batch, S sequence positions (response tokens, padded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Literal, Mapping, Sequence, TypeVar

import torch

from .metrics import LOG_CLAMP, check_dtypes, check_log_clamp, check_logprobs, k3_terms, normalized_ess
from .registry import Registry

__all__ = [
    "CORRECTIONS",
    "CorrectionConfig",
    "CorrectionContext",
    "CorrectionResult",
    "Decision",
    "TISConfig",
    "MISConfig",
    "IcePopConfig",
    "OPSMConfig",
    "GSPOConfig",
    "GeoRSConfig",
    "TokenVetoConfig",
    "BatchSkipConfig",
    "register_correction",
    "build_correction",
    "apply_corrections",
    "masked_mean",
    "aggregate_loss",
    "reinforce_loss",
]

PREFIX = "moe_replay/corr"
"""Prefix of every metric key `apply_corrections` returns."""

Level = Literal["token", "sequence"]
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


# --------------------------------------------------------------------------- loss aggregation


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is true; the denominator counts only those.

    Masked-out positions are selected away with ``where`` (not multiplied by 0), so NaN/inf in
    padding cannot leak in. An empty selection gives 0 (a loss that contributes nothing), not NaN.
    """
    check_dtypes("masked_mean", "float", values=values)
    check_dtypes("masked_mean", "bool", mask=mask)
    kept = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    count = mask.sum() if dim is None else mask.sum(dim)
    total = kept.sum() if dim is None else kept.sum(dim)
    return total / count.clamp_min(1).to(values.dtype)


def aggregate_loss(loss_BS: torch.Tensor, keep_BS: torch.Tensor, mode: LossAggregation = "token-mean") -> torch.Tensor:
    """Reduce a per-token loss to a scalar over kept tokens only.

    ``token-mean``: Σ loss / #kept tokens of the batch. ``seq-mean-token-mean``: each sequence's
    mean over its kept tokens, averaged over sequences that keep at least one token.
    ``seq-mean-token-sum``: each sequence's sum over kept tokens, averaged likewise. Fully rejected
    sequences drop out of every denominator.
    """
    check_dtypes("aggregate_loss", "float", loss_BS=loss_BS)
    check_dtypes("aggregate_loss", "bool", keep_BS=keep_BS)
    if loss_BS.shape != keep_BS.shape:
        raise ValueError(f"loss_BS shape {list(loss_BS.shape)} != keep_BS shape {list(keep_BS.shape)}")
    if mode == "token-mean":
        return masked_mean(loss_BS, keep_BS)
    has_B = keep_BS.any(-1)
    if mode == "seq-mean-token-mean":
        per_seq_B = masked_mean(loss_BS, keep_BS, dim=-1)
    elif mode == "seq-mean-token-sum":
        per_seq_B = torch.where(keep_BS, loss_BS, torch.zeros((), dtype=loss_BS.dtype, device=loss_BS.device)).sum(-1)
    else:
        raise ValueError(
            f"unknown loss aggregation mode {mode!r}; supported: token-mean, seq-mean-token-mean, seq-mean-token-sum"
        )
    return masked_mean(per_seq_B, has_B)


# --------------------------------------------------------------------------- context and results


@dataclass(frozen=True)
class CorrectionContext:
    """What a correction sees: the detached raw log-ratios and the tokens still kept."""

    log_ratio_BS: torch.Tensor
    """log π_train - log π_rollout, detached, unclamped and finite, 0 where not kept; float32
    (float64 when an input is float64).
    Compare it with thresholds as is; clamp only what goes into an exp."""
    keep_BS: torch.Tensor
    """bool: response tokens not rejected (nor zero-weighted) by the corrections before this one."""
    advantages_BS: torch.Tensor | None
    """float32 per-token advantage (a [B] input broadcast over S), when the caller gave them;
    finite on response tokens."""
    log_clamp: float
    """Bound used on log-weights before exp."""

    def seq_sum_B(self) -> torch.Tensor:
        """Σ of kept token log-ratios per sequence: the log of the sequence IS ratio Π ρ_t."""
        return torch.where(self.keep_BS, self.log_ratio_BS, 0.0).sum(-1)

    def seq_len_B(self) -> torch.Tensor:
        """Number of kept tokens per sequence."""
        return self.keep_BS.sum(-1)

    def seq_mean_B(self) -> torch.Tensor:
        """Mean kept token log-ratio per sequence (log of the geometric-mean ratio); 0 if none kept."""
        return self.seq_sum_B() / self.seq_len_B().clamp_min(1).to(self.log_ratio_BS.dtype)

    def token_frac(self, flag_BS: torch.Tensor) -> torch.Tensor:
        """Fraction of the currently kept tokens where ``flag_BS`` holds."""
        return masked_mean(flag_BS.to(torch.float32), self.keep_BS)

    def seq_frac(self, flag_B: torch.Tensor) -> torch.Tensor:
        """Fraction of the sequences that still keep a token where ``flag_B`` holds."""
        return masked_mean(flag_B.to(torch.float32), self.keep_BS.any(-1))


@dataclass(frozen=True)
class RatioBand:
    """The band of IS ratios an importance-sampling correction treats as in range: ratios above
    `high` are truncated or rejected, below `low` rejected (or only counted). The verl-named
    summary `rollout_corr/rollout_is_ratio_fraction_{high,low}` counts ratios outside it."""

    low: float
    high: float
    level: Level = "token"
    """``token``: each ρ_t is compared; ``sequence``: Π_t ρ_t, one per sequence."""


@dataclass
class Decision:
    """One correction's output; ``None`` means "no change" for that part.

    Shapes: [B, S] for token-level decisions, [B] for sequence-level ones (broadcast over S).
    """

    log_weight: torch.Tensor | None = None
    """Log of the multiplicative IS weight this correction contributes."""
    keep: torch.Tensor | None = None
    """bool: False rejects the token (or, for [B], the whole sequence)."""
    zero_weight: bool = False
    """True: the tokens ``keep`` rejects get weight 0 but stay in the loss denominator (IcePop's
    paper, verl's IS weights); False: they leave it (rejection sampling)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Scalar extras reported under ``moe_replay/corr/<name>/<key>``."""
    band: RatioBand | None = None
    """The IS ratio band this correction applies, if it is an IS correction (TIS, IcePop)."""


@dataclass
class CorrectionResult:
    """What the loss needs: detached token weights, the final keep mask, and metrics."""

    weights_BS: torch.Tensor
    """float32 IS weights, detached; 0 on rejected, zero-weighted and padding tokens."""
    keep_BS: torch.Tensor
    """bool: tokens that count in the loss denominator (zero-weighted ones included)."""
    log_ratio_BS: torch.Tensor
    """raw, detached log π_train - log π_rollout (0 on padding and non-finite tokens); float32, or
    float64 when an input is float64."""
    metrics: dict[str, float]
    """Flat metrics, keys prefixed ``moe_replay/corr/``."""

    @property
    def skip_update(self) -> bool:
        """No token carries a nonzero weight (e.g. `BatchSkipConfig` fired): the loss has no
        gradient, and an optimizer step would still move the weights by its momentum and decay."""
        return not bool((self.weights_BS > 0).any())


# --------------------------------------------------------------------------- configs and registry


def _check_positive(cls_name: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{cls_name}.{name} must be a finite number > 0, got {value!r}")


def _check_choice(cls_name: str, name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{cls_name}.{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _check_bool(cls_name: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{cls_name}.{name} must be a bool, got {value!r}")


class CorrectionConfig:
    """Base of every correction: a frozen dataclass whose fields configure it and whose
    `decide` maps a `CorrectionContext` to a `Decision`. ``name`` is set by registration."""

    name: ClassVar[str] = ""

    def decide(self, ctx: CorrectionContext) -> Decision:  # pragma: no cover - abstract
        raise NotImplementedError


CORRECTIONS: Registry[type[CorrectionConfig]] = Registry("correction")
"""Correction name -> config class. Register new ones with `register_correction`."""

C = TypeVar("C", bound=type[CorrectionConfig])


def register_correction(name: str) -> Callable[[C], C]:
    """Class decorator: register a correction config under ``name`` (a second one fails)."""

    def deco(cls: C) -> C:
        CORRECTIONS.add(name, cls)
        cls.name = name
        return cls

    return deco


@register_correction("tis")
@dataclass(frozen=True)
class TISConfig(CorrectionConfig):
    """Truncated IS: weight min(ρ, C). Keeps every token; bounds the variance, biased (IS-TIS)."""

    threshold: float = 2.0
    """C: the weight ceiling (verl's default rollout_is_threshold)."""
    level: Level = "token"
    """``token``: truncate each ρ_t; ``sequence``: truncate Π_t ρ_t and give it to every token."""

    def __post_init__(self) -> None:
        _check_positive(type(self).__name__, "threshold", self.threshold)
        _check_choice(type(self).__name__, "level", self.level, ("token", "sequence"))

    def decide(self, ctx: CorrectionContext) -> Decision:
        log_c = math.log(self.threshold)
        band = RatioBand(1.0 / self.threshold, self.threshold, self.level)  # verl's default lower bound: 1 / C
        if self.level == "token":
            lr = ctx.log_ratio_BS
            return Decision(log_weight=lr.clamp(max=log_c), metrics={"truncated_fraction": ctx.token_frac(lr > log_c)},
                            band=band)
        s_B = ctx.seq_sum_B()
        return Decision(log_weight=s_B.clamp(max=log_c), metrics={"truncated_fraction": ctx.seq_frac(s_B > log_c)},
                        band=band)


@register_correction("mis")
@dataclass(frozen=True)
class MISConfig(CorrectionConfig):
    """Masked IS: reject where the ratio exceeds C instead of truncating it; keep ρ elsewhere."""

    threshold: float = 2.0
    """C: ratios above it are rejected."""
    level: Level = "sequence"
    """``sequence``: the ratio is Π_t ρ_t over the sequence's kept tokens; ``token``: each ρ_t."""
    weight: bool = True
    """Multiply kept tokens by their ratio (masked IS); False makes it pure rejection."""
    low: float | None = None
    """Optional lower bound: ratios below it are rejected too (verl's two-sided "Seq-MIS"
    preset uses 0.5 with C = 2); None is the paper's one-sided MIS."""

    def __post_init__(self) -> None:
        _check_positive(type(self).__name__, "threshold", self.threshold)
        _check_choice(type(self).__name__, "level", self.level, ("token", "sequence"))
        _check_bool(type(self).__name__, "weight", self.weight)
        if self.low is not None:
            _check_positive(type(self).__name__, "low", self.low)
            if self.low >= self.threshold:
                raise ValueError(f"MISConfig needs low < threshold, got low={self.low!r}, threshold={self.threshold!r}")

    def decide(self, ctx: CorrectionContext) -> Decision:
        log_c = math.log(self.threshold)
        lr = ctx.log_ratio_BS if self.level == "token" else ctx.seq_sum_B()
        keep = lr <= log_c
        if self.low is not None:
            keep = keep & (lr >= math.log(self.low))
        return Decision(log_weight=lr if self.weight else None, keep=keep)


@register_correction("icepop")
@dataclass(frozen=True)
class IcePopConfig(CorrectionConfig):
    """IcePop: tokens whose ρ_t lies outside [low, high] get no gradient; kept tokens keep weight ρ_t."""

    low: float = 0.5
    """α: tokens with ρ_t < α are rejected."""
    high: float = 5.0
    """β: tokens with ρ_t > β are rejected."""
    weight: bool = True
    """Multiply kept tokens by ρ_t (IcePop's masked IS); False makes it pure rejection."""
    rejected: Literal["zero_weight", "drop"] = "zero_weight"
    """``zero_weight``: out-of-band tokens get weight 0 and stay in the 1/|y| normaliser, as in
    the Ring-1T paper and verl's ``lo_hi`` IS threshold, so a sequence's other tokens keep their
    scale; ``drop``: they leave the denominator, as a rejection sampler would."""

    def __post_init__(self) -> None:
        _check_positive(type(self).__name__, "low", self.low)
        _check_positive(type(self).__name__, "high", self.high)
        _check_bool(type(self).__name__, "weight", self.weight)
        _check_choice(type(self).__name__, "rejected", self.rejected, ("zero_weight", "drop"))
        if self.low >= self.high:
            raise ValueError(f"IcePopConfig needs low < high, got low={self.low!r}, high={self.high!r}")

    def decide(self, ctx: CorrectionContext) -> Decision:
        lr = ctx.log_ratio_BS
        low, high = lr < math.log(self.low), lr > math.log(self.high)
        return Decision(
            log_weight=lr if self.weight else None,
            keep=~(low | high),
            zero_weight=self.rejected == "zero_weight",
            metrics={"low_fraction": ctx.token_frac(low), "high_fraction": ctx.token_frac(high)},
            band=RatioBand(self.low, self.high) if self.weight else None,
        )


@register_correction("opsm")
@dataclass(frozen=True)
class OPSMConfig(CorrectionConfig):
    """DeepSeek-V3.2 off-policy sequence masking: reject token t of sequence i when A_{i,t} < 0 and
    the sequence's length-normalised KL estimate mean_t(log π_rollout - log π_train) exceeds δ.

    Negative-advantage samples that the policy has drifted away from push hardest in a bad
    direction; positive ones are kept whatever their drift. The sign test is per token, so
    per-token advantages (PPO/GAE) mask only their negative tokens; per-sequence ones (GRPO)
    mask the whole sequence. The statistic has the sign of ``rollout_corr/kl``. DeepSeek compares the sampling policy with the current policy, so pass
    the current policy's logprobs as ``train_logprobs_BS`` when using it for that purpose.
    """

    delta: float = 1e-4
    """δ: KL threshold (slime's default; tune it to the mismatch level of the run)."""

    def __post_init__(self) -> None:
        d = self.delta
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or d < 0:
            raise ValueError(f"OPSMConfig.delta must be a finite number >= 0, got {d!r}")

    def decide(self, ctx: CorrectionContext) -> Decision:
        if ctx.advantages_BS is None:
            raise ValueError("correction 'opsm' needs advantages: pass advantages=[B] or [B, S] to apply_corrections")
        kl_B = -ctx.seq_mean_B()
        reject_BS = (ctx.advantages_BS < 0) & (kl_B > self.delta)[:, None]
        return Decision(keep=~reject_BS)


@register_correction("gspo")
@dataclass(frozen=True)
class GSPOConfig(CorrectionConfig):
    """GSPO's sequence ratio as the IS weight: exp(mean_t lr_t) = (Π ρ_t)^(1/|y|), on every token.

    Length normalisation keeps the ratio near 1 for long sequences where Π ρ_t would explode.
    """

    max_weight: float | None = None
    """Optional ceiling on the sequence weight (truncation); None leaves it untruncated."""

    def __post_init__(self) -> None:
        if self.max_weight is not None:
            _check_positive(type(self).__name__, "max_weight", self.max_weight)

    def decide(self, ctx: CorrectionContext) -> Decision:
        m_B = ctx.seq_mean_B()
        if self.max_weight is not None:
            m_B = m_B.clamp(max=math.log(self.max_weight))
        return Decision(log_weight=m_B)


@register_correction("geo_rs")
@dataclass(frozen=True)
class GeoRSConfig(CorrectionConfig):
    """Geometric-mean rejection sampling: reject a sequence whose exp(mean_t lr_t) lies outside
    [low, high]. Length-normalised, so a long sequence is not rejected just for being long."""

    low: float = 0.999
    """Lower bound on the geometric-mean ratio."""
    high: float = 1.001
    """Upper bound on the geometric-mean ratio."""

    def __post_init__(self) -> None:
        _check_positive(type(self).__name__, "low", self.low)
        _check_positive(type(self).__name__, "high", self.high)
        if self.low >= self.high:
            raise ValueError(f"GeoRSConfig needs low < high, got low={self.low!r}, high={self.high!r}")

    def decide(self, ctx: CorrectionContext) -> Decision:
        m_B = ctx.seq_mean_B()
        low_B, high_B = m_B < math.log(self.low), m_B > math.log(self.high)
        return Decision(
            keep=~(low_B | high_B),
            metrics={"low_fraction": ctx.seq_frac(low_B), "high_fraction": ctx.seq_frac(high_B)},
        )


@register_correction("token_veto")
@dataclass(frozen=True)
class TokenVetoConfig(CorrectionConfig):
    """Reject a whole sequence if any kept token has ρ_t below a threshold: one token the trainer
    finds near-impossible means the engine sampled something the trainer would not have."""

    threshold: float = 1e-4
    """τ in (0, 1]: the veto fires on ρ_t < τ."""

    def __post_init__(self) -> None:
        _check_positive(type(self).__name__, "threshold", self.threshold)
        if self.threshold > 1:
            raise ValueError(f"TokenVetoConfig.threshold must be in (0, 1], got {self.threshold!r}")

    def decide(self, ctx: CorrectionContext) -> Decision:
        veto_B = (ctx.keep_BS & (ctx.log_ratio_BS < math.log(self.threshold))).any(-1)
        return Decision(keep=~veto_B)


@register_correction("batch_skip")
@dataclass(frozen=True)
class BatchSkipConfig(CorrectionConfig):
    """Skip the whole update when the batch's vllm-kl, the token mean of k3 = ρ - 1 - lr (the
    ``rollout_corr/k3_kl`` formula) over the tokens still kept, exceeds a threshold ("When Speed
    Kills Stability"): a batch that far off-policy carries more mismatch than signal.

    Every token then leaves the loss, so the loss is 0 and `CorrectionResult.skip_update` is
    True: the trainer should not call the optimizer step. Metrics: ``vllm_kl`` (the statistic)
    and ``skipped`` (1.0 when it fired).
    """

    threshold: float = 0.1
    """Largest vllm-kl that still trains (0.1 in that report)."""

    def __post_init__(self) -> None:
        _check_positive(type(self).__name__, "threshold", self.threshold)

    def decide(self, ctx: CorrectionContext) -> Decision:
        k3_BS = k3_terms(ctx.log_ratio_BS.double(), ctx.log_clamp)
        vllm_kl = masked_mean(k3_BS, ctx.keep_BS)
        skip = vllm_kl > self.threshold
        keep_B = (~skip).expand(ctx.keep_BS.shape[0])
        return Decision(keep=keep_B, metrics={"vllm_kl": vllm_kl, "skipped": skip.double()})


def build_correction(spec: CorrectionConfig | str | Mapping[str, Any]) -> CorrectionConfig:
    """A correction from a config object, a registered name (defaults), or ``{"name": ..., **fields}``."""
    if isinstance(spec, CorrectionConfig):
        return spec
    if isinstance(spec, str):
        return CORRECTIONS.get(spec)()
    if isinstance(spec, Mapping):
        if "name" not in spec:
            supported = ", ".join(CORRECTIONS.names())
            raise ValueError(f"correction spec {dict(spec)!r} has no 'name'; supported: {supported}")
        cls = CORRECTIONS.get(spec["name"])
        kwargs = {k: v for k, v in spec.items() if k != "name"}
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(allowed))
        if unknown:
            raise ValueError(f"correction {spec['name']!r} has no field(s) {unknown}; its fields: {allowed}")
        return cls(**kwargs)
    raise ValueError(f"a correction spec is a CorrectionConfig, a name or a mapping, got {type(spec).__name__}")


# --------------------------------------------------------------------------- composition


def _advantages_BS(advantages: torch.Tensor | None, mask_BS: torch.Tensor) -> torch.Tensor | None:
    """Per-token advantages; NaN/inf on a response token would silently switch OPSM off: refused."""
    if advantages is None:
        return None
    adv = advantages.detach().to(device=mask_BS.device, dtype=torch.float32)
    B, S = mask_BS.shape
    if adv.shape == (B,):
        bad = ~torch.isfinite(adv) & mask_BS.any(-1)
        adv_BS = adv[:, None].expand(B, S)
    elif adv.shape == (B, S):
        bad = ~torch.isfinite(adv) & mask_BS
        adv_BS = adv
    else:
        raise ValueError(f"advantages must be [B]=[{B}] or [B, S]=[{B}, {S}], got {list(adv.shape)}")
    if bool(bad.any()):
        first = bad.nonzero()[0].tolist()
        raise ValueError(
            f"advantages must be finite on response tokens; {int(bad.sum())} are not, "
            f"the first at position {first} holds {float(adv[tuple(first)])!r}"
        )
    return torch.where(mask_BS, adv_BS, 0.0)


def apply_corrections(
    corrections: Sequence[CorrectionConfig | str | Mapping[str, Any]],
    train_logprobs_BS: torch.Tensor,
    rollout_logprobs_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    *,
    advantages: torch.Tensor | None = None,
    log_clamp: float = LOG_CLAMP,
) -> CorrectionResult:
    """Run ``corrections`` in order and return token weights, the keep mask and metrics.

    Args:
        corrections: configs, registered names or ``{"name": ..., **fields}`` mappings.
        train_logprobs_BS: the trainer's log π of each sampled token (detached here).
        rollout_logprobs_BS: the engine's log π of the same tokens.
        response_mask_BS: bool, True on response tokens; padding is never kept.
        advantages: [B] or [B, S], finite on response tokens; needed by corrections that read
            them (``opsm``).
        log_clamp: bound on the summed log-weight before exp, in (0, 80).

    Raises `InputDtypeError` (a TypeError) for integer logprobs or advantages or a non-bool mask,
    ValueError when the response mask selects no token (every fraction would be 0/0), and
    `LogprobInputError` (a ValueError naming the position and the value) for a logprob above
    `LOGPROB_TOL` on a response token or when every response token has a NaN/±inf logprob.

    Metrics (fractions are of response tokens / of sequences with a response token):
        moe_replay/corr/<name>/token_masked_fraction  tokens this correction rejected or zero-weighted
        moe_replay/corr/<name>/seq_masked_fraction    sequences it rejected a token of
        moe_replay/corr/<name>/<extra>                correction-specific (truncated_fraction, ...)
        moe_replay/corr/token_masked_fraction         1 - kept / response tokens
        moe_replay/corr/seq_masked_fraction           sequences with >= 1 rejected token
        moe_replay/corr/seq_rejected_fraction         sequences with every token rejected
        moe_replay/corr/nonfinite_token_fraction      tokens rejected for a NaN/±inf logprob
        moe_replay/corr/weight_{mean,min,max}         final weights over kept tokens (0 if none)
        moe_replay/corr/weight_ess                    normalised ESS (Σw)²/(n Σw²) over kept tokens
        moe_replay/corr/kept_tokens                   tokens with a nonzero weight
        moe_replay/corr/loss_tokens                   tokens in the loss denominator (keep_BS)
        rollout_corr/rollout_rs_masked_fraction       tokens out of the loss denominator (verl's name)
        rollout_corr/rollout_is_ratio_fraction_{high,low}  ratios above / below the first IS
                                                      correction's band (TIS: [1/C, C]; IcePop:
                                                      [low, high]), per token or per sequence
    A name used twice in the list gets ``<name>.<index>`` keys from its second use on.
    """
    entry = "apply_corrections"
    check_dtypes(entry, "float", train_logprobs_BS=train_logprobs_BS, rollout_logprobs_BS=rollout_logprobs_BS,
                 advantages=advantages)
    check_dtypes(entry, "bool", response_mask_BS=response_mask_BS)
    if train_logprobs_BS.dim() != 2:
        raise ValueError(f"train_logprobs_BS must be [B, S], got shape {list(train_logprobs_BS.shape)}")
    for arg, t in (("train_logprobs_BS", train_logprobs_BS), ("rollout_logprobs_BS", rollout_logprobs_BS)):
        if t.shape != response_mask_BS.shape:
            expected = list(response_mask_BS.shape)
            raise ValueError(f"{arg} has shape {list(t.shape)}, expected {expected} (response_mask_BS)")
    log_clamp = check_log_clamp(log_clamp)
    configs = [build_correction(c) for c in corrections]

    device = train_logprobs_BS.device
    response_BS = response_mask_BS.to(device)
    # float64 inputs keep float64 statistics (a float32 sum of 256 log-ratios is off by ~1e-5)
    wide = torch.float64 in (train_logprobs_BS.dtype, rollout_logprobs_BS.dtype)
    work = torch.float64 if wide else torch.float32
    train_f = train_logprobs_BS.detach().to(work)
    rollout_f = rollout_logprobs_BS.detach().to(device=device, dtype=work)
    finite_BS, n_given, _ = check_logprobs(
        {"train_logprobs_BS": train_f, "rollout_logprobs_BS": rollout_f}, response_BS, nonfinite="skip"
    )
    if n_given == 0:
        raise ValueError(f"response_mask_BS selects no token (shape {list(response_BS.shape)})")
    raw_lr_BS = train_f - rollout_f
    finite_BS = finite_BS & torch.isfinite(raw_lr_BS)
    nonfinite_BS = response_BS & ~finite_BS  # the same rule as the metrics' exclusion
    keep_BS = response_BS & finite_BS
    denom_BS = keep_BS
    lr_BS = torch.where(keep_BS, raw_lr_BS, 0.0)
    adv_BS = _advantages_BS(advantages, response_BS)
    log_w_BS = torch.zeros_like(lr_BS)

    n_resp = response_BS.sum().double()  # counts as float64: 1 - kept/n in float32 loses 6 digits
    valid_seq_B = response_BS.any(-1)
    n_seq = valid_seq_B.sum().double()
    m: dict[str, torch.Tensor] = {}
    seen: dict[str, int] = {}
    band: tuple[RatioBand, CorrectionContext] | None = None
    for index, cfg in enumerate(configs):
        ctx = CorrectionContext(log_ratio_BS=lr_BS, keep_BS=keep_BS, advantages_BS=adv_BS, log_clamp=log_clamp)
        d = cfg.decide(ctx)
        if band is None and d.band is not None:
            band = (d.band, ctx)
        key = cfg.name if cfg.name not in seen else f"{cfg.name}.{index}"
        seen[cfg.name] = index
        before_BS = keep_BS
        if d.keep is not None:
            step_keep = d.keep if d.keep.dim() == 2 else d.keep[:, None]
            keep_BS = keep_BS & step_keep
            if not d.zero_weight:
                denom_BS = denom_BS & step_keep
        if d.log_weight is not None:
            step_lw = d.log_weight if d.log_weight.dim() == 2 else d.log_weight[:, None]
            log_w_BS = log_w_BS + step_lw
        dropped_BS = before_BS & ~keep_BS
        m[f"{PREFIX}/{key}/token_masked_fraction"] = dropped_BS.sum() / n_resp
        m[f"{PREFIX}/{key}/seq_masked_fraction"] = dropped_BS.any(-1).sum() / n_seq
        for extra, value in d.metrics.items():
            m[f"{PREFIX}/{key}/{extra}"] = value

    weights_BS = torch.where(keep_BS, torch.exp(log_w_BS.clamp(-log_clamp, log_clamp)), 0.0).float().detach()
    kept = keep_BS.sum()
    w_kept = weights_BS[keep_BS]
    has_kept = w_kept.numel() > 0
    zero = torch.zeros((), device=device)
    m[f"{PREFIX}/token_masked_fraction"] = (n_resp - kept) / n_resp
    m[f"{PREFIX}/seq_masked_fraction"] = (response_BS & ~keep_BS).any(-1).sum() / n_seq
    m[f"{PREFIX}/seq_rejected_fraction"] = (valid_seq_B & ~keep_BS.any(-1)).sum() / n_seq
    m[f"{PREFIX}/nonfinite_token_fraction"] = nonfinite_BS.sum() / n_resp
    m[f"{PREFIX}/weight_mean"] = w_kept.mean() if has_kept else zero
    m[f"{PREFIX}/weight_min"] = w_kept.min() if has_kept else zero
    m[f"{PREFIX}/weight_max"] = w_kept.max() if has_kept else zero
    m[f"{PREFIX}/weight_ess"] = normalized_ess(log_w_BS.clamp(-log_clamp, log_clamp), keep_BS) if has_kept else zero
    m[f"{PREFIX}/kept_tokens"] = kept.float()
    m[f"{PREFIX}/loss_tokens"] = denom_BS.sum().float()
    # verl's names (rollout_corr_helper): tokens out of the loss, and ratios outside the first IS band
    m["rollout_corr/rollout_rs_masked_fraction"] = (n_resp - denom_BS.sum()) / n_resp
    if band is not None:
        b, ctx = band
        r = ctx.log_ratio_BS if b.level == "token" else ctx.seq_sum_B()
        frac = ctx.token_frac if b.level == "token" else ctx.seq_frac
        m["rollout_corr/rollout_is_ratio_fraction_high"] = frac(r > math.log(b.high))
        m["rollout_corr/rollout_is_ratio_fraction_low"] = frac(r < math.log(b.low))

    keys = list(m)
    values = torch.stack([m[k].detach().double().reshape(()) for k in keys]).cpu().tolist()
    return CorrectionResult(weights_BS=weights_BS, keep_BS=denom_BS, log_ratio_BS=lr_BS, metrics=dict(zip(keys, values)))


def reinforce_loss(
    policy_logprobs_BS: torch.Tensor,
    advantages: torch.Tensor,
    result: CorrectionResult,
    mode: LossAggregation = "token-mean",
) -> torch.Tensor:
    """IS-corrected REINFORCE loss ``-agg(w_t · A_t · log π_θ(y_t))`` over kept tokens.

    A reference use of a `CorrectionResult`: the weights are detached, so the gradient flows only
    through ``policy_logprobs_BS``; rejected tokens are out of numerator and denominator.
    ``advantages`` is [B] (broadcast over S) or [B, S]. A policy logprob above `LOGPROB_TOL` or
    NaN/±inf on a loss token (``result.keep_BS``) raises `LogprobInputError`.
    """
    check_dtypes("reinforce_loss", "float", policy_logprobs_BS=policy_logprobs_BS, advantages=advantages)
    if policy_logprobs_BS.shape != result.keep_BS.shape:
        raise ValueError(f"policy_logprobs_BS shape {list(policy_logprobs_BS.shape)} != result.keep_BS shape "
                         f"{list(result.keep_BS.shape)}")
    check_logprobs({"policy_logprobs_BS": policy_logprobs_BS.detach()}, result.keep_BS.to(policy_logprobs_BS.device),
                   nonfinite="raise")
    adv = advantages.detach().to(policy_logprobs_BS.device)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(policy_logprobs_BS)
    dtype = policy_logprobs_BS.dtype
    per_token_BS = -(result.weights_BS.to(dtype) * adv.to(dtype) * policy_logprobs_BS)
    return aggregate_loss(per_token_BS, result.keep_BS, mode)
