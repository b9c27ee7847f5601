"""TRL's GRPOTrainer with a tensor-parallel colocated vLLM engine (`vllm_tensor_parallel_size=2`):
two ranks under torchrun (gloo, CPU), one engine sharded over them by vLLM's external launcher.

TRL gathers both ranks' prompts into one generate call and each rank keeps its share of the
completions; capture must hand each rank exactly its own samples' traces. The worker script
(tests/trl_tp_worker.py) trains one step of `r3_support` on each rank and writes what it trained on.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("trl")
pytestmark = [pytest.mark.vllm, pytest.mark.hf, pytest.mark.slow]


def test_each_rank_trains_on_its_own_samples_traces(tiny_model, tmp_path):
    model_dir = tiny_model("qwen3_moe")
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    # one core per rank: vLLM-CPU binds each local worker's threads to a NUMA node otherwise, and
    # this machine has one
    env.update(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CPU_KVCACHE_SPACE="1")
    worker = Path(__file__).with_name("trl_tp_worker.py")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(port), str(worker), str(model_dir), str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    ranks = [out / f"rank{r}.json" for r in (0, 1)]
    assert all(p.exists() for p in ranks), f"rc {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    runs = [json.loads(p.read_text()) for p in ranks]
    for run in runs:
        assert len(run["rows"]) == 4  # per_device_train_batch_size
        for completion, traced in run["rows"]:
            assert completion == traced  # the trace of this row is this row's sample
        (step,) = run["steps"]
        assert step["moe_replay/route_flip_rate"] == 0.0 and step["moe_replay/route_tokens"] > 0
    # the two ranks trained on different samples: each took its own share of the group's call
    assert [r[1] for r in runs[0]["rows"]] != [r[1] for r in runs[1]["rows"]]
