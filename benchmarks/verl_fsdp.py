"""verl's FSDP actor with and without a moe_replay preset: route flips, k3-KL, actor step time.

Same tiny qwen3_moe checkpoint, same seed, same steps. One vLLM-CPU engine in bfloat16 (the
trainer stays float32: the real precision mismatch) samples with moe_replay's capture at top_p
0.9; verl's FSDP2 engine (CPU, gloo, world size 1) runs verl's compute_log_prob (π_old) and one
PPO update with verl's ppo_loss per step, then its weights go back into vLLM. Arms, each its own
verl engine and weights, run interleaved within every step (the engine loads that arm's weights
before generating, so each arm samples from its own policy):
  * `verl`: verl's engine untouched (no preset; timing baseline);
  * `none`: the `none` preset: verl's numerics (free routing, full-vocab log-probs), measured;
  * `r3_support` (or `--preset`): routes replayed, log-probs renormalised over the kept set.
Flips and k3-KL are `moe_replay/route_flip_rate` and `rollout_corr/k3_kl` of the π_old pass
(trainer before its update vs the engine that sampled), mean over steps. Step time is the actor's
(π_old + update) wall and process-CPU seconds, median over steps after the first.

The machine is shared and noisy, so the ratio is also taken per step: each step's arms run back to
back (order flipped every step), and <preset> / verl of that step pairs two runs seconds apart;
the median of those paired ratios and their quartiles (`*_paired`, `*_iqr`) say how far one run's
figure can be trusted. Process CPU time is the steadier figure under load, but torch's intra-op
threads spin while they wait for a core, so the default `--threads 1` (torch.set_num_threads) keeps
it to the work itself (on this shared 2-core machine, 2 threads gave wall 1.3-2.5x CPU and ratios
of 1.1-2.1 between runs minutes apart; 1 thread, wall = CPU within 2%); `--threads 0` is torch's own. `--size bench` (8 MoE layers, 32 experts, ~57M parameters) shows
how moe_replay's fixed per-step cost shrinks against the model's compute.

Prints one JSON object: route_flip_rate_none, route_flip_rate_<preset>, k3_kl_none, k3_kl_<preset>,
step_time_s_{verl,none,<preset>}, step_time_ratio (<preset> / verl, of the medians),
step_time_ratio_vs_none, step_cpu_s_*, step_cpu_ratio, step_cpu_ratio_vs_none,
step_{time,cpu}_ratio{,_vs_none}_paired (median of per-step ratios) and _iqr ([q25, q75]), _min
(fastest step of <preset> / fastest of the baseline: load only adds time, so the minimum is the
least-disturbed run of the same work),
size, threads, load_average_1min_start, load_average_1min (at the end).

Usage: python benchmarks/verl_fsdp.py [--steps 8] [--preset r3_support] [--size tiny|bench] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _trainer_ab import ab_summary

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--preset", default="r3_support")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--size", default="tiny", choices=["tiny", "bench"], help="moe_replay.models.SIZES preset")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (0: torch's default; 1 keeps CPU time to the work on a shared machine)")
    ap.add_argument("--json", action="store_true", help="accepted for symmetry with the other benchmarks")
    a = ap.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    load_start = os.getloadavg()[0]
    if a.threads:
        torch.set_num_threads(a.threads)

    import moe_replay
    from moe_replay.integrations.verl import to_dataproto
    from moe_replay.integrations.verl.local import build_engine
    from moe_replay.integrations.verl.local import advantages_from_rewards, old_log_prob, sync_weights, update_actor
    from moe_replay.models import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_verl_"))
    model_dir = build_tiny_model("qwen3_moe", tmp / "model", size=a.size)
    llm = LLM(model=str(model_dir), dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0,
              distributed_executor_backend="uni")
    capture = moe_replay.enable("r3_support", llm=llm)  # capture records everything any arm needs
    tok = llm.get_tokenizer()
    arms = ("verl", "none", a.preset)
    engines = {arm: build_engine(str(model_dir), None if arm == "verl" else arm) for arm in arms}
    wall: dict[str, list[float]] = {arm: [] for arm in arms}
    cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    logs: dict[str, list[dict]] = {arm: [] for arm in arms}
    prompts = [f"Q: {i} + {i % 7} = ? A:" for i in range(a.prompts)]
    for step in range(a.steps):
        order = arms if step % 2 == 0 else arms[::-1]
        for arm in order:
            if step > 0:
                sync_weights(engines[arm], llm, str(model_dir), str(tmp / f"w_{arm}"))
            sp = SamplingParams(max_tokens=16, top_p=0.9, seed=step, ignore_eos=True)
            _, traces = capture.generate(prompts, sp)
            batch = to_dataproto(traces, pad_token_id=tok.pad_token_id or 0)
            rewards = torch.tensor([sum(ch.isdigit() for ch in tok.decode(t.token_ids_S[t.prompt_len:])) / 16.0
                                    for t in traces])
            advantages_from_rewards(batch, rewards)
            t0, c0 = time.perf_counter(), time.process_time()
            old, metrics = old_log_prob(engines[arm], batch)
            update_actor(engines[arm], batch.union(old))
            wall[arm].append(time.perf_counter() - t0)
            cpu[arm].append(time.process_time() - c0)
            logs[arm].append({k: statistics.fmean(v) for k, v in metrics.items()
                              if k in ("moe_replay/route_flip_rate", "rollout_corr/k3_kl")})
    capture.close()
    llm.llm_engine.engine_core.shutdown()

    out = {
        "device": "cpu (vLLM-CPU engine bf16; verl FSDP2 engine at verl's default mixed precision, bf16 params and autocast; gloo world size 1)",
        "steps": a.steps,
        "prompts": a.prompts,
        "size": a.size,
        "threads": torch.get_num_threads(),
        "load_average_1min_start": load_start,
        **ab_summary(a.preset, "verl", logs, wall, cpu, skip_first=1),  # the first step pays warm-up
        **paired_ratios(a.preset, "verl", wall, cpu, skip_first=1),
    }
    print(json.dumps(out, indent=2))


def paired_ratios(preset: str, stock: str, wall: dict[str, list[float]], cpu: dict[str, list[float]],
                  skip_first: int) -> dict[str, object]:
    """Median and quartiles of the per-step ratios <preset> / stock and <preset> / none (one step's
    arms ran back to back, so each ratio compares runs under about the same load)."""

    def q(xs: list[float]) -> tuple[float, float, float]:
        if len(xs) < 2:
            return xs[0], xs[0], xs[0]
        q25, q50, q75 = statistics.quantiles(xs, n=4, method="inclusive")
        return q50, q25, q75

    out: dict[str, object] = {}
    for kind, times in (("time", wall), ("cpu", cpu)):
        for suffix, base in (("", stock), ("_vs_none", "none")):
            ratios = [p / b for p, b in zip(times[preset][skip_first:], times[base][skip_first:])]
            med, q25, q75 = q(ratios)
            out[f"step_{kind}_ratio{suffix}_paired"] = med
            out[f"step_{kind}_ratio{suffix}_iqr"] = [q25, q75]
            # the least-disturbed step of each arm: load only ever adds time to a fixed amount of work
            out[f"step_{kind}_ratio{suffix}_min"] = min(times[preset][skip_first:]) / min(times[base][skip_first:])
    return out


if __name__ == "__main__":
    main()
