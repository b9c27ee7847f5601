"""TRL's GRPOTrainer with moe_replay switched on: your GRPO script, with two lines changed.

    - from trl import GRPOTrainer
    + from moe_replay.integrations.trl import MoeReplayGRPOTrainer
    - trainer = GRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=ds)
    + trainer = MoeReplayGRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=ds, moe_replay="r3_support")

TRL generates with its colocated vLLM engine (`use_vllm=True, vllm_mode="colocate"`); moe_replay
captures each completion's experts and kept set there, replays them in the trainer's forward and
renormalises its logprobs over the kept set. Its metrics land in TRL's log (`rollout_corr/*`,
`moe_replay/*`). Runs as is on CPU with a tiny local MoE model (a GPU machine needs only
`use_cpu=False` and its own model):

    python examples/trl_grpo.py [--steps 2] [--preset r3_support]
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM-CPU: engine core in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU

import argparse
import tempfile

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from moe_replay.integrations.trl import MoeReplayGRPOTrainer
from moe_replay.models import build_tiny_model


def digits_reward(completions, **kwargs):
    """Your reward function, unchanged: here, the share of digits in the completion."""
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--preset", default="r3_support")
    a = ap.parse_args()

    model_dir = build_tiny_model("qwen3_moe", tempfile.mkdtemp() + "/model")  # your MoE checkpoint here
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = Dataset.from_dict({"prompt": [f"Q: {i} + {i % 7} = ? A:" for i in range(32)]})
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(), max_steps=a.steps, learning_rate=1e-3, logging_steps=1, report_to=[],
        per_device_train_batch_size=8, num_generations=4, max_completion_length=12, top_p=0.9,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256,
        use_cpu=True, save_strategy="no", disable_tqdm=True,  # CPU machine; drop on GPU (bf16 autocast: TRL's default)
    )
    trainer = MoeReplayGRPOTrainer(model=model, reward_funcs=digits_reward, args=args, train_dataset=dataset,
                                   processing_class=AutoTokenizer.from_pretrained(model_dir), moe_replay=a.preset)
    trainer.train()
    for log in trainer.state.log_history:
        if "moe_replay/route_flip_rate" in log:
            print(f"step {log['step']}: route_flip_rate {log['moe_replay/route_flip_rate']:.4f} "
                  f"k3_kl {log['rollout_corr/k3_kl']:.2e} reward {log['reward']:.3f}")


if __name__ == "__main__":
    main()
