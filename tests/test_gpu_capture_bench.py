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
