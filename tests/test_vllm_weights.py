"""In-place weight sync into a live vLLM engine: after `update_weights`, the engine computes
exactly what a fresh engine loaded from the same checkpoint computes (the RL trainer -> engine
step), for every family the factory builds; nothing cached from the old weights is reused."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from moe_replay.models.families import FAMILIES

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

BLOCK = 32  # KV block size (the smallest vLLM-CPU attention accepts)
IDS = [int(i) for i in np.random.default_rng(0).integers(3, 500, 2 * BLOCK + 8)]  # two full blocks: cacheable


def prompt_logprobs(llm, ids: list[int] = IDS) -> np.ndarray:
    """Logprob of each prompt token after the first."""
    from vllm import SamplingParams

    (out,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return np.array([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])])


def cached_tokens(llm, ids: list[int] = IDS) -> int:
    """Prompt tokens a plain request reads from the prefix cache (requests that ask for prompt
    logprobs do not always read it: GPT-OSS's never do)."""
    from vllm import SamplingParams

    (out,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    return out.num_cached_tokens


def hf_logprobs(model, ids: list[int] = IDS) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def training_step(model_dir, out_dir, scale: float = 0.02):
    """Stand-in for an optimizer step: every weight moves; saved with the tokenizer so a fresh
    engine can load the directory. Returns the stepped HF model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    model.save_pretrained(out_dir)
    for f in model_dir.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, out_dir / f.name)
    return model


@pytest.mark.parametrize("family", FAMILIES.names())
def test_update_weights_equals_a_fresh_engine(family, tiny_model, vllm_llm, tmp_path):
    """Same kernels, same weights: the updated engine must agree with a fresh one exactly (0.0),
    also on a prompt whose KV the old weights left in the prefix cache."""
    from moe_replay.integrations.vllm.weights import update_weights

    model_dir = tiny_model(family)
    llm = vllm_llm(model_dir, enable_prefix_caching=True, block_size=BLOCK)
    before = prompt_logprobs(llm)
    # vLLM-CPU turns prefix caching off for MLA (deepseek_v3); every other family caches the prompt.
    caching = llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    assert caching == (family != "deepseek_v3")
    assert cached_tokens(llm) >= BLOCK or not caching, "the prompt's KV is expected in the prefix cache"
    training_step(model_dir, tmp_path / "step1")
    report = update_weights(llm, tmp_path / "step1")
    assert cached_tokens(llm) == 0, "a prefix-cache hit crossed the weight update"
    after = prompt_logprobs(llm)
    fresh = vllm_llm(tmp_path / "step1", enable_prefix_caching=True, block_size=BLOCK)
    want = prompt_logprobs(fresh)
    assert np.max(np.abs(after - before)) > 1e-2, "the engine did not take the new weights"
    assert np.max(np.abs(after - want)) == 0.0
    assert report.repacked >= 1  # every tiny family's MoE layers run on the CPU experts kernel
    if family == "gpt_oss":  # its loader copies experts and sinks outside vLLM's reload
        assert any(name.endswith("experts.routed_experts") for name in report.reloaded_directly)
        assert any(name.endswith("attn") for name in report.reloaded_directly)
    else:
        assert report.reloaded_directly == []


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_update_weights_matches_hf_after_a_training_step(family, tiny_model, vllm_llm, tmp_path):
    from moe_replay.integrations.vllm.weights import update_weights

    llm = vllm_llm(tiny_model(family), enable_prefix_caching=True)
    model = training_step(tiny_model(family), tmp_path / "step1")
    update_weights(llm, tmp_path / "step1")
    after = prompt_logprobs(llm)
    assert np.max(np.abs(after - hf_logprobs(model))) < 1e-4


def test_update_weights_refuses_a_model_whose_layers_kept_old_weights(tiny_model, vllm_llm, tmp_path, monkeypatch):
    """Without its registered direct-load keys, GPT-OSS's experts and sinks would keep their old
    values: the update must fail naming those layers, not serve a half-updated model."""
    from moe_replay.integrations.vllm import weights

    model_dir = tiny_model("gpt_oss")
    llm = vllm_llm(model_dir)
    training_step(model_dir, tmp_path / "step1")
    monkeypatch.delitem(weights.PLAIN_COPY_KEYS, "gpt_oss")
    with pytest.raises(weights.WeightSyncError, match=r"'gpt_oss'.*model\.layers\.0\.attn.*rebuild the engine"):
        weights.update_weights(llm, tmp_path / "step1")


def test_update_weights_clears_the_capture_slot_route_cache(tiny_model, tmp_path):
    """Routes cached per KV slot by capture were computed with the old weights: an update drops them."""
    from vllm import LLM, SamplingParams

    from moe_replay.integrations.vllm import VllmCapture, capture_engine_kwargs
    from moe_replay.integrations.vllm.weights import update_weights

    from .conftest import VLLM_TEST_ARGS, shutdown_llm

    def valid_slots(llm) -> int:
        return llm.collective_rpc(lambda w: int(w.model_runner._moe_replay.capture.slot_cache.valid_S.sum()))[0]

    model_dir = tiny_model("qwen3_moe")
    llm = LLM(**capture_engine_kwargs(model=str(model_dir), **{**VLLM_TEST_ARGS, "block_size": BLOCK}))
    try:
        cap = VllmCapture(llm)
        cap.generate([{"prompt_token_ids": IDS}], SamplingParams(max_tokens=2))  # collect flushes the slot writes
        assert valid_slots(llm) >= len(IDS) - 1
        training_step(model_dir, tmp_path / "step1")
        report = update_weights(llm, tmp_path / "step1")
        assert report.slot_routes_cleared is True and valid_slots(llm) == 0
        cap.uninstall()
    finally:
        shutdown_llm(llm)


def test_update_weights_refuses_a_missing_directory(tmp_path):
    from moe_replay.integrations.vllm.weights import update_weights

    with pytest.raises(FileNotFoundError, match="nope"):
        update_weights(object(), tmp_path / "nope")


def _linear_weights_packed_away(llm) -> bool:
    """Whether vLLM-CPU's GEMM dispatch replaced this engine's linear weights by a packed copy
    (an empty parameter without a weight loader is left): bf16 on AVX-512 BF16 / AMX CPUs."""
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    return model.model.layers[0].self_attn.qkv_proj.weight.numel() == 0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_per_tensor_sync_equals_a_fresh_engine(compiled, tiny_model, vllm_llm, tmp_path):
    """A trainer's own sync (TRL's colocated one: the model's `load_weights` one tensor at a time)
    inside `weight_sync`, two endpoint ops reached by the worker extension's method name, as
    capture reaches it: the engine then computes exactly what a fresh one computes, in eager and in
    vLLM's default compiled mode, on CPUs whose GEMM kernel packs the weights away and on those whose
    does not; capture's per-KV-slot routes of the old weights are gone."""
    from vllm import LLM, SamplingParams

    from moe_replay.integrations.vllm import VllmCapture, capture_engine_kwargs
    from moe_replay.integrations.vllm.weights import weight_sync

    from .conftest import VLLM_TEST_ARGS, shutdown_llm

    def valid_slots(llm) -> int:
        return llm.collective_rpc(lambda w: int(w.model_runner._moe_replay.capture.slot_cache.valid_S.sum()))[0]

    model_dir = tiny_model("qwen3_moe")
    # bf16, as TRL builds its engine ("auto" on the float32 checkpoint)
    engine_args = {**VLLM_TEST_ARGS, "dtype": "bfloat16", "block_size": BLOCK, "enable_prefix_caching": True,
                   "enforce_eager": not compiled}
    llm = LLM(**capture_engine_kwargs(model=str(model_dir), **engine_args))
    try:
        cap = VllmCapture(llm)
        assert cap.via == "worker_extension_cls"
        cap.generate([{"prompt_token_ids": IDS}], SamplingParams(max_tokens=2))  # collect flushes the slot writes
        assert valid_slots(llm) >= len(IDS) - 1
        before = prompt_logprobs(llm)
        packed = _linear_weights_packed_away(llm)
        if "MOE_REPLAY_EXPECT_PACKED" in os.environ:  # set by the run below that pins the ISA path
            assert packed == bool(int(os.environ["MOE_REPLAY_EXPECT_PACKED"]))
        stepped = training_step(model_dir, tmp_path / "step1")
        runner_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        with weight_sync(llm) as done:
            for name, param in stepped.named_parameters():
                runner_model.load_weights([(name, param.data)])
        assert done[0].repacked == 2  # the tiny qwen3_moe's two MoE layers
        assert valid_slots(llm) == 0
        assert _linear_weights_packed_away(llm) == packed  # the reload re-ran the kernel's own dispatch
        after = prompt_logprobs(llm)
        cap.uninstall()
    finally:
        shutdown_llm(llm)
    want = prompt_logprobs(vllm_llm(tmp_path / "step1", **engine_args))
    assert np.max(np.abs(before - want)) > 1e-2, "the training step was expected to move the logprobs"
    assert np.max(np.abs(after - want)) == 0.0


def test_per_tensor_sync_refuses_a_layer_that_got_nothing(tiny_model, vllm_llm, tmp_path):
    """A trainer that leaves a layer out (here: every tensor of layer 1's MoE block) would leave
    that layer's old weights in the engine: the sync fails naming it, and a second sync can open."""
    from moe_replay.integrations.vllm.weights import WeightSyncError, weight_sync

    model_dir = tiny_model("qwen3_moe")
    llm = vllm_llm(model_dir)
    stepped = training_step(model_dir, tmp_path / "step1")
    runner_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    params = [(n, p.data) for n, p in stepped.named_parameters()]
    with pytest.raises(WeightSyncError, match=r"layers \['model\.layers\.1\.mlp\.experts[.a-z_]*'\].*keep their old weights"):
        with weight_sync(llm):
            runner_model.load_weights([(n, t) for n, t in params if not n.startswith("model.layers.1.mlp.experts")])
    with pytest.raises(RuntimeError, match="boom"):  # an error inside the block closes the reload
        with weight_sync(llm):
            raise RuntimeError("boom")
    with weight_sync(llm) as done:  # the engine can sync again
        runner_model.load_weights(params)
    assert done[0].repacked == 2
    from moe_replay.integrations.vllm.link import SyncLink

    with pytest.raises(WeightSyncError, match="no weight sync is open"):  # a close without an open, typed
        SyncLink.open(llm, "weights.end", {"check": True}, what="closing", default=RuntimeError, kwargs_fn="")
