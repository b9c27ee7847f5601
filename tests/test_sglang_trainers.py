"""SGLang rollouts in the trainers SGLang users run: HF under FSDP2 (two gloo ranks), Megatron-core on both replay
paths, and examples/sglang_megatron.py (rollout on SGLang -> store -> Megatron replay -> loss and backward).

The traces come from the session's SGLang server (tiny qwen3_moe, tests/sglang_bed) through a DirectoryStore.
HF runs the served checkpoint itself, so its replay must reproduce SGLang's logprobs; the Megatron GPTModel is
a fresh model of the same geometry (the project has no HF -> Megatron weight converter), so there replay must
force every recorded expert, on the project's path and Megatron's native RouterReplay alike, bit-identically.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_replay.integrations.sglang import SglangCapture
from moe_replay.store import DirectoryStore

from .test_megatron_replay import megatron_cpu  # noqa: F401  (the one-rank gloo group and CPU shims)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def stored(sglang_server, tmp_path_factory):
    """(store path, keys): 2 prompts x n = 2 from SGLang, top-k 20 / top-p 0.9, 10 tokens each."""
    path = tmp_path_factory.mktemp("sglang_trainers") / "store"
    with DirectoryStore(path) as store:
        _, traces = SglangCapture(sglang_server.url).generate(
            ["the cat route token model", "expert layer sample mixture alpha beta dog the cat"],
            {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "max_new_tokens": 10, "n": 2}, store=store)
    return path, [t.key for t in traces]


def _read(stored_):
    path, keys = stored_
    with DirectoryStore(path, readonly=True) as store:
        return store.get_many(keys)


def _fsdp2_rank(rank: int, world: int, init: str, model_dir: str, store: str, keys: list, out: dict) -> None:
    """One FSDP2 rank: the served HF checkpoint sharded, replay attached after sharding, this rank's half of the
    traces replayed, scored over their kept sets, backward; flips and |HF - SGLang| logprobs reported."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from moe_replay.integrations.hf.coverage import fsdp2_shard
    from moe_replay.integrations.hf.replay import model_geometry, output_tensor, replay
    from moe_replay.replay import build_plan, score_tokens

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        fsdp2_shard(model)
        with DirectoryStore(store, readonly=True) as s:
            traces = s.get_many(keys[rank::world])
        plan = build_plan(traces, model_geometry(model))
        with replay(model, plan, track_flips=True) as session:
            logprobs_G = score_tokens(output_tensor(model(**session.model_inputs())), plan).logprobs_G
            (-logprobs_G.mean()).backward()
        grads = [p.grad for n, p in model.named_parameters() if "mlp.gate" in n]
        out[rank] = dict(flips=int(sum(session.flips.flips.values())), positions=int(sum(session.flips.positions.values())),
                         max_abs=float((logprobs_G.detach().double() - plan.engine_logprobs_G.double()).abs().max()),
                         router_grads=all(g is not None and bool(torch.isfinite(g.full_tensor() if hasattr(g, "full_tensor")
                                                                                    else g).all()) for g in grads) and bool(grads))
    finally:
        dist.destroy_process_group()


def test_fsdp2_replays_sglang_rollouts_exactly(sglang_server, stored, tmp_path):
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    path, keys = stored
    mp.spawn(_fsdp2_rank, args=(2, f"file://{tmp_path}/init", str(sglang_server.model_dir), str(path), keys, out),
             nprocs=2, join=True)
    for rank in range(2):
        r = out[rank]
        print(f"fsdp2 rank {rank}:", r)
        assert r["flips"] == 0 and r["positions"] > 0 and r["max_abs"] <= 2e-5 and r["router_grads"]


def test_megatron_both_paths_force_sglang_routes(megatron_cpu, stored):  # noqa: F811
    """A GPTModel of the served geometry replays SGLang's traces: every router call routes exactly the recorded
    experts; the project's path and Megatron's native RouterReplay give bit-identical logits and gradients."""
    from moe_replay.integrations.megatron import model_geometry, sequence_first_ids
    from moe_replay.replay import build_plan

    from . import megatron_gloo as gloo
    from .megatron_native_worker import fresh_registry, gpt, step

    traces = _read(stored)
    g = traces[0].geometry
    fresh_registry()
    model = gpt(num_layers=g.num_layers, moe_layer_freq=[1] * g.num_layers, num_moe_experts=g.num_experts,
                moe_router_topk=g.top_k, moe_router_pre_softmax=False, moe_router_topk_scaling_factor=None)
    assert model.vocab_size == g.vocab_size
    plan = build_plan(traces, model_geometry(model, family="qwen3_moe"))
    runs = {}
    for path in ("project", "megatron_native"):
        maps, handles = gloo.watch(model)
        runs[path] = step(model, [plan], path)
        for h in handles:
            h.remove()
        session = runs[path][2]
        assert session.path == path
        for lid in plan.geometry.moe_layer_ids:  # the ids each router was given are the trace's, sequence-first
            rec_MK = sequence_first_ids(plan.ids_LNK[plan.layer_index[lid]], plan.routed_N, plan.batch_size,
                                        plan.seq_len, g.num_experts)
            assert torch.equal(session.ids_MK[0][lid], rec_MK)
        assert gloo.flips(maps, session.ids_MK) == 0  # every router call routed exactly those experts
    (proj, proj_grads, _), (native, native_grads, _) = runs["project"], runs["megatron_native"]
    assert torch.equal(proj[0], native[0]) and set(proj_grads) == set(native_grads)
    assert all(torch.equal(proj_grads[n], native_grads[n]) for n in proj_grads)
    assert any(".router." in n for n in native_grads)  # the routers learn under replay


def test_example_sglang_megatron(sglang_server, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "sglang_megatron.py"), "--url", sglang_server.url,
                           "--store", str(tmp_path / "traces")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "sglang: 4 traces of qwen3_moe" in out and "megatron: path megatron_native" in out, out
    loss = float(out.split("loss ")[1].split()[0])
    grad = float(out.split("router grad norm ")[1].split(";")[0])
    assert np.isfinite(loss) and loss > 0 and grad > 0
    with DirectoryStore(tmp_path / "traces", readonly=True) as store:
        assert len(store) == 4
