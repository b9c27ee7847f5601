"""KL-to-reference penalty estimators, per token, for a loss term β·KL(π_θ || π_ref).

Samples y_t come from the policy that generated them; the per-token estimators use only the
logprobs of those samples. With δ = log π_ref(y_t) - log π_θ(y_t):

    k3           e^δ - δ - 1 >= 0                       (Schulman's k3; E_{π_θ}[k3] = KL(π_θ || π_ref))
    k3_unbiased  (π_θ / π_old)·(e^δ - δ - 1)            (DeepSeek-V3.2; E_{π_old}[·] = KL(π_θ || π_ref))

Plain k3 is unbiased only when the samples come from π_θ itself. In RL they come from π_old (the
engine, or the policy before this step's updates), so E_{π_old}[k3] is not the KL of π_θ; weighting
by the importance ratio π_θ / π_old makes the expectation, and its gradient, exact again. The ratio
keeps its gradient: it is part of the estimator, not an IS correction of the policy-gradient term.

Register another estimator with `register_kl_estimator`. Every exponent is clamped at
±log_clamp as everywhere else in the project (no gradient flows through a clamped exponent).

Shape legend: B batch, S sequence positions.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from .metrics import LOG_CLAMP, check_log_clamp, check_logprobs
from .registry import Registry

__all__ = ["KL_ESTIMATORS", "KLEstimator", "register_kl_estimator", "kl_penalty"]


class KLEstimator(Protocol):
    def __call__(
        self, policy_BS: torch.Tensor, ref_BS: torch.Tensor, old_BS: torch.Tensor | None, log_clamp: float
    ) -> torch.Tensor: ...


KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")
"""Estimator name -> per-token function (policy, ref, old, log_clamp) -> [B, S] estimate."""


def register_kl_estimator(name: str) -> Callable[[KLEstimator], KLEstimator]:
    """Function decorator: register a per-token KL estimator under ``name`` (a second one fails)."""
    return KL_ESTIMATORS.register(name)


def _k3(policy_BS: torch.Tensor, ref_BS: torch.Tensor, log_clamp: float) -> torch.Tensor:
    delta = (ref_BS - policy_BS).clamp(-log_clamp, log_clamp)
    return torch.exp(delta) - delta - 1.0


@register_kl_estimator("k3")
def k3(policy_BS: torch.Tensor, ref_BS: torch.Tensor, old_BS: torch.Tensor | None, log_clamp: float) -> torch.Tensor:
    """π_ref/π_θ - log(π_ref/π_θ) - 1: unbiased for KL(π_θ || π_ref) only on π_θ's own samples."""
    return _k3(policy_BS, ref_BS, log_clamp)


@register_kl_estimator("k3_unbiased")
def k3_unbiased(
    policy_BS: torch.Tensor, ref_BS: torch.Tensor, old_BS: torch.Tensor | None, log_clamp: float
) -> torch.Tensor:
    """DeepSeek-V3.2: (π_θ/π_old)·(π_ref/π_θ - log(π_ref/π_θ) - 1), unbiased on π_old's samples."""
    if old_BS is None:
        raise ValueError("KL estimator 'k3_unbiased' needs old_logprobs_BS (log π_old of the sampled tokens)")
    ratio_BS = torch.exp((policy_BS - old_BS).clamp(-log_clamp, log_clamp))
    return ratio_BS * _k3(policy_BS, ref_BS, log_clamp)


def kl_penalty(
    estimator: str,
    policy_logprobs_BS: torch.Tensor,
    ref_logprobs_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    *,
    old_logprobs_BS: torch.Tensor | None = None,
    log_clamp: float = LOG_CLAMP,
) -> torch.Tensor:
    """Per-token KL(π_θ || π_ref) estimate, 0 on padding; aggregate it like the policy loss.

    Args:
        estimator: a registered name (``k3``, ``k3_unbiased``).
        policy_logprobs_BS: log π_θ of the sampled tokens; the gradient flows through it.
        ref_logprobs_BS: log π_ref of the same tokens (detached here).
        response_mask_BS: 1/True on tokens that count.
        old_logprobs_BS: log π_old of the same tokens, the policy that sampled them (detached
            here); needed by ``k3_unbiased``.
        log_clamp: bound on exponents, in (0, 80).

    A NaN/±inf logprob on a response token would turn the penalty into NaN, and one above 0 (beyond
    `LOGPROB_TOL`) is no logprob: both refused with `LogprobInputError` (a ValueError) naming the
    argument, the position and the value.
    """
    fn = KL_ESTIMATORS.get(estimator)
    log_clamp = check_log_clamp(log_clamp)
    if policy_logprobs_BS.dim() != 2:
        raise ValueError(f"policy_logprobs_BS must be [B, S], got shape {list(policy_logprobs_BS.shape)}")
    mask_BS = response_mask_BS.bool().to(policy_logprobs_BS.device)
    named = {"policy_logprobs_BS": policy_logprobs_BS, "ref_logprobs_BS": ref_logprobs_BS}
    if old_logprobs_BS is not None:
        named["old_logprobs_BS"] = old_logprobs_BS
    for arg, t in named.items():
        if t.shape != mask_BS.shape:
            raise ValueError(f"{arg} has shape {list(t.shape)}, expected {list(mask_BS.shape)} (response_mask_BS)")
    check_logprobs({arg: t.detach().to(mask_BS.device) for arg, t in named.items()}, mask_BS, nonfinite="raise")
    zero = torch.zeros((), dtype=policy_logprobs_BS.dtype, device=policy_logprobs_BS.device)
    policy = torch.where(mask_BS, policy_logprobs_BS, zero)
    ref = torch.where(mask_BS, ref_logprobs_BS.detach().to(policy.device, policy.dtype), zero)
    old = None
    if old_logprobs_BS is not None:
        old = torch.where(mask_BS, old_logprobs_BS.detach().to(policy.device, policy.dtype), zero)
    return torch.where(mask_BS, fn(policy, ref, old, log_clamp), zero)
