"""Capture on the multi-process engine (EngineCore in its own process) with LLM and AsyncLLM.

The engine work runs in a child process (this file, under its __main__ guard: vLLM spawns);
it writes encoded traces, and the parent checks them against HF's own fp32 routing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

PROMPTS = ["the cat route token model", "expert layer sample mixture alpha beta dog " * 12]
IDS = [int(i) for i in np.random.default_rng(0).integers(3, 500, 40)]  # scored after the weight update


def _engine_kwargs(model_dir: str) -> dict:
    return dict(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8,
                max_num_batched_tokens=64, seed=0, distributed_executor_backend="uni", block_size=32)


def _child(model_dir: str, out_dir: str, step_dir: str) -> None:
    import asyncio

    from vllm import LLM, SamplingParams

    from moe_replay.codec import encode_trace
    from moe_replay.integrations.vllm import AsyncVllmCapture, VllmCapture, capture_engine_kwargs
    from moe_replay.integrations.vllm.weights import update_weights

    out = Path(out_dir)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True, n=2)
    llm = LLM(**capture_engine_kwargs(**_engine_kwargs(model_dir)))
    cap = VllmCapture(llm)
    _, traces = cap.generate(PROMPTS, sp)
    for t in traces:
        (out / f"llm_{t.key}.bin").write_bytes(encode_trace(t))
    meta = {"llm_via": cap.via, "llm_keys": [t.key for t in traces]}
    # the synchronous scorer and the estimator on the same engine: requests added here, stepped in the core
    from moe_replay.estimator.core import EstimatorConfig, estimate
    from moe_replay.integrations.vllm import VllmScorer, VllmScorerConfig

    scorer = VllmScorer(llm, VllmScorerConfig(prompt_reuse=False))
    est = estimate(traces, scorer, EstimatorConfig(n=2), batch_size=len(traces))
    ref = scorer.score_batch(traces)
    scorer.uninstall()
    meta["scoring"] = {"gap_vs_rollout": max(float(np.abs(s - t.logprobs_G).max()) for s, t in zip(ref, traces)),
                       "estimate_vs_score": max(float(np.abs(e.prob_G - np.exp(s)).max()) for e, s in zip(est, ref)),
                       "scored": [len(s) for s in ref]}
    # weight sync on the multi-process engine: the worker op crosses vLLM's msgpack RPC, no pickled function
    report = update_weights(llm, step_dir)
    (scored,) = llm.generate([{"prompt_token_ids": IDS}], SamplingParams(max_tokens=1, prompt_logprobs=0))
    logprobs = [d[t].logprob for d, t in zip(scored.prompt_logprobs[1:], IDS[1:])]
    meta["update"] = {"repacked": report.repacked, "logprobs": logprobs}
    llm.llm_engine.engine_core.shutdown()
    del llm

    async def run_async() -> list:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**capture_engine_kwargs(**_engine_kwargs(model_dir))))
        try:
            acap = await AsyncVllmCapture.attach(engine)

            async def one(i: int, prompt: str):
                final = None
                async for o in engine.generate(prompt, sp, request_id=f"async-{i}"):
                    final = o
                return final

            finals = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
            return await acap.collect(finals)
        finally:
            engine.shutdown()

    atraces = asyncio.run(run_async())
    for t in atraces:
        (out / f"async_{t.key}.bin").write_bytes(encode_trace(t))
    meta["async_keys"] = [t.key for t in atraces]
    (out / "meta.json").write_text(json.dumps(meta))


@pytest.mark.vllm
@pytest.mark.slow
def test_multiprocess_llm_and_async_llm(tmp_path):
    """The capture worker extension reaches the worker in the EngineCore process: LLM.generate
    and AsyncLLM (n=2, one prompt chunk-prefilled) each give one trace per sample, whose routes
    equal HF's routing and whose kept sets are valid and contain the sampled tokens. VllmScorer and
    the estimator (n = 2) score those traces on the same engine (its requests added here, stepped in
    the core process) and give back the rollout's logprobs. `update_weights`
    reaches the same worker: the engine then scores as HF does with the stepped weights."""
    pytest.importorskip("vllm")
    from moe_replay.codec import decode_trace
    from moe_replay.models import build_tiny_model

    from .test_vllm_capture import SAMPLING, check_against_hf
    from .test_vllm_weights import hf_logprobs, training_step

    model_dir = build_tiny_model("qwen3_moe", tmp_path / "m", seed=0)
    out = tmp_path / "out"
    out.mkdir()
    stepped = training_step(model_dir, tmp_path / "step1")
    # explicitly on: capture_engine_kwargs puts a one-process vLLM-CPU engine's core in this process
    # when the variable is unset (engine_kwargs.cpu_env_defaults)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, __file__, str(model_dir), str(out), str(tmp_path / "step1")], env=env, capture_output=True,
                          text=True, timeout=300)
    meta_path = out / "meta.json"
    assert meta_path.exists(), f"child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    meta = json.loads(meta_path.read_text())
    assert meta["llm_via"] == "worker_extension_cls"
    # forced re-scoring in the core process reproduces the rollout's fp32 logprobs; n = 2 replicas agree
    assert meta["scoring"]["scored"] == [8] * 4
    assert meta["scoring"]["gap_vs_rollout"] < 1e-4 and meta["scoring"]["estimate_vs_score"] < 1e-6
    assert meta["update"]["repacked"] == 2  # the tiny qwen3_moe's two MoE layers
    assert np.max(np.abs(np.array(meta["update"]["logprobs"]) - hf_logprobs(stepped, IDS))) < 1e-4
    assert len(meta["llm_keys"]) == 4 and meta["async_keys"] == ["async-0#0", "async-0#1", "async-1#0", "async-1#1"]
    for name in [f"llm_{k}" for k in meta["llm_keys"]] + [f"async_{k}" for k in meta["async_keys"]]:
        trace = decode_trace((out / f"{name}.bin").read_bytes())
        check_against_hf(trace, model_dir, SAMPLING[0])
        assert np.all(trace.support.sizes_G() >= 1)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3])
