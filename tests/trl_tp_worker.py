"""One rank of TRL's GRPOTrainer with a tensor-parallel colocated vLLM engine (tests/test_trl_tp.py).

Run by torchrun with 2 ranks: TRL gathers both ranks' prompts into one generate call on the
engine sharded over the pair (vLLM's external launcher), and each rank keeps its share. Each rank
writes what it trained on to OUT/rank{R}.json.
"""

from __future__ import annotations

import json
import os
import sys


def main(model_dir: str, out_dir: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from moe_replay.integrations.trl import MoeReplayGRPOTrainer

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ds = Dataset.from_dict({"prompt": [f"Q: {i} + {i % 7} = ? A:" for i in range(16)]})
    args = GRPOConfig(output_dir=f"{out_dir}/trainer", use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=2,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=1,
                      use_cpu=True, report_to=[], logging_steps=1, vllm_max_model_length=256, top_p=0.9,
                      seed=0, save_strategy="no", learning_rate=1e-3, disable_tqdm=True, vllm_enable_sleep_mode=False)
    trainer = MoeReplayGRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                                   args=args, train_dataset=ds, processing_class=AutoTokenizer.from_pretrained(model_dir),
                                   moe_replay="r3_support")
    seen: list[list[int]] = []
    original = trainer._generate_and_score_completions

    def spy(inputs):  # the rows this rank trains on, and their traces' sampled tokens
        out = original(inputs)
        for row, trace in zip(out["completion_ids"].tolist(), out["moe_replay_traces"]):
            gen = trace.token_ids_S[trace.prompt_len:].tolist()
            seen.append([row[:len(gen)], gen])
        return out

    trainer._generate_and_score_completions = spy
    trainer.train()
    steps = [h for h in trainer.state.log_history if "moe_replay/route_flip_rate" in h]
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"rows": seen, "steps": steps}, f)
    trainer.close_moe_replay()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
