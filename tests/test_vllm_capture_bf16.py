"""bf16 engine: the captured routes are the ones the engine used; bad input gives clear errors."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from moe_replay.integrations.vllm import NoMoeLayersError, VllmCapture, stitch  # noqa: E402
from moe_replay.models import build_tiny_model  # noqa: E402

from .test_vllm_capture import hf_forward, make_engine, prompt_text, shutdown  # noqa: E402


def _force_routes(worker, routes_TLK: np.ndarray | None) -> None:
    """Make every router return the given ids row by row (None restores the router).

    Weights follow CPURouter's own renormalised softmax rule on the same logits, so forcing the
    ids the engine picked itself must reproduce the unforced run bit for bit.
    """
    from moe_replay.integrations.vllm.model import find_moe_layers

    for j, (_, moe) in enumerate(find_moe_layers(worker.model_runner.model)):
        router = moe.router
        if routes_TLK is None:
            router.__dict__.pop("_compute_routing", None)
            continue
        state = {"row": 0, "ids": torch.as_tensor(routes_TLK[:, j].astype(np.int64))}

        def compute(hidden_states, router_logits, indices_type, *, input_ids=None, state=state, router=router):
            n = router_logits.shape[0]
            ids = state["ids"][state["row"] : state["row"] + n]
            state["row"] += n
            vals = router_logits.gather(1, ids)
            return torch.softmax(vals, dim=-1).to(torch.float32), ids.to(torch.int32)

        router._compute_routing = compute


def _run(llm, prompt, sp):
    (out,) = llm.generate([prompt], sp, use_tqdm=False)
    lps = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    plps = [next(iter(d.values())).logprob if d else None for d in out.prompt_logprobs]
    return out, np.array(lps, dtype=np.float64), plps


def test_bf16_traces_are_what_the_engine_used(tmp_path):
    """Forcing the captured bf16 routes (same ids, same column order) back into the bf16 engine
    reproduces its logprobs bit for bit; forcing one changed expert does not. Agreement with HF
    fp32 routing is measured and printed (bf16 is expected to differ somewhere on real models)."""
    from vllm import SamplingParams

    model_dir = build_tiny_model("qwen3_moe", tmp_path / "m", seed=0)
    llm = make_engine(model_dir, dtype="bfloat16", enable_prefix_caching=False)
    try:
        prompt = prompt_text(30, seed=11)
        sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
        cap = VllmCapture(llm)
        out, lps, plps = _run(llm, prompt, sp)
        (trace,) = cap.collect([out])
        cap.uninstall()
        assert trace.engine.dtype == "bfloat16"
        routes = trace.routes_TLK.astype(np.int64)

        llm.collective_rpc(_force_routes, args=(routes,))
        out2, lps2, plps2 = _run(llm, prompt, sp)
        assert out2.outputs[0].token_ids == out.outputs[0].token_ids
        assert np.array_equal(lps2, lps) and plps2 == plps, "forcing the captured routes changed the bf16 run"

        wrong = routes.copy()
        t = len(out.prompt_token_ids) // 2
        wrong[t, 0, 0] = next(e for e in range(trace.geometry.num_experts) if e not in routes[t, 0])
        llm.collective_rpc(_force_routes, args=(wrong,))
        _, lps3, plps3 = _run(llm, prompt, sp)
        assert plps3 != plps, "a different expert set must change the run (the forcing is live)"
        llm.collective_rpc(_force_routes, args=(None,))

        hf_routes, _ = hf_forward(model_dir, trace.token_ids_S)
        agree = (np.sort(hf_routes, -1) == np.sort(routes, -1)).all(-1).mean()
        print(f"bf16 engine vs HF fp32: route sets agree on {agree:.4f} of token-layers")
    finally:
        shutdown(llm)


def test_multi_turn_new_tokens_only_then_stitch(tmp_path):
    """A second turn asks only for its new routes (routed_experts_prompt_start) and the client
    stitches it onto the first turn: the result equals HF's routing of the whole conversation."""
    from vllm import SamplingParams

    model_dir = build_tiny_model("qwen3_moe", tmp_path / "m", seed=0)
    llm = make_engine(model_dir)
    try:
        cap = VllmCapture(llm)
        (o1,), (t1,) = cap.generate([prompt_text(40, seed=21)], SamplingParams(max_tokens=5, ignore_eos=True))
        turn2 = [*t1.token_ids_S.tolist(), *llm.get_tokenizer().encode(" dog expert", add_special_tokens=False)]
        sp2 = SamplingParams(max_tokens=5, ignore_eos=True, routed_experts_prompt_start=t1.num_tokens - 1)
        (o2,), (t2,) = cap.generate([{"prompt_token_ids": turn2}], sp2)
        assert t2.route_start == t1.num_tokens - 1 and o2.num_cached_tokens > 0
        full = stitch(t1, t2)
        hf_routes, _ = hf_forward(model_dir, full.token_ids_S)
        assert full.route_start == 0
        assert np.array_equal(np.sort(full.routes_TLK, -1), np.sort(hf_routes, -1).astype(full.routes_TLK.dtype))
    finally:
        shutdown(llm)


def test_model_without_moe_layers_is_refused(tmp_path):
    """A dense model: attaching capture fails with NoMoeLayersError that names the model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    src = build_tiny_model("qwen3_moe", tmp_path / "moe", seed=0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    dense = tmp_path / "dense"
    Qwen3ForCausalLM(cfg).save_pretrained(dense)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (dense / f.name).write_bytes(f.read_bytes())
    llm = make_engine(dense)
    try:
        with pytest.raises(NoMoeLayersError, match="no MoE layer"):
            VllmCapture(llm)
    finally:
        shutdown(llm)
