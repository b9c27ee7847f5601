"""Capture routes + sampling support from vLLM into a directory store, then inspect it.

    python examples/capture_to_store.py /tmp/traces && moe-replay inspect /tmp/traces
"""

import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm import LLM, SamplingParams

from moe_replay.integrations.vllm import CaptureConfig, VllmCapture, capture_engine_kwargs
from moe_replay.models import build_tiny_model
from moe_replay.store import open_store

store_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp() + "/traces"
model_dir = build_tiny_model("olmoe", tempfile.mkdtemp() + "/m")
llm = LLM(**capture_engine_kwargs(model=str(model_dir), dtype="bfloat16", enforce_eager=True, max_model_len=256,
                                  distributed_executor_backend="uni"))
with VllmCapture(llm, CaptureConfig(max_support=4096)) as cap, open_store(store_dir) as store:
    outputs, traces = cap.generate(["the cat sees", "Q: 4*2=? A:"], SamplingParams(n=3, top_p=0.9, max_tokens=16),
                                   store=store, use_tqdm=False)
    t = traces[0]
    print(f"{len(store)} traces in {store_dir}; first: key={t.key!r} tokens={t.num_tokens} routes={t.routes_TLK.shape} "
          f"layers={t.geometry.moe_layer_ids} support sizes={t.support.sizes_G().tolist()}")
