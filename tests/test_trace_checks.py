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
from moe_replay.trace import SamplingSupport, check_distinct_rows, check_expert_range, validate_traces
from tests.trace_factory import random_trace

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


# -- validate_traces: the batch says what each trace's validate() says ---------------------------
def _plant(trace, kind: str, rng: np.random.Generator) -> None:
    """One defect of `kind` at a random place (after construction, as a later writer would)."""
    if kind == "repeat" and trace.routes_TLK is not None and len(trace.routes_TLK):
        t, l = int(rng.integers(len(trace.routes_TLK))), int(rng.integers(trace.routes_TLK.shape[1]))
        trace.routes_TLK[t, l, 1] = trace.routes_TLK[t, l, 0]
    elif kind == "expert" and trace.routes_TLK is not None and len(trace.routes_TLK):
        trace.routes_TLK[int(rng.integers(len(trace.routes_TLK))), 0, 0] = trace.geometry.num_experts
    elif kind == "token":
        trace.token_ids_S[int(rng.integers(trace.num_tokens))] = trace.geometry.vocab_size + 3
    elif kind == "unsorted" and trace.support is not None and len(trace.support.ids_N) > 1:
        sizes = trace.support.sizes_G()
        g = int(np.flatnonzero(sizes > 1)[0]) if (sizes > 1).any() else None
        if g is not None:
            a = int(trace.support.offsets_G1[g])
            trace.support.ids_N[a + 1] = trace.support.ids_N[a]
    elif kind == "offsets" and trace.support is not None:
        trace.support.offsets_G1[-1] += 1
    elif kind == "support_id" and trace.support is not None and len(trace.support.ids_N):
        trace.support.ids_N[-1] = -1
    elif kind == "prompt_len":
        trace.prompt_len = trace.num_tokens + 1
    elif kind == "routes_shape" and trace.routes_TLK is not None:
        trace.routes_TLK = trace.routes_TLK[:-1]
    elif kind == "weights_version":
        trace.weights_version = 1.5
    elif kind == "logprobs" and trace.logprobs_G is not None:
        trace.logprobs_G = trace.logprobs_G[:-1]


KINDS = ("repeat", "expert", "token", "unsorted", "offsets", "support_id", "prompt_len", "routes_shape",
         "weights_version", "logprobs")


def _validate_each(traces) -> dict[int, tuple[type, str]]:
    out = {}
    for i, t in enumerate(traces):
        try:
            t.validate()
        except Exception as e:
            out[i] = (type(e), str(e))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_validate_traces_refuses_as_each_validate_does(seed):
    rng = np.random.default_rng(500 + seed)
    traces = [random_trace(f"r{i}", rng, num_tokens=int(rng.integers(2, 40)), with_support=bool(rng.random() < 0.9),
                           with_routes=bool(rng.random() < 0.9)) for i in range(int(rng.integers(1, 7)))]
    for _ in range(int(rng.integers(0, 3))):  # none, one or two defects, of any kind, anywhere
        _plant(traces[int(rng.integers(len(traces)))], KINDS[int(rng.integers(len(KINDS)))], rng)
    want = _validate_each(traces)
    got = {i: (type(e), str(e)) for i, e in validate_traces(traces).items()}
    assert got == want


def test_validate_traces_names_each_bad_trace():
    rng = np.random.default_rng(7)
    traces = [random_trace(f"r{i}", rng) for i in range(5)]
    assert validate_traces(traces) == {}
    _plant(traces[1], "repeat", rng)
    _plant(traces[3], "unsorted", rng)
    got = validate_traces(traces)
    assert sorted(got) == [1, 3]
    assert "record 'r1'" in str(got[1]) and "distinct expert ids" in str(got[1])
    assert "record 'r3'" in str(got[3]) and "strictly increasing" in str(got[3])
