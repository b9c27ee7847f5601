"""KL-to-reference estimators: exact expectations on a small discrete example, gradients, errors.

The example: one token position, a vocabulary of 5 symbols, three policies π_old (sampled),
π_θ (trained) and π_ref (reference). Expectations are exact sums over the vocabulary, not
sample averages, so the test has no sampling noise.
"""

from __future__ import annotations

import pytest
import torch

from moe_replay.errors import RegistryError
from moe_replay.kl_penalty import KL_ESTIMATORS, kl_penalty, register_kl_estimator
from moe_replay.metrics import LogprobInputError

OLD_V = torch.tensor([0.60, 0.20, 0.10, 0.05, 0.05], dtype=torch.float64)
REF_V = torch.tensor([0.10, 0.20, 0.30, 0.25, 0.15], dtype=torch.float64)
THETA_LOGITS_V = torch.tensor([1.0, 0.3, -0.2, 0.1, -1.0], dtype=torch.float64)


def expectation(estimator: str, sample_V: torch.Tensor, logits_V: torch.Tensor) -> torch.Tensor:
    """E_{y ~ sample_V}[estimate(y)]: each symbol is one 'sampled token' of a [1, V] batch."""
    logp_V = torch.log_softmax(logits_V, -1)
    est_1V = kl_penalty(
        estimator, logp_V[None], REF_V.log()[None], torch.ones(1, 5), old_logprobs_BS=sample_V.log()[None]
    )
    return (sample_V * est_1V[0]).sum()


def exact_kl(logits_V: torch.Tensor) -> torch.Tensor:
    logp_V = torch.log_softmax(logits_V, -1)
    return (logp_V.exp() * (logp_V - REF_V.log())).sum()


def test_k3_unbiased_is_exact_under_pi_old_and_plain_k3_is_not():
    kl = exact_kl(THETA_LOGITS_V).item()
    assert kl > 0.1
    assert expectation("k3_unbiased", OLD_V, THETA_LOGITS_V).item() == pytest.approx(kl, rel=1e-12)
    biased = expectation("k3", OLD_V, THETA_LOGITS_V).item()
    assert abs(biased - kl) > 0.2 * kl  # plain k3 on π_old's samples: 0.496 against 0.406
    # ... and plain k3 is exact on π_θ's own samples
    theta_V = torch.softmax(THETA_LOGITS_V, -1)
    assert expectation("k3", theta_V, THETA_LOGITS_V).item() == pytest.approx(kl, rel=1e-12)


def test_k3_unbiased_gradient_is_the_kl_gradient():
    logits = THETA_LOGITS_V.clone().requires_grad_(True)
    (g_est,) = torch.autograd.grad(expectation("k3_unbiased", OLD_V, logits), logits)
    (g_kl,) = torch.autograd.grad(exact_kl(logits), logits)
    torch.testing.assert_close(g_est, g_kl, rtol=1e-12, atol=1e-14)
    (g_k3,) = torch.autograd.grad(expectation("k3", OLD_V, logits), logits)
    assert (g_k3 - g_kl).abs().max() > 1e-2


def test_padding_is_zero_and_ignored():
    policy = torch.tensor([[-1.0, -2.0, float("nan")]])
    ref = torch.tensor([[-1.5, -1.0, float("inf")]])
    old = torch.tensor([[-1.2, -2.5, 0.0]])
    out = kl_penalty("k3_unbiased", policy, ref, torch.tensor([[1, 1, 0]]), old_logprobs_BS=old)
    assert out[0, 2] == 0.0 and torch.isfinite(out).all()
    d = torch.tensor([-0.5, 1.0])
    expected = torch.exp(torch.tensor([0.2, 0.5])) * (d.exp() - d - 1)
    torch.testing.assert_close(out[0, :2], expected)


def test_errors():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="'k3_unbiased' needs old_logprobs_BS"):
        kl_penalty("k3_unbiased", lp, lp, torch.ones(1, 2))
    with pytest.raises(LogprobInputError, match=r"ref_logprobs_BS\[row 0, col 1\]': expected a finite logprob .*found nan"):
        kl_penalty("k3", lp, torch.tensor([[0.0, float("nan")]]), torch.ones(1, 2))
    with pytest.raises(LogprobInputError, match=r"policy_logprobs_BS\[row 0, col 1\]': expected a logprob <= 0 .*found 0.5") as e:
        kl_penalty("k3", torch.tensor([[-1.0, 0.5]]), lp, torch.ones(1, 2))  # a probability, not its log
    assert (e.value.row, e.value.col) == (0, 1)
    kl_penalty("k3", torch.tensor([[-1.0, 0.5]]), lp, torch.tensor([[1, 0]]))  # padding holds anything
    with pytest.raises(ValueError, match=r"old_logprobs_BS has shape \[1, 1\]"):
        kl_penalty("k3_unbiased", lp, lp, torch.ones(1, 2), old_logprobs_BS=torch.zeros(1, 1))
    with pytest.raises(ValueError, match="log_clamp"):
        kl_penalty("k3", lp, lp, torch.ones(1, 2), log_clamp=0)
    with pytest.raises(RegistryError, match="unknown KL estimator 'k2'; supported: k3, k3_unbiased"):
        kl_penalty("k2", lp, lp, torch.ones(1, 2))
    assert KL_ESTIMATORS.names() == ["k3", "k3_unbiased"]
    with pytest.raises(RegistryError, match="already registered"):
        register_kl_estimator("k3")(lambda *a: None)
