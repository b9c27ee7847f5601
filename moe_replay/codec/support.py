"""Sampling-support codec: CSR rows of sorted kept token ids <-> bytes.

Each row is stored as its size and the gaps between consecutive kept ids (first id, then
id - prev - 1), as varints, then deflated; top-p keeps mostly the highest-probability tokens,
which are spread over the vocabulary, so gaps are small numbers that code in ~1-2 bytes, and
runs of adjacent ids (gap 0) shrink further under deflate. A row that keeps more than half the
vocabulary (top_p=1 and no top-k keeps all of it) stores its complement instead, so an
untruncated row costs a few bytes rather than V ids. A row kept whole (`SamplingSupport.whole_G`)
is stored as such a row whose complement is empty, and such a stored row decodes to a row kept
whole, never to V ids: the bytes are those of a full row in every format so far.
"""

from __future__ import annotations

import numpy as np

from ..trace import SamplingSupport
from . import entropy, varint

_COMPLEMENT_CHUNK_ROWS = 64  # bounds the [rows, V] scratch mask used to complement wide rows


def _complement_rows(offsets_G1: np.ndarray, ids_N: np.ndarray, rows: np.ndarray, vocab_size: int) -> list[np.ndarray]:
    out = []
    for c in range(0, len(rows), _COMPLEMENT_CHUNK_ROWS):
        chunk = rows[c : c + _COMPLEMENT_CHUNK_ROWS]
        keep_RV = np.ones((len(chunk), vocab_size), dtype=bool)
        for i, g in enumerate(chunk):
            keep_RV[i, ids_N[offsets_G1[g] : offsets_G1[g + 1]]] = False
        r, v = np.nonzero(keep_RV)
        out += np.split(v.astype(np.int64), np.searchsorted(r, np.arange(1, len(chunk))))
    return out


def _gaps(offsets_G1: np.ndarray, ids_N: np.ndarray) -> np.ndarray:
    ids = ids_N.astype(np.int64)
    gaps = np.empty_like(ids)
    if len(ids):
        gaps[0] = ids[0]
        gaps[1:] = ids[1:] - ids[:-1] - 1
        starts = offsets_G1[:-1][np.diff(offsets_G1) > 0]
        gaps[starts] = ids[starts]
    return gaps


def _ungap(sizes_G: np.ndarray, gaps_N: np.ndarray) -> np.ndarray:
    """Inverse of _gaps: a cumulative sum that restarts at every row."""
    offsets = np.zeros(len(sizes_G) + 1, dtype=np.int64)
    np.cumsum(sizes_G, out=offsets[1:])
    plus = gaps_N.astype(np.int64) + 1
    csum = np.cumsum(plus)
    starts = offsets[:-1][sizes_G > 0]
    base = np.zeros(len(plus), dtype=np.int64)
    if len(starts):
        # subtract, from each row, the running total accumulated before it
        before = np.where(starts > 0, csum[np.maximum(starts - 1, 0)], 0)
        base[starts] = np.diff(np.concatenate([[0], before]))
        base = np.cumsum(base)
    return csum - base - 1


def encode(support: SamplingSupport, vocab_size: int) -> tuple[bytes, dict]:
    off, ids = support.offsets_G1.astype(np.int64), support.ids_N
    sizes = np.diff(off)
    whole = support.whole_flags()
    wide = np.flatnonzero((sizes > vocab_size // 2) | whole)
    if len(wide):
        rows = [ids[off[g] : off[g + 1]].astype(np.int64) for g in range(len(sizes))]
        listed = wide[~whole[wide]]  # wide rows with ids: their complement; rows kept whole: nothing
        for g, comp in zip(listed, _complement_rows(off, ids, listed, vocab_size)):
            rows[g] = comp
        stored = SamplingSupport.from_rows(rows)
        off, ids = stored.offsets_G1, stored.ids_N
    stored_sizes = np.diff(off)
    flags = np.zeros(len(sizes), dtype=np.uint8)
    flags[wide] = 1
    sizes_b = varint.encode(stored_sizes)
    gaps_b = varint.encode(_gaps(off, ids))
    flags_b = np.packbits(flags).tobytes()
    raw = sizes_b + gaps_b + flags_b
    params = {"rows": int(len(sizes)), "sizes_len": len(sizes_b), "gaps_len": len(gaps_b), "raw_len": len(raw)}
    return entropy.compress([raw], "default", level=1), params


def decode(data: bytes, vocab_size: int, params: dict) -> SamplingSupport:
    """Inverse of encode; ValueError on anything inconsistent."""
    rows, sizes_len, gaps_len, raw_len = (int(params[k]) for k in ("rows", "sizes_len", "gaps_len", "raw_len"))
    raw = np.frombuffer(entropy.decompress(data, raw_len), dtype=np.uint8)
    flags_len = (rows + 7) // 8
    if sizes_len + gaps_len + flags_len != raw_len or min(rows, sizes_len, gaps_len) < 0:
        raise ValueError(f"support sections: expected {raw_len} bytes, found {sizes_len}+{gaps_len}+{flags_len}")
    stored_sizes = varint.decode(raw[:sizes_len], count=rows).astype(np.int64)
    if stored_sizes.size and stored_sizes.max() > vocab_size:
        raise ValueError(f"support row size: expected <= vocab {vocab_size}, found {int(stored_sizes.max())}")
    total = int(stored_sizes.sum())
    gaps = varint.decode(raw[sizes_len : sizes_len + gaps_len], count=total)
    if gaps.size and gaps.max() >= vocab_size:
        raise ValueError(f"support gap: expected < vocab {vocab_size}, found {int(gaps.max())}")
    ids = _ungap(stored_sizes, gaps)
    if ids.size and ids.max() >= vocab_size:
        raise ValueError(f"support token id: expected < vocab {vocab_size}, found {int(ids.max())}")
    flags = np.unpackbits(raw[sizes_len + gaps_len :])[:rows].astype(bool)
    off = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(stored_sizes, out=off[1:])
    whole = flags & (stored_sizes == 0)  # the complement of nothing: every id kept
    listed = np.flatnonzero(flags & ~whole)
    if len(listed) or whole.any():
        parts = [ids[off[g] : off[g + 1]] for g in range(rows)]
        for g, c in zip(listed, _complement_rows(off, ids, listed, vocab_size)):
            parts[g] = c
        for g in np.flatnonzero(whole):
            parts[g] = ids[:0]
        out = SamplingSupport.from_rows(parts)
        return SamplingSupport(out.offsets_G1, out.ids_N, whole)
    return SamplingSupport(off, ids.astype(np.int32))
