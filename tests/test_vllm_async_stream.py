"""AsyncLLM with vLLM's default (cumulative) streaming and n > 1: each child's output arrives alone,
so a request's last yield can hold one child only. Capture takes n from the request (recorded at
submit by `AsyncVllmCapture.generate`, or passed as `n=`), merges the streamed outputs, and gives
every sample's trace: the same traces, bit for bit, as the same requests run final-only."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.mrv2]

from moe_replay.codec.record import encode_trace  # noqa: E402
from moe_replay.integrations.vllm import CollectError, capture_engine_kwargs  # noqa: E402

ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
              seed=0, distributed_executor_backend="uni", block_size=32, enable_prefix_caching=False)
PROMPTS = ["the cat route token model expert", "layer sample mixture alpha beta dog the cat"]
NS = [2, 3]  # n per prompt
SEEDS = [21, 22]


def params(seed: int, n: int, vocab: int, **kw):
    from vllm import SamplingParams

    # half the vocabulary stops a sample (p ~ 0.5 per token): children end at different steps
    return SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, n=n, seed=seed,
                          stop_token_ids=list(range(0, vocab, 2)), **kw)


def test_streamed_n_gt_1_collects_every_sample(tmp_path):
    import asyncio

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from moe_replay.integrations.vllm import AsyncVllmCapture
    from moe_replay.models import build_tiny_model

    model_dir = build_tiny_model("qwen3_moe", tmp_path / "m", seed=0)

    async def run():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**capture_engine_kwargs(model=str(model_dir), **ENGINE)))
        vocab = engine.model_config.get_vocab_size()
        try:
            cap = await AsyncVllmCapture.attach(engine)

            async def stream(i):  # default output kind: cumulative streaming
                sp = params(SEEDS[i], NS[i], vocab)
                assert sp.output_kind == RequestOutputKind.CUMULATIVE
                return [o async for o in cap.generate(PROMPTS[i], sp, request_id=f"s{i}")]

            streamed = await asyncio.gather(*(stream(i) for i in range(len(PROMPTS))))
            got = await cap.collect([o for outs in streamed for o in outs])

            async def final_only(i):
                sp = params(SEEDS[i], NS[i], vocab, output_kind=RequestOutputKind.FINAL_ONLY)
                return [o async for o in cap.generate(PROMPTS[i], sp, request_id=f"s{i}")][-1]

            finals = await asyncio.gather(*(final_only(i) for i in range(len(PROMPTS))))
            want = await cap.collect(finals)

            # the last yield alone, n recorded at submit: the missing children are named failures. A
            # consumer slower than the engine gets children coalesced into one yield (vLLM's output
            # collector), so one child is dropped from a last yield that holds them all
            again = [o async for o in cap.generate(PROMPTS[1], params(SEEDS[1], NS[1], vocab), request_id="s1")]
            last = copy.copy(again[-1])
            if len(last.outputs) == NS[1]:
                last.outputs = [c for c in last.outputs if c.index != 0]
            with pytest.raises(CollectError) as err:
                await cap.collect([last])
            return streamed, got, finals, want, last, err.value
        finally:
            engine.shutdown()

    streamed, got, finals, want, last, err = asyncio.run(run())
    # the case under test happened: some request's last yield held fewer than n children
    assert any(len(outs[-1].outputs) < n for outs, n in zip(streamed, NS))
    assert [len(f.outputs) for f in finals] == NS
    assert [t.key for t in got] == [t.key for t in want] == ["s0#0", "s0#1", "s1#0", "s1#1", "s1#2"]
    lengths = {t.key: t.num_generated for t in got}
    assert len(set(lengths.values())) > 1, lengths
    for a, b in zip(got, want):
        assert encode_trace(a) == encode_trace(b), a.key
        assert a.sampling is not None and a.sampling.top_p == pytest.approx(0.9)
    for f in finals:  # and the streamed tokens are the final-only tokens
        for c in f.outputs:
            t = next(t for t in got if t.key == f"{f.request_id}#{c.index}")
            assert np.array_equal(t.token_ids_S[t.prompt_len:], np.asarray(c.token_ids))
    missing = {f"s1#{i}" for i in range(3)} - {f"s1#{c.index}" for c in last.outputs}
    assert missing and set(err.failures) == missing
    assert all("n=3" in str(err.failures[k]) for k in missing)
    assert {t.key for t in err.traces} == {f"s1#{c.index}" for c in last.outputs}
