"""GRPO with routing replay, in ~80 lines: real vLLM rollouts (bf16), HF training (fp32).

The demo's loop (`moe-replay demo`) without the bookkeeping. Swap the preset name to compare
fixes: "none", "r3", "r3_support", "r3_support_multisample", "r3_support_icepop".

Each batch gets `--epochs` updates (GRPO's μ, 2 here). On the first, π_old is the trainer's own
recompute, so the ratio is 1 and the loss's value is minus the token-mean advantage: 0 for
equal-length completions, whatever the gradient. The second update sees the moved policy, so its
loss is not 0; the gradient norm and the advantages' mean |A| show what the step learned from.
The reward (right answer, half the digit fraction, minus 0.01 per character) varies within a
group, so advantages are not all 0; a batch where they are stops the script.

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


def reward(text: str, answer: int) -> float:
    """1 for the right answer, half the digit fraction, and -0.01 per character: the untrained model
    writes no digits, so the brevity term is what differs within a group at first (every sample
    has its own length in characters)."""
    return float(parse_answer(text) == answer) + 0.5 * np.mean([ch.isdigit() for ch in text or " "]) - 0.01 * len(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="r3_support")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2, help="updates per batch (GRPO's μ)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="grpo-")
    model_dir = build_tiny_model("qwen3_moe", f"{work}/model")  # any local HF MoE checkpoint works

    llm = LLM(**capture_engine_kwargs(model=str(model_dir), dtype="bfloat16", enforce_eager=True, max_model_len=256,
                                      enable_prefix_caching=False, distributed_executor_backend="uni"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mr = moe_replay.enable(args.preset, llm=llm, model=model)  # capture + replay + estimator + corrections

    for step in range(args.steps):
        problems = sample_problems(8, seed=step, max_operand=9)
        sp = SamplingParams(n=4, temperature=1.0, top_p=0.9, max_tokens=8, seed=step)
        outputs, traces = mr.generate([p.prompt for p in problems], sp, use_tqdm=False)
        rewards = np.array([[reward(c.text, p.answer) for c in out.outputs] for p, out in zip(problems, outputs)])
        adv = ((rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-6)).reshape(-1)
        if not np.abs(adv).max() > 0:
            raise SystemExit(f"step {step}: every group's rewards are equal, so every advantage is 0; nothing to learn")
        pi_old = mr.pi_old(traces)  # multi-sample π_old from the engine, or None (trainer recompute)

        old, losses, norms = None, [], []
        for _ in range(args.epochs):
            with mr.train_batch(traces) as batch:  # the engine's experts, the sampler's kept set
                logp = batch.logprobs(model(**batch.model_inputs()).logits)
                if old is None:  # π_old: fixed for every update of this batch
                    old = torch.from_numpy(pi_old) if pi_old is not None else logp.detach().double()
                    k3 = float((torch.exp(logp.detach().double() - batch.rollout_logprobs) - 1
                                - (logp.detach().double() - batch.rollout_logprobs)).mean())
                fix = batch.corrections(old)  # e.g. TIS weights of π_old against the rollout
                adv_G = torch.from_numpy(np.repeat(adv, np.diff(batch.plan.gen_offsets_B1)))
                ratio = torch.exp(logp.double() - old)
                surrogate = torch.minimum(ratio * adv_G, ratio.clamp(0.8, 1.2) * adv_G)
                loss = aggregate_loss(-batch.to_rows(surrogate) * fix.weights_BS, fix.keep_BS)
                opt.zero_grad()
                loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            losses.append(float(loss))
        model.save_pretrained(f"{work}/sync")
        update_weights(llm, f"{work}/sync")  # trainer -> engine, in place
        print(f"step {step}: reward {rewards.mean():.3f}  mean |A| {np.abs(adv).mean():.3f}  "
              f"loss {' -> '.join(f'{x:+.4f}' for x in losses)}  grad norm {' -> '.join(f'{x:.3f}' for x in norms)}  "
              f"train/rollout k3-KL {k3:.2e}")
    mr.close()


if __name__ == "__main__":
    main()
