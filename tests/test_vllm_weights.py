"""In-place weight sync into a live vLLM engine: after `update_weights`, the engine computes
exactly what HF computes with the new weights (the RL trainer -> engine step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def prompt_logprobs(llm, ids: list[int]) -> np.ndarray:
    from vllm import SamplingParams

    (out,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return np.array([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])])


def hf_logprobs(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_update_weights_matches_hf_after_a_training_step(family, tiny_model, vllm_llm, tmp_path):
    from transformers import AutoModelForCausalLM

    from moe_replay.integrations.vllm.weights import update_weights

    model_dir = tiny_model(family)
    llm = vllm_llm(model_dir, enable_prefix_caching=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = list(np.random.default_rng(0).integers(3, 500, 40))
    before = prompt_logprobs(llm, ids)
    assert np.max(np.abs(before - hf_logprobs(model, ids))) < 1e-4

    torch.manual_seed(0)
    with torch.no_grad():  # stand-in for an optimizer step: every weight moves
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(tmp_path / "step1")
    repacked = update_weights(llm, tmp_path / "step1")
    after = prompt_logprobs(llm, ids)  # the same prompt: a stale prefix-cache hit would show here
    want = hf_logprobs(model, ids)
    assert repacked == 2  # both MoE layers of the tiny model are on the CPU experts kernel
    assert np.max(np.abs(after - before)) > 1e-2, "the engine did not take the new weights"
    assert np.max(np.abs(after - want)) < 1e-4


def test_update_weights_refuses_a_missing_directory(tmp_path):
    from moe_replay.integrations.vllm.weights import update_weights

    with pytest.raises(FileNotFoundError, match="nope"):
        update_weights(object(), tmp_path / "nope")
