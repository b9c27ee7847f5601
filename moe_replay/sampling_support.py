"""A trace's kept sets: per generated token, the tokens the sampler could draw (`SamplingSupport`, CSR).

Invariant 5 (docs/architecture.md): the sorted ids with non-zero sampling probability after
temperature / top-k / top-p / min-p, read where the engine truncates; a row of every id is kept
whole. `RolloutTrace.support` holds one (trace.py re-exports the class); the codec stores it
(codec/support.py); plans and scoring read it (replay/).

Legend: G generated tokens, N kept ids over all rows, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import TraceFormatError, Where


@dataclass
class SamplingSupport:
    """The exact set of tokens with non-zero sampling probability, per generated token, as CSR.

    Row g holds the kept token ids of generated token g, sorted ascending:
    ids_N[offsets_G1[g]:offsets_G1[g + 1]]. A row whose kept set is the whole vocabulary
    (untruncated sampling: temperature > 0, top-k off, top-p 1, no min-p, nothing masked; TRL's and
    verl's default rollout sampling) is flagged in `whole_G` and holds no ids: listing them would cost
    V ids a token (600 KB at V = 151,936). `kept(g, V)` gives any row's ids.
    """

    offsets_G1: np.ndarray
    """int64 [G + 1], offsets_G1[0] == 0, non-decreasing."""
    ids_N: np.ndarray
    """int32 [N], strictly increasing inside each row."""
    whole_G: np.ndarray | None = None
    """bool [G]: rows that keep the whole vocabulary (their CSR row is empty); None: no such row."""

    def __post_init__(self) -> None:
        if self.whole_G is not None:
            whole = np.asarray(self.whole_G, dtype=bool).reshape(-1)
            self.whole_G = whole if whole.any() else None

    @property
    def num_rows(self) -> int:
        return len(self.offsets_G1) - 1

    def row(self, g: int) -> np.ndarray:
        """Row g's ids as stored (empty for a row kept whole: `kept` lists those)."""
        return self.ids_N[self.offsets_G1[g] : self.offsets_G1[g + 1]]

    def is_whole(self, g: int) -> bool:
        return self.whole_G is not None and bool(self.whole_G[g])

    def kept(self, g: int, vocab_size: int) -> np.ndarray:
        """Row g's kept token ids, sorted (every id of the vocabulary for a row kept whole)."""
        return np.arange(vocab_size, dtype=np.int32) if self.is_whole(g) else self.row(g)

    def sizes_G(self) -> np.ndarray:
        """Ids stored per row (0 for a row kept whole: `kept_sizes_G` counts those)."""
        return np.diff(self.offsets_G1)

    def kept_sizes_G(self, vocab_size: int) -> np.ndarray:
        """Kept set size per row (the vocabulary for a row kept whole)."""
        sizes = self.sizes_G()
        return sizes if self.whole_G is None else np.where(self.whole_G, vocab_size, sizes)

    @classmethod
    def from_rows(cls, rows: list[np.ndarray] | list[list[int]], vocab_size: int | None = None) -> "SamplingSupport":
        """From each row's sorted kept ids; with `vocab_size`, a row of every id is kept whole (no ids stored)."""
        whole = np.array([vocab_size is not None and len(r) == vocab_size for r in rows], dtype=bool)
        sizes = np.array([0 if w else len(r) for r, w in zip(rows, whole)], dtype=np.int64)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        parts = [np.asarray(r, dtype=np.int32) for r, w in zip(rows, whole) if not w]
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return cls(offsets, ids.astype(np.int32), whole)

    def canonical(self, vocab_size: int) -> "SamplingSupport":
        """This support with every row listing the whole vocabulary kept whole instead (self when none
        does): one form per kept set, so supports compare by value. RolloutTrace keeps its support so."""
        full = self.sizes_G() == vocab_size
        if not full.any():
            return self
        keep_N = ~np.repeat(full, self.sizes_G())
        sizes = np.where(full, 0, self.sizes_G())
        off = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=off[1:])
        return SamplingSupport(off, self.ids_N[keep_N], self.whole_flags() | full)

    def whole_flags(self) -> np.ndarray:
        """bool [G] (all False where no row is kept whole)."""
        return np.zeros(self.num_rows, dtype=bool) if self.whole_G is None else self.whole_G

    def equals(self, other: "SamplingSupport") -> bool:
        return (np.array_equal(self.offsets_G1, other.offsets_G1) and np.array_equal(self.ids_N, other.ids_N)
                and np.array_equal(self.whole_flags(), other.whole_flags()))

    def validate(self, vocab_size: int, num_rows: int, where: Where) -> None:
        off, ids = self.offsets_G1, self.ids_N
        if off.ndim != 1 or len(off) != num_rows + 1:
            raise TraceFormatError(where.with_(field="support.offsets_G1"), f"shape [{num_rows + 1}]", list(off.shape))
        sizes_G = off[1:] - off[:-1]
        if off[0] != 0 or off[-1] != len(ids) or (sizes_G < 0).any():
            raise TraceFormatError(
                where.with_(field="support.offsets_G1"),
                f"non-decreasing offsets from 0 to len(ids_N)={len(ids)}",
                f"first={int(off[0])}, last={int(off[-1])}, decreasing={bool(np.any(np.diff(off) < 0))}",
            )
        if self.whole_G is not None:
            if self.whole_G.shape != (num_rows,):
                raise TraceFormatError(where.with_(field="support.whole_G"), f"bool [{num_rows}]", list(self.whole_G.shape))
            both = np.flatnonzero(self.whole_G & (sizes_G > 0))
            if len(both):
                g = int(both[0])
                raise TraceFormatError(where.with_(field=f"support[row {g}]"), "no stored ids in a row kept whole",
                                       f"{int(sizes_G[g])} ids")
        if len(ids):
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= vocab_size:
                raise TraceFormatError(where.with_(field="support.ids_N"), f"token ids in [0, {vocab_size})", f"range [{lo}, {hi}]")
            # ids in [0, V): id + row * V rises from any row's last id to a later row's first, so over
            # the whole CSR it rises strictly iff every row does (one pass, no row-start mask)
            key_N = ids + np.repeat(np.arange(0, num_rows * vocab_size, vocab_size, dtype=np.int64), sizes_G)
            bad = np.flatnonzero(key_N[1:] <= key_N[:-1])
            if len(bad):
                g = int(np.searchsorted(off, bad[0] + 1, side="right") - 1)
                raise TraceFormatError(
                    where.with_(field=f"support.ids_N[row {g}]"), "strictly increasing token ids", self.row(g)[:16].tolist()
                )
