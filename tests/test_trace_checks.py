"""The trace's array checks (distinct expert ids per row, expert range, CSR kept sets) refuse
exactly what a plain per-row reading refuses, and name the same first bad place.

The checks are written for speed (capture validates every collected trace: column shifts instead
of a sort per row, one rising key instead of a row-start mask), so each is compared here with the
obvious reading on random arrays with defects planted at random places.
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_replay.errors import ExpertIdOutOfRangeError, TraceFormatError, Where
from moe_replay.trace import SamplingSupport, check_distinct_rows, check_expert_range

W = Where(record="r", field="routes_TLK")


def first_repeat(routes_TLK: np.ndarray) -> tuple[int, int] | None:
    """(t, l) of the first row holding an expert twice, read row by row."""
    for t in range(routes_TLK.shape[0]):
        for l in range(routes_TLK.shape[1]):
            row = routes_TLK[t, l].tolist()
            if len(set(row)) < len(row):
                return t, l
    return None


def first_unsorted_row(offsets: list[int], ids: list[int]) -> int | None:
    for g in range(len(offsets) - 1):
        row = ids[offsets[g]:offsets[g + 1]]
        if any(b <= a for a, b in zip(row, row[1:])):
            return g
    return None


@pytest.mark.parametrize("seed", range(40))
def test_distinct_rows_refuses_what_a_row_reading_refuses(seed):
    rng = np.random.default_rng(seed)
    T, L, K, E = int(rng.integers(1, 30)), int(rng.integers(1, 5)), int(rng.integers(1, 7)), 16
    dtype = rng.choice([np.uint8, np.int16, np.int64])
    routes = np.argsort(rng.random((T, L, E)), axis=-1)[..., :K].astype(dtype)
    for _ in range(int(rng.integers(0, 3))):  # plant repeats (or none)
        t, l = int(rng.integers(T)), int(rng.integers(L))
        if K > 1:
            i, j = rng.choice(K, 2, replace=False)
            routes[t, l, i] = routes[t, l, j]
    if seed % 3 == 0:
        routes = routes.transpose(1, 0, 2).copy().transpose(1, 0, 2)  # a non-contiguous array reads alike
    want = first_repeat(routes)
    if want is None:
        check_distinct_rows(routes, W)
        return
    with pytest.raises(TraceFormatError, match=rf"routes_TLK\[{want[0]}, {want[1]}\].*distinct expert ids"):
        check_distinct_rows(routes, W)


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int64])
def test_expert_range_names_the_first_bad_id(dtype):
    routes = np.zeros((5, 3, 2), dtype=dtype)
    routes[..., 1] = 1
    check_expert_range(routes, 8, W)
    routes[3, 2, 1] = 8
    with pytest.raises(ExpertIdOutOfRangeError, match=r"routes_TLK\[3, 2, 1\].*found 8"):
        check_expert_range(routes, 8, W)
    if np.dtype(dtype).kind == "i":
        routes[1, 0, 0] = -1
        with pytest.raises(ExpertIdOutOfRangeError, match=r"routes_TLK\[1, 0, 0\].*found -1"):
            check_expert_range(routes, 8, W)


@pytest.mark.parametrize("seed", range(40))
def test_support_refuses_what_a_row_reading_refuses(seed):
    rng = np.random.default_rng(100 + seed)
    V, G = 50, int(rng.integers(1, 12))
    rows = [np.sort(rng.choice(V, int(rng.integers(0, 6)), replace=False)).tolist() for _ in range(G)]
    for _ in range(int(rng.integers(0, 3))):  # plant an unsorted or repeated id (or none)
        g = int(rng.integers(G))
        if len(rows[g]) >= 2:
            i = int(rng.integers(1, len(rows[g])))
            rows[g][i] = rows[g][i - 1] if rng.random() < 0.5 else max(rows[g][i - 1] - 1, 0)
    sup = SamplingSupport.from_rows(rows)
    want = first_unsorted_row(sup.offsets_G1.tolist(), sup.ids_N.tolist())
    if want is None:
        sup.validate(V, G, Where(record="r"))
        return
    with pytest.raises(TraceFormatError, match=rf"support.ids_N\[row {want}\].*strictly increasing"):
        sup.validate(V, G, Where(record="r"))


def test_support_refuses_bad_offsets_and_ids():
    ok = SamplingSupport(np.array([0, 2, 2, 3]), np.array([1, 4, 0], dtype=np.int32))
    ok.validate(5, 3, Where())
    with pytest.raises(TraceFormatError, match=r"shape \[3\]"):
        ok.validate(5, 2, Where())
    with pytest.raises(TraceFormatError, match="decreasing=True"):
        SamplingSupport(np.array([0, 2, 1, 3]), np.array([1, 4, 0], dtype=np.int32)).validate(5, 3, Where())
    with pytest.raises(TraceFormatError, match="last=2"):
        SamplingSupport(np.array([0, 1, 2, 2]), np.array([1, 4, 0], dtype=np.int32)).validate(5, 3, Where())
    with pytest.raises(TraceFormatError, match=r"range \[0, 5\]"):
        SamplingSupport(np.array([0, 2, 2, 3]), np.array([1, 5, 0], dtype=np.int32)).validate(5, 3, Where())
