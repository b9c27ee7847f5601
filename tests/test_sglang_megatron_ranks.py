"""SGLang rollouts in the Megatron-core cells the project runs on several ranks: EP = 2 with the all-to-all
dispatcher and PP = 2 through Megatron's own 1F1B schedule, each stage reading its own layer's routes from
the store (tests/megatron_ep_worker.py, tests/megatron_pp_worker.py, the same workers and shims).

The traces come from the session's SGLang server (tiny qwen3_moe: 2 MoE layers, 8 experts, top-2) through a
DirectoryStore; the workers' GPTModel takes that geometry (`_gpt` below, swapped in before each worker runs).
As in the project's cells the model is a fresh one, not SGLang's weights (no HF -> Megatron converter): what
is proven is that SGLang's recorded experts reach every router on every rank, and that the ranks' logits equal
one process replaying the same routes.
"""

from __future__ import annotations

import functools

import pytest
import torch

from moe_replay.geometry import ModelGeometry
from moe_replay.integrations.sglang import SglangCapture
from moe_replay.replay import PlanConfig, build_plan
from moe_replay.store import DirectoryStore

from . import megatron_gloo as gloo
from . import megatron_ep_worker as ep
from . import megatron_pp_worker as pp

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.sglang, pytest.mark.slow]

GEOMETRY = ModelGeometry(num_layers=2, moe_layer_ids=(0, 1), num_experts=8, top_k=2, vocab_size=512, family="qwen3_moe")
"""The tiny qwen3_moe SGLang serves in the bed (checked against the traces)."""
PROMPTS = [[5, 17, 33, 90, 101, 7, 250, 3], [9, 44, 12, 300, 71, 2, 18, 64]]
"""Token-id prompts of one length: with 8 new tokens every trace has 16, so PP's micro-batches share [S, B]."""


def _gpt(*, dispatcher: str = "allgather", bf16: bool = False, ep_size: int = 1, pp_size: int = 1, pp_rank: int = 0):
    """The workers' GPTModel with GEOMETRY's layers, experts, top-k and vocabulary (their other settings kept)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    g = GEOMETRY
    extra = dict(pipeline_model_parallel_size=pp_size, pipeline_dtype=torch.float32, batch_p2p_comm=False) if pp_size > 1 else {}
    cfg = TransformerConfig(num_layers=g.num_layers, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                            moe_ffn_hidden_size=32, num_moe_experts=g.num_experts, moe_router_topk=g.top_k,
                            moe_layer_freq=[int(i in g.moe_layer_ids) for i in range(g.num_layers)],
                            moe_enable_routing_replay=True, use_cpu_initialization=True, moe_router_dtype="fp32",
                            add_bias_linear=False, moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=ep_size,
                            **extra)
    torch.manual_seed(0)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, **({"pp_rank": pp_rank} if pp_size > 1 else {}))
    return GPTModel(cfg, spec, vocab_size=g.vocab_size, max_sequence_length=64, pre_process=pp_rank == 0,
                    post_process=pp_rank == pp_size - 1, share_embeddings_and_output_weights=False).eval()


WORKERS = {"ep": ep, "pp": pp}


def _as_sglang(module) -> None:
    """In a spawned worker: its module builds GEOMETRY's model."""
    if module is ep:
        ep._gpt = lambda size, bf16=False, dispatcher="alltoall": _gpt(dispatcher=dispatcher, ep_size=size)
    else:
        pp._gpt = lambda size, rank: _gpt(pp_size=size, pp_rank=rank)
        pp.NUM_LAYERS = GEOMETRY.num_layers  # each stage's first layer: rank * NUM_LAYERS // 2


def _run(which: str, name: str, *args, **kwargs):
    """A worker function of tests/megatron_{which}_worker.py, run on GEOMETRY's model (picklable for spawn)."""
    _as_sglang(WORKERS[which])
    return getattr(WORKERS[which], name)(*args, **kwargs)


@pytest.fixture(scope="module")
def stored(sglang_server, tmp_path_factory):
    """(store path, traces): 2 prompts x n = 2 from SGLang, 8 new tokens each, routes kept as shared chunks."""
    path = tmp_path_factory.mktemp("sglang_megatron_ranks") / "store"
    with DirectoryStore(path, chunk_min_bytes=1) as store:
        _, traces = SglangCapture(sglang_server.url).generate(
            PROMPTS, {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "max_new_tokens": 8, "ignore_eos": True, "n": 2},
            store=store)
    assert all(t.geometry == GEOMETRY and t.num_tokens == 16 for t in traces)
    return path, traces


def test_ep2_alltoall_replays_sglang_routes(stored, tmp_path):
    _, traces = stored
    plans = [build_plan(traces[:2], GEOMETRY), build_plan(traces[2:3], GEOMETRY)]  # [16, 2] and [16, 1]: unequal
    ref, ranks = gloo.reference_then_ranks(tmp_path, functools.partial(_run, "ep", "reference_worker"),
                                           functools.partial(_run, "ep", "ep_worker"), plans)
    assert [x["local_experts"] for x in ranks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for rank, x in enumerate(ranks):
        assert x["dispatcher"] == "MoEAlltoAllTokenDispatcher" and x["flips"] == 0
        for lid in GEOMETRY.moe_layer_ids:
            assert torch.equal(x["ids"][lid], ref["ids"][rank][lid])
        assert float((x["logits"] - ref["logits"][rank]).abs().max()) <= 2e-5
    assert ref["flips"] == 0
    assert max(float((a - b).abs().max()) for a, b in zip(ref["logits"], ref["free_logits"])) > 1e-3


def test_pp2_stages_read_their_layers_of_sglang_routes(stored, tmp_path):
    path, traces = stored
    plans = [build_plan(traces[:2], GEOMETRY, config=PlanConfig(pad_to_multiple_of=4)),
             build_plan(traces[2:], GEOMETRY, config=PlanConfig(pad_to_multiple_of=4))]
    ref, stages = gloo.reference_then_ranks(tmp_path, functools.partial(_run, "pp", "reference_worker"),
                                            functools.partial(_run, "pp", "stage_worker", store=str(path)), plans)
    first, last = stages
    assert first["layers"] == (0,) and last["layers"] == (1,)
    for stage in stages:
        (lid,) = stage["layers"]
        assert stage["calls"] == {lid: 2} and stage["forward_takes"] == [{lid: 1}, {lid: 1}] and stage["flips"] == 0
        assert stage["plan_layers"] == [(lid,)] * 2  # planned from its own layer's routes, read from the store
        for m in (0, 1):
            assert torch.equal(stage["ids"][m][lid], ref["ids"][m][lid])
    assert first["logits"] == [] and len(last["logits"]) == 2
    assert max(float((a - b).abs().max()) for a, b in zip(last["logits"], ref["logits"])) <= 2e-5
