"""benchmarks/gpu_estimator.py runs on a GPU machine only; here: it imports, parses and plans."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest


def _load():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_estimator.py"
    spec = importlib.util.spec_from_file_location("gpu_estimator", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_estimator_plans_without_a_gpu(capsys):
    mod = _load()
    mod.main(["--plan", "--requests", "16", "--tokens", "32"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["requests"] == 16 and plan["tokens"] == 32 and plan["buckets"] == [1, 4, 16, 64]
    with pytest.raises(SystemExit):
        mod.parse_args(["--gpu-memory-utilization", "0.9"])
    with pytest.raises(SystemExit):
        mod.parse_args(["--repeats", "0"])


def test_bucket_placement_rotates_per_replica_round():
    """Round r of an estimate is scored in chunks of BUCKETS[(r + offset) % 4]."""
    mod = _load()
    calls = []

    class Rec:
        def score_batch(self, traces):
            calls.append(len(traces))
            return [None] * len(traces)

    b = mod.BucketScorer(Rec(), num=8, offset=1)
    for _ in range(3):
        assert len(b.score_batch(list(range(8)))) == 8
    assert calls == [4, 4, 8, 8]  # buckets 4 (two chunks), 16 and 64 (one chunk of 8 each)
