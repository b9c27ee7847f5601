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
