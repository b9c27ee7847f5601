"""Train/inference mismatch metrics: how far the trainer's policy is from the engine that sampled.

Pure torch, masked, batched; every function returns a flat ``dict[str, float]`` ready for a
logger. Names shared with verl's ``rollout_corr_helper.py`` keep verl's ``rollout_corr/`` key and
verl's formula, so dashboards compare across projects; metrics verl does not have live under
``moe_replay/``.

Shape legend: B batch, S sequence positions, T tokens (flattened or packed), L MoE layers,
K experts per token, V vocabulary, N kept ids over all rows of a CSR sampling support.

Sign convention (verl's): the per-token log-ratio is ``log_ratio = log π_train - log π_rollout``,
so the IS weight ``ρ = exp(log_ratio)`` re-weights engine samples towards the trainer. Samples
come from the engine, so ``rollout_corr/kl = E[log π_rollout - log π_train] = -E[log_ratio]``
estimates KL(π_rollout || π_train) (k1, positive when the engine is more confident than the
trainer), and ``k3_kl = E[ρ - 1 - log ρ] >= 0`` estimates the same KL with lower variance.

Averages: "token mean" is over every valid token of the batch; "seq mean" is over sequences that
have at least one valid token, each first averaged over its own tokens (verl's per-sequence ppl).

Every ``exp`` goes through a clamp of its exponent at ``±log_clamp`` (default 20, verl's
SAFETY_BOUND), so a broken batch shows a huge finite number instead of inf/nan; only the
exponent is clamped, never a linear term (k3 of lr = -30 is ≈ 29, not the clamp's 19). Tokens
whose logprob is NaN or ±inf are left out of every statistic and counted in
``moe_replay/nonfinite_token_fraction``; a batch where every response token is such a one, or with a
logprob above 0 (beyond rounding, `LOGPROB_TOL`) on a response token, is refused with a
`LogprobInputError` naming the position and the value (`check_logprobs`, shared with the
corrections and the KL penalty). Every public entry point takes floating-point logprobs and
torch.bool masks and refuses other dtypes with an `InputDtypeError` (`check_dtypes`): integer
logprobs would give log-ratios of 0 (k3 = 0) and a float mask would count 0.5 as True. Where and why these numbers differ from verl's:
docs/corrections.md.
"""

from __future__ import annotations

import math
from typing import Callable, Literal, Mapping, Sequence

import torch

from .errors import TraceError, Where

LOG_CLAMP = 20.0
"""Default bound on exponents before exp (exp(20) ~ 4.9e8), as verl's SAFETY_BOUND."""

_SUPPORT_CHUNK_ROWS = 1024  # bounds the [rows, V] float32 scratch of the support-coverage metric

LOGPROB_TOL = 1e-4
"""Largest logprob accepted on a response token: log p <= 0 up to rounding. x - logsumexp(x) in
float32 is off by about one ulp of the (temperature-scaled) logits, 3.8e-6 at |x| = 50 and 6.1e-5 at
|x| = 512, so a float32 engine or trainer stays below 1e-4, while probabilities, negative
log-likelihoods or logits passed as logprobs hold values far above it (a mean NLL is ~0.1-1)."""

__all__ = [
    "LOG_CLAMP",
    "LOGPROB_TOL",
    "InputDtypeError",
    "LogprobInputError",
    "check_dtypes",
    "check_log_clamp",
    "check_logprobs",
    "k3_terms",
    "mismatch_metrics",
    "logprob_mismatch_metrics",
    "route_flip_metrics",
    "support_coverage_metrics",
    "normalized_ess",
]


