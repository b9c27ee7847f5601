"""`moe-replay bench` reads every CPU benchmark's --json: each script runs as the bench command runs
it (a fresh process, `python benchmarks/<name>.py --json`) on the smallest setting it offers, and
the bench parser must find its JSON object whatever the engines logged to stdout before it.

GPU benchmarks (gpu_*.py) need a GPU to run; their --plan / --dry-run modes are tested in
tests/test_gpu_capture_bench.py and tests/test_gpu_estimator_script.py.
"""

from __future__ import annotations

import json

import pytest

from moe_replay.report.bench import available, default_benchmarks_dir, run_one
from moe_replay.report.bench import last_json_object as _parse

BENCH = default_benchmarks_dir()
GPU_PREFIX = "gpu_"

vllm, slow = pytest.mark.vllm, pytest.mark.slow
CASES: dict[str, tuple[list[str], str, tuple]] = {
    # name: (arguments after --json: the smallest run, a key its JSON must hold, marks)
    "store": (["--sequences", "2", "--repeats", "1", "--families", "qwen3_moe", "--scale", "0.05"], "workloads", ()),
    "capture": (["--models", "tiny", "--pairs", "1", "--prompts", "2", "--max-tokens", "4", "--compiled-pairs", "0"],
                "models", (vllm, slow)),
    "replay": (["--size", "tiny", "--requests", "2", "--tokens", "4", "--repeats", "1"], "k3_kl_replay_support",
               (vllm, slow)),
    "estimator": (["--size", "tiny", "--engine", "eager", "--requests", "2", "--tokens", "4", "--repeats", "1",
                   "--variance-repeats", "2", "--real-noise-repeats", "2", "--inject-noise", "0"], "sidecar",
                  (vllm, slow)),
    "force_compiled": (["--size", "tiny", "--pairs", "1", "--requests", "2", "--tokens", "4"], "pairs",
                       (vllm, slow)),
    "hf_coverage": (["qwen3_moe", "--modes", "fp32"], "wall_seconds", (slow,)),
    "engine_coverage": (["--families", "qwen3_moe", "--modes", ""], "modes", (vllm, slow)),  # modes: test_vllm_spec, test_vllm_preemption
    "multi_turn": (["--conversations", "2", "--tokens", "4"], "k3_kl_turn1_kept_set", (vllm, slow)),
    "lab": (["--rollouts", "4", "--tokens", "4", "--variance-repeats", "2", "--variance-rollouts", "4", "--boot", "50",
             "--arms", "none,r3_support"], "arms", (vllm, slow)),
    "noise_calibration": (["--rollouts", "2", "--tokens", "4", "--targets", "1", "--placements", "2"], "calibrated",
                          (vllm, slow)),
    "scoring": (["--g", "8", "--repeats", "1"], "results", (slow,)),
    "topologies": (["--cells", "vllm_pp2"], "cells", (vllm, slow)),
    "trl_grpo": (["--steps", "2", "--repeats", "1"], "steps", (vllm, slow)),
    "verl_fsdp": (["--steps", "2", "--prompts", "4"], "steps", (vllm, slow)),  # medians skip step 1; prompts: a multiple of the micro batch (4)
    "megatron_native": (["--no-ranks", "--rounds", "1", "--hidden", "16", "--tokens", "8", "--batch", "2"], "configs", (slow,)),
    "runners": (["--runners", "v1", "--quick", "--modes", ""], "rows", (vllm, slow)),  # both runners: test_vllm_runners.py
    "audit": (["--families", "qwen3_moe", "--samples", "4", "--tokens", "24", "--engines", "hf", "--repeats", "1",
               "--cost-size", "tiny", "--cost-batch", "2", "--cost-tokens", "32"], "faults", (slow,)),
    "sglang": (["--families", "qwen3_moe", "--max-new-tokens", "4", "--estimator-families", ""], "families",
               (slow, pytest.mark.sglang)),  # the SGLang test bed's venv
}


def test_every_cpu_benchmark_has_a_smoke_case():
    """A new benchmark script gets its row here (or the gpu_ prefix): none escapes the parser check."""
    cpu = {n for n in available(BENCH) if not n.startswith(GPU_PREFIX)}
    assert cpu == set(CASES), f"missing: {sorted(cpu - set(CASES))}, stale: {sorted(set(CASES) - cpu)}"


@pytest.mark.parametrize("name", [pytest.param(n, marks=list(m)) for n, (_, _, m) in CASES.items()])
def test_benchmark_json_is_read_by_bench(name):
    args, key, _ = CASES[name]
    result = run_one(name, BENCH, timeout_s=1500, extra_args=args)
    assert result.ok, json.dumps(result.value)[-3000:]
    assert key in result.value, sorted(result.value)


# -- the parser itself ------------------------------------------------------------------------------
LOGS = "\n".join(f"INFO 11-26 01:02:03 [core.py:{i}] engine step {i} {{'kv': {i}}}" for i in range(125))


def test_parse_takes_an_indented_object_after_engine_logs():
    """replay.py / estimator.py: json.dumps(indent=1) after 125 lines of engine log, with nested
    objects inside a list (their '{' opens an indented line, never a candidate of its own)."""
    value = {"ratio": 1.01, "rows": [{"a": 1}, {"b": {"c": 2}}], "nested": {"x": [1, 2]}}
    assert _parse(LOGS + "\n" + json.dumps(value, indent=1) + "\n") == value
    assert _parse(LOGS + "\n" + json.dumps(value, indent=2)) == value


def test_parse_takes_the_last_of_several_objects_and_ignores_text_after_it():
    first, last = {"progress": 1}, {"overhead": 0.01}
    out = f"{json.dumps(first)}\n{LOGS}\n{json.dumps(last, indent=1)}\nINFO shutting down engine core\n"
    assert _parse(out) == last
    assert _parse("{not json\n" + json.dumps(last)) == last


def test_parse_finds_nothing_in_logs_alone_or_a_list():
    assert _parse(LOGS) is None
    assert _parse(LOGS + "\n[1, 2]\n") is None
    assert _parse("") is None
