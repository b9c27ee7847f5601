"""The capture benchmark's interval for its median overhead (order statistics, pure arithmetic)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

_SPEC = importlib.util.spec_from_file_location("bench_capture", Path(__file__).parents[1] / "benchmarks" / "capture.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_median_interval_uses_binomial_order_statistics():
    assert bench._ci95([0.5, 0.1, 0.3, 0.2, 0.4, 0.0]) == [0.0, 0.5]  # n=6: P(X=0)=1/64 <= 2.5%, k=1
    assert all(math.isnan(v) for v in bench._ci95([0.1] * 5))  # n=5: no 95% interval exists
    lo, hi = bench._ci95([float(i) for i in range(48)])
    assert (lo, hi) == (16.0, 31.0)  # n=48: k=17 order statistics in from each end


def test_median_interval_covers_the_median_about_95_percent():
    rng = np.random.default_rng(0)
    hits = sum(lo <= 0.0 <= hi for lo, hi in (bench._ci95(list(rng.standard_cauchy(40))) for _ in range(2000)))
    assert 0.94 <= hits / 2000 <= 0.985  # heavy tails do not matter: it only counts signs
