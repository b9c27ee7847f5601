"""Expert sets as bit masks, and the agreements the audit is made of.

A row's experts at one layer become W = ceil(E / 64) 64-bit words with bit e set for expert e (ids out
of [0, E) set nothing; a repeated id sets one bit), so the agreement of two rows is a popcount of their
AND, column order ignored, and equal sets are equal words. Why masks: a [T, L, K] x [T, L, K] set
comparison costs K^2 compares per token-layer (64 at top-8) where the masks cost W popcounts (2 at
128 experts).

Legend: N rows, L layers, K top-k, E experts, W words per set.
"""

from __future__ import annotations

import numpy as np

_MIX = np.uint64(0x9E3779B97F4A7C15)


def num_words(num_experts: int) -> int:
    return max(1, -(-int(num_experts) // 64))


def masks(ids_NLK: np.ndarray, num_experts: int) -> np.ndarray:
    """uint64 [N, L, W]: each row-layer's expert set."""
    ids = np.asarray(ids_NLK, dtype=np.int64)
    w_count = num_words(num_experts)
    out = np.zeros(ids.shape[:-1] + (w_count,), dtype=np.uint64)
    valid = (ids >= 0) & (ids < num_experts)
    bit = np.left_shift(np.uint64(1), (ids % 64).astype(np.uint64))
    word = ids // 64
    for w in range(w_count):
        sel = valid & (word == w)
        out[..., w] = np.bitwise_or.reduce(np.where(sel, bit, np.uint64(0)), axis=-1)
    return out


def overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """int [...]: experts two masks [..., W] share."""
    return np.bitwise_count(a & b).sum(-1, dtype=np.int64)


def codes(mask_NLW: np.ndarray) -> np.ndarray:
    """uint64 [N, L]: one code per expert set (equal sets, equal codes; unequal ones collide with
    probability ~2^-64, never for W = 1)."""
    code = mask_NLW[..., 0].copy()
    for w in range(1, mask_NLW.shape[-1]):
        code = (code * _MIX) ^ mask_NLW[..., w]
    return code


def expert_frequencies(mask_NLW: np.ndarray, num_experts: int) -> np.ndarray:
    """float [L, E]: per layer, the fraction of rows whose set holds expert e."""
    n = max(mask_NLW.shape[0], 1)
    e_idx = np.arange(num_experts)
    bits_NLE = (mask_NLW[..., e_idx // 64] >> (e_idx % 64).astype(np.uint64)) & np.uint64(1)
    return bits_NLE.sum(0, dtype=np.float64) / n


def chance_agreement(given_NLW: np.ndarray, own_NLW: np.ndarray, num_experts: int, top_k: int) -> float:
    """Mean agreement two independent routings with these per-layer expert frequencies would have:
    sum_e f_given(e) f_own(e) / K, averaged over layers (K / E when both are uniform)."""
    if not len(given_NLW) or not len(own_NLW):
        return 0.0
    f_g, f_o = expert_frequencies(given_NLW, num_experts), expert_frequencies(own_NLW, num_experts)
    return float((f_g * f_o).sum(-1).mean() / top_k)


def token_consistency(mask_NLW: np.ndarray, tokens_N: np.ndarray, num_experts: int, top_k: int,
                      min_pairs: int = 32) -> float | None:
    """How much more rows of one token id agree than chance: mean agreement over pairs of rows with the
    same token (per layer) minus the agreement of random pairs (sum_e f(e)^2 / K). Real routers route a
    token alike wherever it stands (0.25-0.6 on the tiny models); random ids do not (0.00 +- 0.02).
    None when fewer than `min_pairs` same-token pairs exist."""
    if len(tokens_N) < 2:
        return None
    _, inverse, counts = np.unique(tokens_N, return_inverse=True, return_counts=True)
    pairs = float((counts * (counts - 1) // 2).sum())
    if pairs < min_pairs:
        return None
    n, l_count = mask_NLW.shape[:2]
    e_idx = np.arange(num_experts)
    same = 0.0
    for layer in range(l_count):
        bits_NE = ((mask_NLW[:, layer, e_idx // 64] >> (e_idx % 64).astype(np.uint64)) & np.uint64(1)).astype(np.int64)
        per_token_E = np.zeros((len(counts), num_experts), dtype=np.int64)
        np.add.at(per_token_E, inverse, bits_NE)
        same += float((per_token_E * (per_token_E - 1) // 2).sum())
    same /= pairs * l_count * top_k
    f = expert_frequencies(mask_NLW, num_experts)
    chance = float((f * f).sum(-1).mean() / top_k)
    return same - chance
