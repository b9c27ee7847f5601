"""GRPO with routing replay, in ~60 lines: real vLLM rollouts (bf16), HF training (fp32).

The demo's loop (`moe-replay demo`) without the bookkeeping. Swap the preset name to compare
fixes: "none", "r3", "r3_support", "r3_support_multisample", "r3_support_icepop".

    python examples/grpo_loop.py --preset r3_support --steps 4
"""

import argparse
import os
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine (CPU-friendly)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np
import torch
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams

import moe_replay
from moe_replay.corrections import aggregate_loss
from moe_replay.integrations.vllm import capture_engine_kwargs
from moe_replay.integrations.vllm.weights import update_weights
from moe_replay.models import build_tiny_model, parse_answer, sample_problems


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="r3_support")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="grpo-")
    model_dir = build_tiny_model("qwen3_moe", f"{work}/model")  # any local HF MoE checkpoint works

    llm = LLM(**capture_engine_kwargs(model=str(model_dir), dtype="bfloat16", enforce_eager=True, max_model_len=256,
                                      enable_prefix_caching=False, distributed_executor_backend="uni"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    mr = moe_replay.enable(args.preset, llm=llm, model=model)  # capture + replay + estimator + corrections

    for step in range(args.steps):
        problems = sample_problems(8, seed=step, max_operand=9)
        sp = SamplingParams(n=4, temperature=1.0, top_p=0.9, max_tokens=8, seed=step)
        outputs, traces = mr.generate([p.prompt for p in problems], sp, use_tqdm=False)
        rewards = np.array([[float(parse_answer(c.text) == p.answer) + 0.5 * np.mean([ch.isdigit() for ch in c.text or " "])
                             for c in out.outputs] for p, out in zip(problems, outputs)])
        adv = ((rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-6)).reshape(-1)
        pi_old = mr.pi_old(traces)  # multi-sample π_old from the engine, or None (trainer recompute)

        with mr.train_batch(traces) as batch:  # the engine's experts, the sampler's kept set
            logp = batch.logprobs(model(**batch.model_inputs()).logits)
            old = torch.from_numpy(pi_old) if pi_old is not None else logp.detach().double()
            fix = batch.corrections(old)  # e.g. TIS weights of π_old against the rollout
            adv_G = torch.from_numpy(np.repeat(adv, np.diff(batch.plan.gen_offsets_B1)))
            ratio = torch.exp(logp.double() - old)
            surrogate = torch.minimum(ratio * adv_G, ratio.clamp(0.8, 1.2) * adv_G)
            loss = aggregate_loss(-batch.to_rows(surrogate) * fix.weights_BS, fix.keep_BS)
            opt.zero_grad()
            loss.backward()
        opt.step()
        model.save_pretrained(f"{work}/sync")
        update_weights(llm, f"{work}/sync")  # trainer -> engine, in place
        k3 = float((torch.exp(logp.detach().double() - batch.rollout_logprobs) - 1
                    - (logp.detach().double() - batch.rollout_logprobs)).mean())
        print(f"step {step}: reward {rewards.mean():.3f}  loss {float(loss):+.4f}  train/rollout k3-KL {k3:.2e}")
    mr.close()


if __name__ == "__main__":
    main()
