"""The capture benchmark's statistics: the crossover that cancels the engines' difference, the interval
for its median overhead (order statistics), the phase split (pure arithmetic)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

from moe_replay.report.bench import median_ci95

_SPEC = importlib.util.spec_from_file_location("bench_capture", Path(__file__).parents[1] / "benchmarks" / "capture.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_crossover_cancels_which_engine_carried_capture():
    """Pairs 0, 1 carry capture on engine 0, pairs 2, 3 on engine 1 (and so on): engine 1 is 3% slower
    here, so the per-pair ratios sit at +4% and -2% around a 1% capture cost (their median falls in
    the larger group, or between them); each crossover of pair i with pair i + 2 is 1% up to the
    product's second-order term, and it does not matter which engine is the slow one."""
    cost, bias = 0.01, 0.03
    ratios = [(1 + cost) * (1 + bias if (i // 2) % 2 == 0 else 1 / (1 + bias)) - 1 for i in range(12)]
    crossed = bench.crossover(ratios)
    assert len(crossed) == 6  # two per block of four pairs
    assert np.allclose(crossed, cost, atol=1e-12)
    assert abs(float(np.median(ratios[:10])) - cost) > 0.02  # 6 pairs on engine 0, 4 on 1: the pooled median is +4%
    swapped = bench.crossover([(1 + cost) ** 2 / (1 + r) - 1 for r in ratios])  # the other engine slow
    assert np.allclose(swapped, cost, atol=1e-12)
    assert bench.crossover(ratios[:2]) == []  # no pair of the other engine yet
    assert len(bench.crossover(ratios[:10])) == 4  # pairs 8, 9 have no partner: left out, never half-paired


def test_median_interval_uses_binomial_order_statistics():
    assert median_ci95([0.5, 0.1, 0.3, 0.2, 0.4, 0.0]) == [0.0, 0.5]  # n=6: P(X=0)=1/64 <= 2.5%, k=1
    assert all(math.isnan(v) for v in median_ci95([0.1] * 5))  # n=5: no 95% interval exists
    lo, hi = median_ci95([float(i) for i in range(48)])
    assert (lo, hi) == (16.0, 31.0)  # n=48: k=17 order statistics in from each end


def test_median_interval_covers_the_median_about_95_percent():
    rng = np.random.default_rng(0)
    hits = sum(lo <= 0.0 <= hi for lo, hi in (median_ci95(list(rng.standard_cauchy(40))) for _ in range(2000)))
    assert 0.94 <= hits / 2000 <= 0.985  # heavy tails do not matter: it only counts signs


def test_phase_split_takes_each_pairs_on_minus_off_over_the_off_step():
    """`phases`: per pair, (on - off) seconds of each engine phase over the off side's step seconds;
    after_forward is the outer execute_model less the inner one (capture's hook sits between them),
    rest what the engine step spends outside execute_model and sample_tokens."""
    def side(fwd, inner, outer, sample, step):
        return {"forward": fwd, "execute_in": inner, "execute_out": outer, "sample": sample}, {"s": step}

    rows = []
    for k in (1.0, 2.0, 3.0):
        (on, got_on), (off, got_off) = side(8.2, 9.0, 9.4, 0.6, 10.2), side(8.0, 8.8, 8.8, 0.5, 10.0)
        rows.append(bench._phase_row({True: on, False: off}, {True: got_on, False: got_off}, collect_s=0.05 * k))
    out = bench._phases(rows)
    d = out["on_minus_off"]
    assert math.isclose(d["forward"], 0.02) and math.isclose(d["inputs"], 0.0, abs_tol=1e-9)
    assert math.isclose(d["after_forward"], 0.04) and math.isclose(d["sample"], 0.01)
    assert math.isclose(d["rest"], (0.2 - 0.7) / 10.0) and math.isclose(d["collect"], 0.01)  # collect: median k = 2
    assert math.isclose(out["share_off"]["forward"], 0.8) and math.isclose(out["share_off"]["rest"], 0.07)
    assert bench._phases([]) == {}
