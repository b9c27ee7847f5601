"""enable() dispatches through registered bindings (moe_replay.bindings): a Megatron-core GPTModel
is a first-class trainer (replay through its RouterReplay, TP-aware scoring), a Hugging Face /
torch model is the fallback, and an object no binding serves is refused naming what is supported."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moe_replay
from moe_replay.bindings import ROLLOUT_BINDINGS, TRAINER_BINDINGS, binding_for

from .test_megatron_replay import _gpt, megatron_cpu  # noqa: F401 (the fixture: gloo group + Megatron's CPU shims)
from .trace_factory import random_trace


def test_dispatch_names_the_binding_or_the_supported_kinds():
    assert binding_for(TRAINER_BINDINGS, torch.nn.Linear(2, 2), "trainer")[0] == "hf"
    with pytest.raises(ValueError, match=r"no rollout engine binding serves a builtins.object; supported: vllm.LLM, vllm.AsyncLLM"):
        binding_for(ROLLOUT_BINDINGS, object(), "rollout engine")
    with pytest.raises(ValueError, match="no trainer binding serves a builtins.str"):
        moe_replay.enable("r3", model="not a model")


def test_megatron_gpt_model_through_enable(megatron_cpu):
    """enable(model=<GPTModel>) picks the Megatron binding: its geometry, its inputs, replay of the
    traces' routes (each MoE layer takes its rows once) and scores equal to the adapter's own."""
    from moe_replay.integrations.megatron import score_tokens

    model = _gpt("none")
    mr = moe_replay.enable("r3", model=model, family="qwen3_moe")
    assert mr.trainer_kind == "megatron"
    assert mr.geometry.moe_layer_ids == (1, 3) and mr.geometry.vocab_size == 512 and mr.geometry.family == "qwen3_moe"
    rng = np.random.default_rng(0)
    traces = [random_trace(f"m{i}", rng, geometry=mr.geometry, num_tokens=n, prompt_len=3) for i, n in enumerate((9, 6))]
    for t in traces:
        t.sampling = type(t.sampling)(temperature=0.8)
    with mr.train_batch(traces) as batch:
        logits_BSV = model(**batch.model_inputs())
        lp_G = batch.logprobs(logits_BSV)
        lp_G.sum().backward()
    assert [batch.session.ledgers[0].forward_takes[lid] for lid in (1, 3)] == [1, 1]
    want = score_tokens(logits_BSV.detach(), batch.plan, use_support=False).logprobs_G
    torch.testing.assert_close(lp_G.detach(), want)
    assert lp_G.shape == (sum(t.num_generated for t in traces),) and torch.isfinite(lp_G).all()
    with pytest.raises(ValueError, match="track_flips is not available on Megatron"):
        with mr.train_batch(traces, track_flips=True):
            pass



@pytest.mark.vllm
def test_async_engine_is_first_class(tiny_model):
    """enable_async(llm=<AsyncLLM>) attaches capture (and the π_old scorer) to the async engine; its
    traces replay into the HF trainer and reproduce the engine's logprobs (fp32). The sync entry
    points say what to use instead."""
    import asyncio

    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from moe_replay.integrations.vllm import AsyncVllmCapture, AsyncVllmScorer, scoring_engine_kwargs
    from moe_replay.integrations.vllm.capture.api import sampling_summary

    from .conftest import VLLM_TEST_ARGS

    model_dir = tiny_model("qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sp = SamplingParams(top_p=0.9, max_tokens=6, seed=1)

    async def run():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**scoring_engine_kwargs(model=str(model_dir), **VLLM_TEST_ARGS)))
        try:
            with pytest.raises(ValueError, match="AsyncLLM attaches asynchronously.*enable_async"):
                moe_replay.enable("r3_support", llm=engine)
            mr = await moe_replay.enable_async("r3_support_multisample", llm=engine, model=model)
            assert mr.engine_kind == "vllm.AsyncLLM" and mr.trainer_kind == "hf"
            assert isinstance(mr.capture, AsyncVllmCapture) and isinstance(mr.scorer, AsyncVllmScorer)
            with pytest.raises(ValueError, match="engine's own async generate"):
                mr.generate(["x"], sp)
            final = None
            async for o in engine.generate("Q: 3+4=? A:", sp, request_id="a0"):
                final = o
            (trace,) = await mr.capture.collect([final], sampling={"a0": sampling_summary(sp)})
            (scored,) = await mr.scorer.score([trace])
            await mr.aclose()
            return mr, trace, scored
        finally:
            engine.shutdown()

    mr, trace, scored = asyncio.run(run())
    assert trace.routes_TLK is not None and trace.support is not None
    with mr.train_batch([trace]) as batch:
        logp_G = batch.logprobs(model(**batch.model_inputs()).logits)
    assert float((logp_G.detach().double() - batch.rollout_logprobs).abs().max()) < 1e-4
    assert np.max(np.abs(scored - trace.logprobs_G)) < 1e-4  # the engine re-scores its own rollout
