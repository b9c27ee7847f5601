"""The process layouts of benchmarks/topologies.py, as tests, each against the one-process run on
every token: a vLLM engine sharded over two workers captures what one worker captures and
force-scores the same traces alike; two data-parallel engines behind one AsyncLLM capture what one
engine does and score freely alike (fp32: 0 flips over every routed row of every reference trace,
logprobs within 2e-5). TRL's tensor-parallel layout is tests/test_trl_tp.py."""

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
    model_dir = tiny_model("qwen3_moe")
    cells = topologies.cell_vllm_tp2(model_dir, tmp_path)
    capture, scoring = cells["vllm_tp2"], cells["vllm_tp2_scoring"]
    assert capture["status"] == "works", capture
    assert capture["traces_complete"] == "8/8"
    _every_row_routed_alike(capture, model_dir)
    assert capture["sampled_flips"] == 0 and capture["max_abs_logprob_diff"] <= 2e-5  # over the tokens sampled alike
    assert scoring["status"] == "works" and scoring["traces_complete"] == "8/8", scoring
    assert scoring["max_abs_logprob_diff"] <= 2e-5


def _every_row_routed_alike(cell: dict, model_dir) -> None:
    """0 flips over every routed row of every reference trace (teacher-forced: none left out): a
    trace of P prompt tokens and 16 generated ones has P + 15 rows, in each of the 2 MoE layers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rows = sum(len(tok(p).input_ids) + 15 for p in topologies.PROMPTS) * topologies.N_SAMPLES
    assert cell["flips"] == 0 and cell["routed"] == rows * 2, (cell, rows)


def test_vllm_data_parallel_capture_and_free_scoring_equal_one_engine(tiny_model, tmp_path):
    """An AsyncLLM with data_parallel_size=2 (vLLM's load-balancing client over two engine cores;
    vLLM-CPU's missing variable-size collectives and its experts kernel's expert map filled in by
    tests/cpu_shims), without and with expert parallelism: both engines serve requests, every
    request's trace comes back from the engine that served it, the engines route every row of the
    one-engine traces as one engine does (fp32: 0 flips) and score them freely alike (every
    generated token within 2e-5); a second replica reads the prompt KV the first cached (replicas
    pinned to one engine core: no miss). Forced scoring is refused by name when the scorer attaches,
    with nothing installed, while the same call scores on one engine."""
    model_dir = tiny_model("qwen3_moe")
    cells = topologies.cell_vllm_dp2(model_dir, tmp_path)
    for name in ("vllm_dp2", "vllm_dp2_ep"):
        cell, scoring = cells[name], cells[name + "_scoring"]
        assert cell["status"] == "works", cell
        assert cell["traces_complete"] == "8/8"
        assert len(cell["engine_steps"]) == 2 and min(cell["engine_steps"]) > 0, cell  # both engines served
        _every_row_routed_alike(cell, model_dir)
        assert cell["sampled_flips"] == 0 and cell["max_abs_logprob_diff"] <= 2e-5
        assert scoring["status"] == "works" and scoring["traces_complete"] == "8/8", scoring
        assert scoring["max_abs_logprob_diff"] <= 2e-5 and scoring["replica_diff"] <= 2e-5, scoring
        reuse = scoring["reuse"]
        assert scoring["prompt_reuse"] and reuse.get("misses", 0) == 0, scoring
        assert reuse["cached_tokens"] >= reuse["promised_tokens"] > 0, scoring  # the second replica hit its engine
        assert scoring["forced"] == "refused" and scoring["forced_reference"] == "works", scoring
        assert scoring["error"].startswith("ForceRouteError: VllmScorerConfig(force_routes=True): data_parallel_size=2")
        assert scoring["installed_on_workers"] == 0


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
