"""Switching a preset on inside a verl/TRL-style trainer: three hooks, nothing else changes.

A verl- or TRL-style loop has three places that matter: rollout generation, the log-prob
recompute (π_old) and the policy update. moe_replay plugs into each; the rest of your trainer
(advantage estimation, optimizer, weight sync) stays as it is. Runs as is on the tiny model:

    python examples/verl_style_preset.py
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import tempfile

import torch
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams

import moe_replay
from moe_replay.integrations.vllm import capture_engine_kwargs
from moe_replay.models import build_tiny_model

# trainer config, e.g. `actor_rollout_ref.moe_replay.preset: r3_support_multisample` in a verl YAML
PRESET = "r3_support_multisample"


class Trainer:
    def __init__(self, llm, model):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.mr = moe_replay.enable(PRESET, llm=llm, model=model)  # <- the one line that switches it on

    def generate_sequences(self, prompts):  # verl: actor_rollout_wg.generate_sequences
        _, traces = self.mr.generate(prompts, SamplingParams(n=2, top_p=0.9, max_tokens=6), use_tqdm=False)
        return traces  # carry these in your batch (DataProto / dict) next to the token ids

    def compute_log_prob(self, traces):  # verl: compute_log_prob -> old_log_probs
        est = self.mr.pi_old(traces)  # engine re-scoring when the preset asks for it
        if est is not None:
            return torch.from_numpy(est)
        with torch.no_grad(), self.mr.train_batch(traces) as batch:
            return batch.logprobs(self.model(**batch.model_inputs()).logits).double()

    def update_policy(self, traces, old_logprobs, advantages):  # verl: update_actor
        with self.mr.train_batch(traces) as batch:
            logp = batch.logprobs(self.model(**batch.model_inputs()).logits)
            fix = batch.corrections(old_logprobs)  # preset's TIS / IcePop / ... vs the rollout
            ratio = torch.exp(logp.double() - old_logprobs)
            loss_BS = -batch.to_rows(ratio * advantages) * fix.weights_BS
            loss = (loss_BS * fix.keep_BS).sum() / fix.keep_BS.sum().clamp(min=1)
            self.opt.zero_grad()
            loss.backward()  # inside the `with`: activation recompute replays the same routes
        self.opt.step()
        return {"loss": float(loss), **fix.metrics}


if __name__ == "__main__":
    model_dir = build_tiny_model("qwen3_moe", tempfile.mkdtemp() + "/m")
    llm = LLM(**capture_engine_kwargs(model=str(model_dir), dtype="bfloat16", enforce_eager=True, max_model_len=256,
                                      enable_prefix_caching=False, distributed_executor_backend="uni"))
    trainer = Trainer(llm, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    traces = trainer.generate_sequences(["Q: 2+3=? A:", "Q: 7-4=? A:"])
    old = trainer.compute_log_prob(traces)
    adv = torch.linspace(-1, 1, len(old), dtype=torch.float64)  # your advantage estimator here
    stats = trainer.update_policy(traces, old, adv)
    print({k: round(v, 5) for k, v in stats.items() if k in ("loss", "moe_replay/corr/weight_mean")})
