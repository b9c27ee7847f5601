import tempfile

import torch
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams

import moe_replay
from moe_replay.corrections import aggregate_loss
from moe_replay.integrations.vllm import capture_engine_kwargs
from moe_replay.models import build_tiny_model

path = build_tiny_model("qwen3_moe", tempfile.mkdtemp())  # or your MoE checkpoint's directory
llm = LLM(**capture_engine_kwargs(model=path, dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False))
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
prompts = ["3+4=", "12+9=", "7*6="]

with moe_replay.enable("r3_support", llm=llm, model=model) as mr:  # a preset name or a YAML path
    outputs, traces = mr.generate(prompts, SamplingParams(n=4, top_p=0.9, max_tokens=8))  # one trace per sample
    pi_old = mr.pi_old(traces)                  # multi-sample π_old when the preset asks, else None
    with mr.train_batch(traces) as batch:       # the engine's experts are forced in the trainer
        logp_G = batch.logprobs(model(**batch.model_inputs()).logits)  # generated tokens, over the kept set
        adv_G = torch.randn_like(logp_G)        # your advantage per generated token
        fix = batch.corrections(logp_G.detach())  # the preset's IS weights / masks vs the rollout
        loss = aggregate_loss(-batch.to_rows(logp_G * adv_G) * fix.weights_BS, fix.keep_BS)
        loss.backward()                         # inside: activation recompute replays the same routes
print(f"loss {loss.item():.4f}")                # on leaving `with`, capture is detached from the engine