def _finish(metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """One device->host copy for all scalar tensors instead of one `.item()` sync per metric."""
    tensor_keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if tensor_keys:
        values = torch.stack([metrics[k].detach().to(torch.float64).reshape(()) for k in tensor_keys]).cpu().tolist()
        out.update(zip(tensor_keys, values))
    return {k: out[k] for k in metrics}  # keep insertion order


class LogprobInputError(TraceError, ValueError):
    """Per-token logprobs that cannot be ones: above 0 (beyond `LOGPROB_TOL`) on a response token, a
    NaN/±inf where the caller needs every one finite, or non-finite on every response token (nothing
    is left to measure or train on: a silent 0 otherwise).

    `row`, `col` ([B, S] axes) locate the first position at fault."""

    row: int | None = None
    col: int | None = None


class InputDtypeError(TraceError, TypeError):
    """A tensor argument of a metric or a correction whose dtype cannot mean what the argument says:
    integer logprobs (every log-ratio of equal integers is 0, so k3 reads 0 with nothing said), a
    float or integer mask (0.5 and 2 would both count as True), or float expert ids."""


_DTYPE_KINDS: dict[str, tuple[Callable[[torch.dtype], bool], str, str]] = {
    # kind: (accepts, expected, why and the fix)
    "float": (lambda d: d.is_floating_point, "a floating-point torch.Tensor (float16, bfloat16, float32 or float64)",
              "integer logprobs or weights would be used as exact integers (log-ratios of 0, k3 = 0); pass the "
              "float values the model computed"),
    "bool": (lambda d: d == torch.bool, "a torch.bool mask",
             "a float or integer mask is not read as 0/1: every nonzero value (0.5, 2) would count as True; pass "
             "mask.bool() after checking its values, or mask > 0.5 for soft weights"),
    "int": (lambda d: not d.is_floating_point and not d.is_complex and d != torch.bool, "an integer torch.Tensor of expert or token ids",
            "float or bool ids would be truncated or read as 0/1"),
}


def check_dtypes(entry: str, kind: Literal["float", "bool", "int"], **tensors: object) -> None:
    """Refuse a tensor argument of public entry point `entry` whose dtype is not of `kind` (None: not
    given) with an `InputDtypeError` naming the entry, the argument, the expected and found dtype."""
    accepts, expected, why = _DTYPE_KINDS[kind]
    for name, t in tensors.items():
        if t is None or (isinstance(t, torch.Tensor) and accepts(t.dtype)):
            continue
        found = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
        raise InputDtypeError(Where(field=f"{entry}({name})"), expected, found, why)


def _logprob_error(name: str, row: int, col: int, expected: str, found: float, detail: str) -> LogprobInputError:
    err = LogprobInputError(Where(field=f"{name}[row {row}, col {col}]"), expected, found, detail)
    err.row, err.col = row, col
    return err


def _first_at(named: Mapping[str, torch.Tensor], flag_BS: torch.Tensor,
              test: Callable[[torch.Tensor], torch.Tensor]) -> tuple[str, int, int, float]:
    """(name, row, col, value) of the first position of flag_BS, in the first tensor where `test` holds."""
    r, c = (int(i) for i in flag_BS.nonzero()[0])
    for name, t_BS in named.items():
        v = t_BS[r, c]
        if bool(test(v)):
            return name, r, c, float(v)
    name, t_BS = next(iter(named.items()))
    return name, r, c, float(t_BS[r, c])


def check_logprobs(
    named: Mapping[str, torch.Tensor], mask_BS: torch.Tensor, *, nonfinite: Literal["skip", "raise"]
) -> tuple[torch.Tensor, int, int]:
    """Refuse per-token logprobs [B, S] that cannot be ones, on the positions of `mask_BS` (bool).

    A value above `LOGPROB_TOL` (+inf included) raises `LogprobInputError`. NaN/±inf: with
    ``nonfinite="raise"`` any one raises; with ``"skip"`` they are the caller's to leave out and
    count, and only a mask whose every position is non-finite raises. The error names the tensor,
    the first (row, col) and its value. One device sync for the whole check; the position is looked
    up only on failure.

    Returns (finite_BS: mask_BS and every tensor finite there, positions in mask_BS, finite ones).
    """
    finite_BS, over_BS = mask_BS, torch.zeros_like(mask_BS)
    for t_BS in named.values():
        finite_BS = finite_BS & torch.isfinite(t_BS)
        over_BS = over_BS | (t_BS > LOGPROB_TOL)
    over_BS = over_BS & mask_BS
    n_over, n_given, n_finite = torch.stack([over_BS.sum(), mask_BS.sum(), finite_BS.sum()]).tolist()
    if n_over:
        name, r, c, v = _first_at(named, over_BS, lambda x: x > LOGPROB_TOL)
        raise _logprob_error(name, r, c, f"a logprob <= 0 on response tokens (up to {LOGPROB_TOL:g} of rounding)", v,
                             f"{n_over} such tokens; probabilities, negative log-likelihoods or logits passed as logprobs?")
    if n_finite < n_given and (nonfinite == "raise" or n_finite == 0):
        name, r, c, v = _first_at(named, mask_BS & ~finite_BS, lambda x: ~torch.isfinite(x))
        if nonfinite == "raise":
            raise _logprob_error(name, r, c, "a finite logprob on every response token", v,
                                 f"{n_given - n_finite} of {n_given} response tokens are not")
        raise _logprob_error(name, r, c, "a finite logprob on at least one response token", v,
                             f"all {n_given} response tokens are NaN/inf: nothing is left to measure or train on")
    return finite_BS, n_given, n_finite


def _safe_exp(x: torch.Tensor, log_clamp: float) -> torch.Tensor:
    return torch.exp(x.clamp(-log_clamp, log_clamp))


def check_log_clamp(log_clamp: object) -> float:
    """``log_clamp`` must lie in (0, 80): 0 would report every ratio as 1 ("no mismatch") and
    e^80 ≈ 5.5e34 is the last decade below float32's overflow at e^88.7."""
    if isinstance(log_clamp, bool) or not isinstance(log_clamp, (int, float)) or not 0 < log_clamp < 80:
        raise ValueError(f"log_clamp must be a number in (0, 80) so exp stays finite in float32, got {log_clamp!r}")
    return float(log_clamp)


def k3_terms(log_ratio: torch.Tensor, log_clamp: float) -> torch.Tensor:
    """Per-token k3 = ρ - 1 - lr (>= 0), ρ = exp(lr): the low-variance estimate of KL(π_rollout || π_train).

    Only the exponent is clamped at +log_clamp, and the linear term with it there (so the term stays
    >= 0); below -log_clamp the exact value is kept up to e^-log_clamp (2e-9 at the default 20).
    """
    hi = log_ratio.clamp(max=log_clamp)
    return torch.exp(hi.clamp(min=-log_clamp)) - 1.0 - hi


def normalized_ess(log_weights: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Normalised effective sample size (Σw)² / (n Σw²) in (0, 1], computed in log space.

    Works on log-weights so that no weight is ever exponentiated: the formula only needs
    ``2·logsumexp(lw) - logsumexp(2·lw) - log n``, which is exact for any finite log-weights.
    Returns 0-d tensor; 1.0 when all weights are equal, 1/n when one weight dominates, and
    NaN for an empty selection.
    """
    check_dtypes("normalized_ess", "float", log_weights=log_weights)
    check_dtypes("normalized_ess", "bool", mask=mask)
    lw = log_weights.to(torch.float64)
    if mask is not None:
        lw = lw[mask.bool()]
    lw = lw.reshape(-1)
    n = lw.numel()
    if n == 0:
        return torch.tensor(float("nan"), dtype=torch.float64, device=lw.device)
    return torch.exp(2.0 * torch.logsumexp(lw, 0) - torch.logsumexp(2.0 * lw, 0) - math.log(n))


def _per_row_normalized_ess(log_weights_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    """Normalised ESS of each row's masked log-weights; NaN for rows without a valid token."""
    lw = log_weights_BS.to(torch.float64).masked_fill(~mask_BS, float("-inf"))
    n_B = mask_BS.sum(-1).to(torch.float64)
    ess_B = torch.exp(2.0 * torch.logsumexp(lw, -1) - torch.logsumexp(2.0 * lw, -1) - torch.log(n_B))
    return torch.where(n_B > 0, ess_B, torch.full_like(ess_B, float("nan")))


def _quantiles(x: torch.Tensor, qs: Sequence[float]) -> torch.Tensor:
    """Linear-interpolated quantiles of a 1-D tensor via one sort (torch.quantile caps n at 2^24)."""
    xs, _ = torch.sort(x.reshape(-1))
    n = xs.numel()
    pos = torch.tensor(list(qs), dtype=torch.float64, device=xs.device) * (n - 1)
    lo = pos.floor().long()
    hi = pos.ceil().long()
    frac = (pos - lo.to(torch.float64)).to(xs.dtype)
    return xs[lo] + (xs[hi] - xs[lo]) * frac


def _check_BS(name: str, x: torch.Tensor, like: torch.Tensor) -> None:
    if x.shape != like.shape:
        raise ValueError(f"{name} has shape {list(x.shape)}, expected {list(like.shape)} (same as response_mask_BS)")


def logprob_mismatch_metrics(
    train_logprobs_BS: torch.Tensor,
    rollout_logprobs_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    *,
    is_weights_BS: torch.Tensor | None = None,
    log_clamp: float = LOG_CLAMP,
) -> dict[str, float]:
    """Per-token logprob disagreement between the trainer and the engine, over response tokens.

    Args:
        train_logprobs_BS: log π_train of each sampled token (trainer's recompute).
        rollout_logprobs_BS: log π_rollout of the same tokens, as the engine reported them.
        response_mask_BS: bool, True on tokens that count (generated, not padding).
        is_weights_BS: the IS weights actually applied to the loss (e.g. after truncation, 0 on
            rejected tokens); when given, ``rollout_corr/rollout_is_eff_sample_size`` is their ESS
            over the response mask, as verl computes it. Without them that key is absent: the
            raw-ratio ESS is another quantity and has its own key, ``moe_replay/is_ess_token``.
            Each must be finite and >= 0 on response positions (else ValueError).
        log_clamp: bound on exponents before exp, in (0, 80) (else ValueError).

    Raises `InputDtypeError` (a TypeError) for integer logprobs or weights or a non-bool mask, and
    `LogprobInputError` (a ValueError) for a logprob above `LOGPROB_TOL` on a response token
    and when every response token has a NaN/±inf logprob on one side, naming the first position.

    Keys (one-line formulas; lr = log π_train - log π_rollout, ρ = exp(lr), "tok" = token mean,
    "seq" = seq mean of a per-sequence token mean):
        rollout_corr/kl               tok[log π_rollout - log π_train]  (k1 of KL(rollout||train))
        rollout_corr/k3_kl            tok[ρ - 1 - lr]  (`k3_terms`)
        rollout_corr/training_ppl     seq[exp(-mean_t log π_train)]
        rollout_corr/training_log_ppl seq[-mean_t log π_train]
        rollout_corr/rollout_ppl      seq[exp(-mean_t log π_rollout)]
        rollout_corr/rollout_log_ppl  seq[-mean_t log π_rollout]
        rollout_corr/log_ppl_diff     seq[d], d = mean_t log π_rollout - mean_t log π_train
        rollout_corr/log_ppl_abs_diff seq[|d|]; log_ppl_diff_max / _min: max / min over seqs of d
        rollout_corr/ppl_ratio        seq[exp(d)] = seq[training ppl / rollout ppl]
        rollout_corr/chi2_token       tok[ρ²] - 1
        rollout_corr/chi2_seq         seq-average of exp(2 Σ_t lr) - 1  (Π_t ρ_t squared; verl clamps
                                      Σ_t lr, not 2 Σ_t lr, at ±log_clamp, so it can reach e^40)
        rollout_corr/rollout_is_eff_sample_size  1 / mean((w / mean w)²) over response tokens, w =
                                      is_weights_BS (verl's formula); only when they are given
        rollout_corr/rollout_is_{mean,max,min,std}  of those w over response tokens (verl's names;
                                      with them)
        moe_replay/is_ess_token       (Σρ)² / (n Σρ²) over tokens, of the raw ratios ρ
        moe_replay/is_ess_seq         same ESS over sequence weights exp(Σ_t lr), one per sequence
        moe_replay/is_ess_token_per_seq  seq-average of the token-weight ESS inside each sequence
        moe_replay/abs_logprob_diff_{mean,max,p50,p90,p99}  stats of |lr| over tokens
        moe_replay/prob_pearson       Pearson corr. of exp(log π_train) and exp(log π_rollout)
                                      over tokens (NaN when either is constant)
        moe_replay/response_tokens    number of valid tokens counted
        moe_replay/nonfinite_token_fraction  fraction of masked tokens with a NaN/inf logprob
    """
    entry = "logprob_mismatch_metrics"
    check_dtypes(entry, "float", train_logprobs_BS=train_logprobs_BS, rollout_logprobs_BS=rollout_logprobs_BS,
                 is_weights_BS=is_weights_BS)
    check_dtypes(entry, "bool", response_mask_BS=response_mask_BS)
    if train_logprobs_BS.dim() != 2:
        raise ValueError(f"train_logprobs_BS must be [B, S], got shape {list(train_logprobs_BS.shape)}")
    _check_BS("train_logprobs_BS", train_logprobs_BS, response_mask_BS)
    _check_BS("rollout_logprobs_BS", rollout_logprobs_BS, response_mask_BS)
    if is_weights_BS is not None:
        _check_BS("is_weights_BS", is_weights_BS, response_mask_BS)
    log_clamp = check_log_clamp(log_clamp)

    train = train_logprobs_BS.detach().to(torch.float64)
    rollout = rollout_logprobs_BS.detach().to(device=train.device, dtype=torch.float64)
    given_BS = response_mask_BS.bool().to(train.device)
    mask_BS, n_given, n_tok = check_logprobs(
        {"train_logprobs_BS": train, "rollout_logprobs_BS": rollout}, given_BS, nonfinite="skip"
    )
    if n_given == 0:
        raise ValueError(f"response_mask_BS selects no token (shape {list(given_BS.shape)})")
    # Zero the unused positions so NaN/inf there can never leak through a multiply-by-mask.
    zero = torch.zeros((), dtype=torch.float64, device=train.device)
    train = torch.where(mask_BS, train, zero)
    rollout = torch.where(mask_BS, rollout, zero)
    lr_BS = train - rollout
    maskf_BS = mask_BS.to(torch.float64)
    n_tok_f = torch.tensor(float(n_tok), dtype=torch.float64, device=train.device)

    def tok_mean(x_BS: torch.Tensor) -> torch.Tensor:
        return (x_BS * maskf_BS).sum() / n_tok_f

    len_B = maskf_BS.sum(-1)
    seq_ok_B = len_B > 0
    n_seq = seq_ok_B.sum().to(torch.float64)

    def seq_mean(x_B: torch.Tensor) -> torch.Tensor:
        return torch.where(seq_ok_B, x_B, zero).sum() / n_seq

    safe_len_B = len_B.clamp_min(1.0)
    mean_train_B = (train * maskf_BS).sum(-1) / safe_len_B
    mean_rollout_B = (rollout * maskf_BS).sum(-1) / safe_len_B
    d_B = mean_rollout_B - mean_train_B
    lr_clamped_BS = lr_BS.clamp(-log_clamp, log_clamp)
    rho_BS = torch.exp(lr_clamped_BS)
    seq_lr_B = (lr_BS * maskf_BS).sum(-1)
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=train.device)
    pos_inf = torch.tensor(float("inf"), dtype=torch.float64, device=train.device)

    m: dict[str, torch.Tensor | float] = {}
    m["rollout_corr/kl"] = tok_mean(rollout - train)
    m["rollout_corr/k3_kl"] = tok_mean(k3_terms(lr_BS, log_clamp))
    m["rollout_corr/training_ppl"] = seq_mean(_safe_exp(-mean_train_B, log_clamp))
    m["rollout_corr/training_log_ppl"] = seq_mean(-mean_train_B)
    m["rollout_corr/rollout_ppl"] = seq_mean(_safe_exp(-mean_rollout_B, log_clamp))
    m["rollout_corr/rollout_log_ppl"] = seq_mean(-mean_rollout_B)
    m["rollout_corr/log_ppl_diff"] = seq_mean(d_B)
    m["rollout_corr/log_ppl_abs_diff"] = seq_mean(d_B.abs())
    m["rollout_corr/log_ppl_diff_max"] = torch.where(seq_ok_B, d_B, neg_inf).max()
    m["rollout_corr/log_ppl_diff_min"] = torch.where(seq_ok_B, d_B, pos_inf).min()
    m["rollout_corr/ppl_ratio"] = seq_mean(_safe_exp(d_B, log_clamp))
    m["rollout_corr/chi2_token"] = tok_mean(rho_BS.square()) - 1.0
    m["rollout_corr/chi2_seq"] = seq_mean(torch.exp(2.0 * seq_lr_B.clamp(-log_clamp, log_clamp))) - 1.0

    if is_weights_BS is not None:
        w_valid = is_weights_BS.detach().to(device=train.device, dtype=torch.float64)[given_BS]
        bad = ~(torch.isfinite(w_valid) & (w_valid >= 0))
        if bool(bad.any()):
            first = given_BS.nonzero()[int(bad.nonzero()[0])].tolist()
            raise ValueError(
                f"is_weights_BS must be finite and >= 0 on response tokens; {int(bad.sum())} are not, "
                f"the first at position {first} holds {float(w_valid[bad][0])!r}"
            )
        mean_w = w_valid.mean()
        # verl's formula on the applied weights: 1 / mean((w / mean w)²), over the response mask
        m["rollout_corr/rollout_is_eff_sample_size"] = 1.0 / ((w_valid / (mean_w + 1e-8)).square().mean())
        # verl's token-level summary of the applied weights (rollout_corr_helper: mean, max, min, std)
        m["rollout_corr/rollout_is_mean"] = mean_w
        m["rollout_corr/rollout_is_max"] = w_valid.max()
        m["rollout_corr/rollout_is_min"] = w_valid.min()
        m["rollout_corr/rollout_is_std"] = (w_valid.square().mean() - mean_w.square()).clamp(min=0.0).sqrt()
    m["moe_replay/is_ess_token"] = normalized_ess(lr_BS, mask_BS)
    m["moe_replay/is_ess_seq"] = normalized_ess(seq_lr_B, seq_ok_B)
    ess_B = _per_row_normalized_ess(lr_BS, mask_BS)
    m["moe_replay/is_ess_token_per_seq"] = seq_mean(torch.nan_to_num(ess_B, nan=0.0))

    abs_diff_T = lr_BS[mask_BS].abs()
    m["moe_replay/abs_logprob_diff_mean"] = abs_diff_T.mean()
    m["moe_replay/abs_logprob_diff_max"] = abs_diff_T.max()
    p50, p90, p99 = _quantiles(abs_diff_T, (0.5, 0.9, 0.99)).unbind()
    m["moe_replay/abs_logprob_diff_p50"] = p50
    m["moe_replay/abs_logprob_diff_p90"] = p90
    m["moe_replay/abs_logprob_diff_p99"] = p99

    p_train_T = torch.exp(train[mask_BS])
    p_rollout_T = torch.exp(rollout[mask_BS])
    dt_T = p_train_T - p_train_T.mean()
    dr_T = p_rollout_T - p_rollout_T.mean()
    denom = torch.sqrt(dt_T.square().sum() * dr_T.square().sum())
    m["moe_replay/prob_pearson"] = torch.where(
        denom > 0, (dt_T * dr_T).sum() / denom.clamp_min(1e-300), torch.full_like(denom, float("nan"))
    )
    m["moe_replay/response_tokens"] = n_tok_f
    m["moe_replay/nonfinite_token_fraction"] = (n_given - n_tok) / n_given
    return _finish(m)


def route_flip_metrics(
    train_routes: torch.Tensor,
    trace_routes: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    layer_ids: Sequence[int] | None = None,
) -> dict[str, float]:
    """How often the trainer's own (free, unreplayed) router picks other experts than the engine.

    Args:
        train_routes: expert ids the trainer's router chose, [B, S, L, K] or [T, L, K].
        trace_routes: expert ids recorded from the engine, same shape.
        mask: bool [B, S] or [T]; True on positions that count. None counts every position.
        layer_ids: global layer id of each of the L columns (``geometry.moe_layer_ids``), used
            in the per-layer keys so a dense first layer does not shift every name; default 0..L-1.

    A token-layer *flips* when its expert SET differs; same set in another column order is not a
    flip (the replayed expert set is the same) but changes the bf16 accumulation order, so it is
    reported on its own. Keys:
        moe_replay/route_flip_rate                 mean over token-layers of [set differs]
        moe_replay/route_flip_token_rate           mean over tokens of [any layer's set differs]
        moe_replay/route_order_mismatch_rate       mean over token-layers of [same set, other order]
        moe_replay/route_expert_overlap            mean over token-layers of |A ∩ B| / K
        moe_replay/route_flip_rate_max_layer       max over layers of the per-layer flip rate
        moe_replay/route_flip_rate/layer_{id}      per layer: mean over tokens of [set differs]
        moe_replay/route_order_mismatch_rate/layer_{id}  per layer: [same set, other order]
        moe_replay/route_tokens                    number of tokens counted
    """
    check_dtypes("route_flip_metrics", "int", train_routes=train_routes, trace_routes=trace_routes)
    check_dtypes("route_flip_metrics", "bool", mask=mask)
    if train_routes.shape != trace_routes.shape:
        raise ValueError(
            f"train_routes shape {list(train_routes.shape)} != trace_routes shape {list(trace_routes.shape)}"
        )
    if train_routes.dim() not in (3, 4):
        raise ValueError(f"routes must be [B, S, L, K] or [T, L, K], got shape {list(train_routes.shape)}")
    L, K = train_routes.shape[-2], train_routes.shape[-1]
    lead = train_routes.shape[:-2]
    if mask is not None and tuple(mask.shape) != tuple(lead):
        raise ValueError(f"mask has shape {list(mask.shape)}, expected {list(lead)} (routes' leading dims)")
    if layer_ids is None:
        layer_ids = list(range(L))
    elif len(layer_ids) != L:
        raise ValueError(f"layer_ids has {len(layer_ids)} entries, routes have L={L} layers")

    a_TLK = train_routes.reshape(-1, L, K).long()
    b_TLK = trace_routes.reshape(-1, L, K).long().to(a_TLK.device)
    if mask is not None:
        keep_T = mask.reshape(-1).bool().to(a_TLK.device)
        a_TLK, b_TLK = a_TLK[keep_T], b_TLK[keep_T]
    n_tok = a_TLK.shape[0]
    if n_tok == 0:
        raise ValueError("route mask selects no token")

    same_order_TL = (a_TLK == b_TLK).all(-1)
    same_set_TL = (torch.sort(a_TLK, -1).values == torch.sort(b_TLK, -1).values).all(-1)
    flip_TL = (~same_set_TL).to(torch.float64)
    order_TL = (same_set_TL & ~same_order_TL).to(torch.float64)
    overlap_TL = (a_TLK[..., :, None] == b_TLK[..., None, :]).any(-1).sum(-1).to(torch.float64) / K
    flip_L = flip_TL.mean(0)
    order_L = order_TL.mean(0)

    m: dict[str, torch.Tensor | float] = {
        "moe_replay/route_flip_rate": flip_TL.mean(),
        "moe_replay/route_flip_token_rate": (flip_TL > 0).any(-1).to(torch.float64).mean(),
        "moe_replay/route_order_mismatch_rate": order_TL.mean(),
        "moe_replay/route_expert_overlap": overlap_TL.mean(),
        "moe_replay/route_flip_rate_max_layer": flip_L.max(),
    }
    for j, lid in enumerate(layer_ids):
        m[f"moe_replay/route_flip_rate/layer_{int(lid)}"] = flip_L[j]
    for j, lid in enumerate(layer_ids):
        m[f"moe_replay/route_order_mismatch_rate/layer_{int(lid)}"] = order_L[j]
    m["moe_replay/route_tokens"] = float(n_tok)
    return _finish(m)


def _support_mass_rows(
    train_logits_TV: torch.Tensor,
    support_TV: torch.Tensor | None,
    offsets_T1: torch.Tensor | None,
    ids_N: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: trainer probability mass on the kept ids, and the number of kept ids (float64)."""
    T, V = train_logits_TV.shape
    device = train_logits_TV.device
    mass_T = torch.zeros(T, dtype=torch.float64, device=device)
    if support_TV is not None:
        sizes_T = support_TV.bool().sum(-1).to(torch.float64)
    else:
        sizes_T = (offsets_T1[1:] - offsets_T1[:-1]).to(torch.float64)
        rows_N = torch.repeat_interleave(torch.arange(T, device=device), (offsets_T1[1:] - offsets_T1[:-1]))
    for start in range(0, T, _SUPPORT_CHUNK_ROWS):
        stop = min(start + _SUPPORT_CHUNK_ROWS, T)
        logp_CV = torch.log_softmax(train_logits_TV[start:stop].detach().float(), dim=-1)
        if support_TV is not None:
            keep_CV = support_TV[start:stop].bool()
            mass_T[start:stop] = torch.where(keep_CV, logp_CV.exp(), torch.zeros((), device=device)).sum(-1).double()
        else:
            lo, hi = int(offsets_T1[start]), int(offsets_T1[stop])
            r_N = rows_N[lo:hi] - start
            p_N = logp_CV[r_N, ids_N[lo:hi]].double().exp()
            mass_T[start:stop].index_add_(0, r_N, p_N)
    return mass_T.clamp(0.0, 1.0), sizes_T


def support_coverage_metrics(
    train_logits_TV: torch.Tensor,
    *,
    support_TV: torch.Tensor | None = None,
    support_offsets_T1: torch.Tensor | None = None,
    support_ids_N: torch.Tensor | None = None,
    row_mask_T: torch.Tensor | None = None,
) -> dict[str, float]:
    """How much of the trainer's probability mass lies inside the engine's sampling support.

    A keep-sampling-mask trainer renormalises over the kept set, shifting every logprob by
    ``-log coverage``; without the mask, the trainer's ratio includes mass the engine could
    never sample. Give the support either as a boolean ``support_TV`` or as the trace's CSR
    (``support_offsets_T1`` int [T + 1], ``support_ids_N`` int [N]; row t keeps
    ids_N[offsets[t]:offsets[t + 1]]). Logits are log-softmaxed (logprobs pass unchanged), in
    row chunks so no [T, V] float64 copy is made.

    Keys (c_t = Σ_{v kept at t} softmax(train_logits_t)_v, over rows in row_mask_T):
        moe_replay/support_coverage_mean          mean_t c_t
        moe_replay/support_coverage_min           min_t c_t
        moe_replay/support_neg_log_coverage_mean  mean_t -log c_t (the renormalisation shift)
        moe_replay/support_size_mean              mean_t |kept set at t|
    """
    entry = "support_coverage_metrics"
    check_dtypes(entry, "float", train_logits_TV=train_logits_TV)
    check_dtypes(entry, "bool", support_TV=support_TV, row_mask_T=row_mask_T)
    if train_logits_TV.dim() != 2:
        raise ValueError(f"train_logits_TV must be [T, V], got shape {list(train_logits_TV.shape)}")
    T, V = train_logits_TV.shape
    device = train_logits_TV.device
    if (support_TV is None) == (support_offsets_T1 is None or support_ids_N is None):
        raise ValueError("give either support_TV, or both support_offsets_T1 and support_ids_N")
    offsets_T1 = ids_N = None
    if support_TV is not None:
        if tuple(support_TV.shape) != (T, V):
            raise ValueError(f"support_TV has shape {list(support_TV.shape)}, expected [{T}, {V}]")
        support_TV = support_TV.to(device)
    else:
        offsets_T1 = torch.as_tensor(support_offsets_T1, device=device)
        ids_N = torch.as_tensor(support_ids_N, device=device)
        check_dtypes(entry, "int", support_offsets_T1=offsets_T1, support_ids_N=ids_N)
        offsets_T1, ids_N = offsets_T1.long(), ids_N.long()
        if offsets_T1.shape != (T + 1,):
            raise ValueError(f"support_offsets_T1 has shape {list(offsets_T1.shape)}, expected [{T + 1}]")
        if int(offsets_T1[0]) != 0 or int(offsets_T1[-1]) != ids_N.numel() or bool((offsets_T1.diff() < 0).any()):
            raise ValueError(
                f"support_offsets_T1 must rise from 0 to len(support_ids_N)={ids_N.numel()}, "
                f"got first={int(offsets_T1[0])}, last={int(offsets_T1[-1])}"
            )
        if ids_N.numel() and (int(ids_N.min()) < 0 or int(ids_N.max()) >= V):
            raise ValueError(f"support_ids_N must lie in [0, {V}), got [{int(ids_N.min())}, {int(ids_N.max())}]")
    if row_mask_T is not None and tuple(row_mask_T.shape) != (T,):
        raise ValueError(f"row_mask_T has shape {list(row_mask_T.shape)}, expected [{T}]")
    rows_T = torch.ones(T, dtype=torch.bool, device=device) if row_mask_T is None else row_mask_T.bool().to(device)
    if int(rows_T.sum()) == 0:
        raise ValueError("row_mask_T selects no row")
    mass_T, sizes_T = _support_mass_rows(train_logits_TV, support_TV, offsets_T1, ids_N)
    c_R = mass_T[rows_T]
    m: dict[str, torch.Tensor | float] = {
        "moe_replay/support_coverage_mean": c_R.mean(),
        "moe_replay/support_coverage_min": c_R.min(),
        "moe_replay/support_neg_log_coverage_mean": (-torch.log(c_R.clamp_min(1e-300))).mean(),
        "moe_replay/support_size_mean": sizes_T[rows_T].mean(),
    }
    return _finish(m)


def mismatch_metrics(
    train_logprobs_BS: torch.Tensor,
    rollout_logprobs_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    *,
    is_weights_BS: torch.Tensor | None = None,
    train_routes: torch.Tensor | None = None,
    trace_routes: torch.Tensor | None = None,
    route_mask: torch.Tensor | None = None,
    layer_ids: Sequence[int] | None = None,
    train_logits_TV: torch.Tensor | None = None,
    support_TV: torch.Tensor | None = None,
    support_offsets_T1: torch.Tensor | None = None,
    support_ids_N: torch.Tensor | None = None,
    support_row_mask_T: torch.Tensor | None = None,
    log_clamp: float = LOG_CLAMP,
) -> dict[str, float]:
    """All mismatch metrics in one flat dict: logprob metrics always; route flips when both route
    tensors are given; support coverage when trainer logits and a support are given.

    See `logprob_mismatch_metrics`, `route_flip_metrics` and `support_coverage_metrics` for the
    keys and their formulas.
    """
    entry = "mismatch_metrics"  # checked here too, so the error names the function the caller called
    check_dtypes(entry, "float", train_logprobs_BS=train_logprobs_BS, rollout_logprobs_BS=rollout_logprobs_BS,
                 is_weights_BS=is_weights_BS, train_logits_TV=train_logits_TV)
    check_dtypes(entry, "bool", response_mask_BS=response_mask_BS, route_mask=route_mask, support_TV=support_TV,
                 support_row_mask_T=support_row_mask_T)
    check_dtypes(entry, "int", train_routes=train_routes, trace_routes=trace_routes)
    if (train_routes is None) != (trace_routes is None):
        raise ValueError("route flip metrics need both train_routes and trace_routes")
    out = logprob_mismatch_metrics(
        train_logprobs_BS, rollout_logprobs_BS, response_mask_BS, is_weights_BS=is_weights_BS, log_clamp=log_clamp
    )
    if train_routes is not None:
        out.update(route_flip_metrics(train_routes, trace_routes, route_mask, layer_ids=layer_ids))
    if train_logits_TV is not None:
        out.update(
            support_coverage_metrics(
                train_logits_TV,
                support_TV=support_TV,
                support_offsets_T1=support_offsets_T1,
                support_ids_N=support_ids_N,
                row_mask_T=support_row_mask_T,
            )
        )
    return out
