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
    """uint64 [N, L, W]: each row-layer's expert set: column by column, each id's bits looked up in a table of
    E + 1 rows (the last, zero, for ids out of range) and ORed in. ~29 ns an id on one core (a reduce over
    the short last axis took 2.5x that and led the audit's comparison at 48 layers)."""
    ids = np.asarray(ids_NLK)
    table = _bit_table(num_experts)
    out = np.zeros(ids.shape[:-1] + (table.shape[1],), dtype=np.uint64)
    for k in range(ids.shape[-1]):
        col = ids[..., k]
        out |= table[np.where((col >= 0) & (col < num_experts), col, num_experts)]
    return out


_TABLES: dict[int, np.ndarray] = {}


def _bit_table(num_experts: int) -> np.ndarray:
    """uint64 [E + 1, W]: row e has bit e set (row E, for ids out of range, none)."""
    if num_experts not in _TABLES:
        table = np.zeros((num_experts + 1, num_words(num_experts)), dtype=np.uint64)
        e = np.arange(num_experts)
        table[e, e // 64] = np.left_shift(np.uint64(1), (e % 64).astype(np.uint64))
        _TABLES[num_experts] = table
    return _TABLES[num_experts]


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


def bits(mask_NLW: np.ndarray, num_experts: int) -> np.ndarray:
    """uint8 [N, L, E]: the sets as 0/1 per expert (the words' bytes unpacked, little-endian bit order)."""
    flat = np.ascontiguousarray(mask_NLW).astype("<u8", copy=False).view(np.uint8)
    return np.unpackbits(flat, axis=-1, bitorder="little")[..., :num_experts]


def expert_frequencies(mask_NLW: np.ndarray, num_experts: int, chunk: int = 4096) -> np.ndarray:
    """float [L, E]: per layer, the fraction of rows whose set holds expert e (rows unpacked `chunk` at a time)."""
    n = mask_NLW.shape[0]
    counts = np.zeros((mask_NLW.shape[1], num_experts), dtype=np.int64)
    for lo in range(0, n, chunk):
        counts += bits(mask_NLW[lo: lo + chunk], num_experts).sum(0, dtype=np.int64)
    return counts / max(n, 1)


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
    token alike wherever it stands (0.047-0.15 on the tiny models' corpus text); random ids do not
    (-0.004). None when fewer than `min_pairs` same-token pairs exist."""
    if len(tokens_N) < 2:
        return None
    _, inverse, counts = np.unique(tokens_N, return_inverse=True, return_counts=True)
    pairs = float((counts * (counts - 1) // 2).sum())
    if pairs < min_pairs:
        return None
    repeated = counts[inverse] >= 2  # only rows whose token comes again make pairs
    _, inverse, counts = np.unique(tokens_N[repeated], return_inverse=True, return_counts=True)
    rows_NLW = mask_NLW[repeated][np.argsort(inverse, kind="stable")]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    l_count = mask_NLW.shape[1]
    same = 0.0
    for layer in range(l_count):  # rows grouped by token, each group's expert counts summed in one reduceat
        bits_NE = bits(rows_NLW[:, layer: layer + 1], num_experts)[:, 0].astype(np.int32)
        per_token_E = np.add.reduceat(bits_NE, starts, axis=0).astype(np.int64)
        same += float((per_token_E * (per_token_E - 1) // 2).sum())
    same /= pairs * l_count * top_k
    f = expert_frequencies(mask_NLW, num_experts)
    chance = float((f * f).sum(-1).mean() / top_k)
    return same - chance


def chance_by_layer(ids_NLK: np.ndarray, num_experts: int, top_k: int, max_rows: int = 8192) -> np.ndarray:
    """float [L]: the agreement two unrelated tokens' rows have under this routing, per layer: sum_e f(e)^2 / K
    over the expert frequencies of the first `max_rows` rows (each f(e)^2 taken as (n f^2 - f) / (n - 1), without
    the upward bias of a few rows). ~0.3 for the tiny softmax models of 8 experts top-2; 0.43-0.88 for glm4_moe's
    sigmoid + bias grouped top-k with narrow router weights (a few experts take most tokens)."""
    ids = np.asarray(ids_NLK)[:max_rows]
    n, l_count = ids.shape[0], ids.shape[1]
    if n < 2:
        return np.zeros(l_count)
    valid = (ids >= 0) & (ids < num_experts)
    flat = (np.arange(l_count)[None, :, None] * num_experts + np.where(valid, ids, 0))[valid]
    f_LE = np.bincount(flat, minlength=l_count * num_experts).reshape(l_count, num_experts) / n
    return np.clip((n * f_LE * f_LE - f_LE) / (n - 1), 0.0, None).sum(-1) / top_k


def popcounts(mask_NLW: np.ndarray) -> np.ndarray:
    """int [N, L]: experts in each set (K for a router's top-k; fewer where an id repeats or is out of range)."""
    return np.bitwise_count(mask_NLW).sum(-1, dtype=np.int64)


def runs_ending(flag_T: np.ndarray) -> np.ndarray:
    """int [T]: how many consecutive True values end at each index (0 where False)."""
    idx = np.arange(len(flag_T))
    last_false = np.maximum.accumulate(np.where(flag_T, -1, idx)) if len(flag_T) else idx
    return idx - last_false
