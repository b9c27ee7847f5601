"""Multi-turn records: what keeping every turn's kept sets (schema v3 spans) changes in the trainer.

A vLLM-CPU engine in bf16 samples `--conversations` two-turn conversations of the tiny qwen3_moe
(turn 1: `--tokens` tokens at top_p 0.9; tool text; turn 2: the same, recording only its new
routes), captured (routes, kept sets, logprobs) and stitched into one record each. The HF fp32
trainer replays the engine's routes and scores every sampled token; k3-KL (verl's
rollout_corr/k3_kl) against the engine's logprobs is reported per turn for
  * kept-set scoring of every turn (the record keeps each turn's kept sets now), and
  * full-vocabulary scoring of the earlier turn (what a record holding only the latest turn's
    kept sets made the trainer do before).

Prints one JSON object (--json): k3_kl_turn1_kept_set, k3_kl_turn1_full_vocab, k3_kl_turn2_kept_set,
turn1_tokens, turn2_tokens, tool_tokens, multi_span_records.

Usage: python benchmarks/multi_turn.py --json [--conversations 8] [--tokens 12]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from moe_replay.integrations.hf import model_geometry, replay  # noqa: E402
from moe_replay.metrics import logprob_mismatch_metrics  # noqa: E402
from moe_replay.models import build_tiny_model  # noqa: E402
from moe_replay.replay import build_plan, score_tokens  # noqa: E402
from moe_replay.trace import stitch  # noqa: E402

TOOL_TEXT = " tool result: 42 items found. Next:"


def conversations(model_dir: Path, n: int, tokens: int):
    from vllm import LLM, SamplingParams

    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture, capture_engine_kwargs

    llm = LLM(**capture_engine_kwargs(model=str(model_dir), dtype="bfloat16", enforce_eager=True, max_model_len=512,
                                      max_num_seqs=8, seed=0, distributed_executor_backend="uni"))
    try:
        cap = VllmCapture(llm, CaptureConfig())
        sp = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=tokens, ignore_eos=True, seed=i) for i in range(n)]
        _, first = cap.generate([f"Q{i}: how many {i % 5} experts route the token? A:" for i in range(n)], sp)
        tool = llm.get_tokenizer().encode(TOOL_TEXT, add_special_tokens=False)
        sp2 = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=tokens, ignore_eos=True, seed=100 + i,
                              routed_experts_prompt_start=t.num_tokens - 1) for i, t in enumerate(first)]
        _, second = cap.generate([{"prompt_token_ids": [*t.token_ids_S.tolist(), *tool]} for t in first], sp2)
        cap.uninstall()
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return [stitch(a, b) for a, b in zip(first, second)], len(tool)


def k3(train_G: torch.Tensor, engine_G: torch.Tensor) -> float:
    ones = torch.ones_like(engine_G, dtype=torch.bool)
    return logprob_mismatch_metrics(train_G[None].double(), engine_G[None].double(), ones[None])["rollout_corr/k3_kl"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model("qwen3_moe", Path(tmp) / "m", seed=0)
        records, tool_len = conversations(model_dir, args.conversations, args.tokens)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    plan = build_plan(records, model_geometry(model))
    with torch.no_grad(), replay(model, plan) as session:
        logits = model(**session.model_inputs()).logits
    kept_G = score_tokens(logits, plan).logprobs_G
    full_G = score_tokens(logits, plan, use_support=False).logprobs_G
    eng_G = plan.engine_logprobs_G
    turn1_G = torch.zeros(len(eng_G), dtype=torch.bool)  # rows of each record's first span
    for b, r in enumerate(records):
        turn1_G[int(plan.gen_offsets_B1[b]): int(plan.gen_offsets_B1[b]) + r.spans[0][1] - r.spans[0][0]] = True
    out = {
        "k3_kl_turn1_kept_set": k3(kept_G[turn1_G], eng_G[turn1_G]),
        "k3_kl_turn1_full_vocab": k3(full_G[turn1_G], eng_G[turn1_G]),
        "k3_kl_turn2_kept_set": k3(kept_G[~turn1_G], eng_G[~turn1_G]),
        "turn1_tokens": int(turn1_G.sum()),
        "turn2_tokens": int((~turn1_G).sum()),
        "tool_tokens": tool_len * len(records),
        "multi_span_records": sum(r.multi_span for r in records),
    }
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
