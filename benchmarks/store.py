"""Route storage cost and codec speed, per record as the stores hold them.

Two workloads:
  real       routes of the tiny local models (qwen3_moe, mixtral, olmoe; HF, fp32) run on real
             text: the Python standard library's own source files, tokenised with each model's
             tokenizer, cut into 1024-token sequences (deterministic, present on every machine);
  synthetic  Qwen3-30B-A3B geometry (48 MoE layers, 128 experts, top-8): per layer, expert
             popularity p_e ∝ exp(N(0, sigma²)) (sigma = 0.5: the busiest expert gets ~3x the
             mean load), each token draws 8 distinct experts without replacement by Gumbel top-k,
             columns in descending score order as a sorted top-k emits them.

Prints one JSON object: per workload, bytes_per_token_layer for int32 / uint8 / moe_replay /
bound (= log2(E!/(E-K)!) / 8), and encode/decode token-layers per second of the moe_replay
codec on one core (process pinned to one CPU, best of `--repeats` timed passes).

Usage: python benchmarks/store.py --json [--sequences N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moe_replay.codec import ROUTE_CODECS, bound_bits_per_token_layer

CODEC_KEYS = {"int32": "int32", "uint8": "narrow", "moe_replay": "moe_replay"}


def pin_one_core() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass


def synthetic_routes(num_seqs: int, seq_len: int, *, layers=48, experts=128, top_k=8, sigma=0.5, seed=0):
    rng = np.random.default_rng(seed)
    logpop_LE = rng.normal(0.0, sigma, (layers, experts))
    out = []
    for _ in range(num_seqs):
        score_TLE = rng.gumbel(size=(seq_len, layers, experts)).astype(np.float32) + logpop_LE
        top_TLK = np.argpartition(-score_TLE, top_k, axis=-1)[..., :top_k]
        order = np.argsort(-np.take_along_axis(score_TLE, top_TLK, -1), axis=-1)
        out.append(np.take_along_axis(top_TLK, order, -1).astype(np.uint8))
    return out, experts, top_k


def real_text_token_ids(tokenizer, num_seqs: int, seq_len: int) -> list[list[int]]:
    src = sorted(Path(os.__file__).parent.glob("*.py"))
    seqs, buf = [], []
    for path in src:
        buf += tokenizer(path.read_text(errors="replace"))["input_ids"]
        while len(buf) >= seq_len and len(seqs) < num_seqs:
            seqs.append(buf[:seq_len])
            buf = buf[seq_len:]
        if len(seqs) >= num_seqs:
            break
    return seqs


def real_routes(family: str, num_seqs: int, seq_len: int, workdir: Path):
    """Routes the HF model itself chose on real text: forward hooks on each MoE router."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_replay.models import build_tiny_model, geometry_of

    model_dir = build_tiny_model(family, workdir / family, seed=0)
    geometry = geometry_of(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        model.model.layers[i].mlp.gate.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out[2]))
        for i in geometry.moe_layer_ids
    ]
    out = []
    with torch.no_grad():
        for ids in real_text_token_ids(tok, num_seqs, seq_len):
            model(torch.tensor([ids]))
            # the last token is never forwarded by a rollout engine: S tokens -> S-1 route rows
            out.append(torch.stack([captured[i][:-1] for i in geometry.moe_layer_ids], dim=1).numpy().astype(np.uint8))
    for h in hooks:
        h.remove()
    return out, geometry.num_experts, geometry.top_k


def measure(routes_list: list[np.ndarray], experts: int, top_k: int, repeats: int) -> dict:
    token_layers = sum(r.shape[0] * r.shape[1] for r in routes_list)
    sizes = {}
    for key, name in CODEC_KEYS.items():
        codec = ROUTE_CODECS.get(name)
        sizes[key] = sum(len(codec.encode(r, experts)[0]) for r in routes_list) / token_layers
    sizes["bound"] = bound_bits_per_token_layer(experts, top_k) / 8

    codec = ROUTE_CODECS.get("moe_replay")
    encoded = [codec.encode(r, experts) for r in routes_list]
    for r, (data, params) in zip(routes_list, encoded):  # exact round trip, or the numbers are void
        if not np.array_equal(codec.decode(data, r.shape, experts, params), r):
            raise SystemExit("moe_replay codec failed to round-trip a benchmark record")
    enc_s, dec_s = [], []
    for _ in range(repeats):  # interleave encode and decode passes so drift hits both alike
        t0 = time.perf_counter()
        for r in routes_list:
            codec.encode(r, experts)
        t1 = time.perf_counter()
        for r, (data, params) in zip(routes_list, encoded):
            codec.decode(data, r.shape, experts, params)
        t2 = time.perf_counter()
        enc_s.append(t1 - t0)
        dec_s.append(t2 - t1)
    return {
        "bytes_per_token_layer": {k: round(v, 4) for k, v in sizes.items()},
        "moe_replay_over_bound": round(sizes["moe_replay"] / sizes["bound"], 4),
        "encode_token_layers_per_s": round(token_layers / min(enc_s)),
        "decode_token_layers_per_s": round(token_layers / min(dec_s)),
        "token_layers": token_layers,
        "records": len(routes_list),
        "experts": experts,
        "top_k": top_k,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    ap.add_argument("--sequences", type=int, default=16, help="records per workload")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--families", default="qwen3_moe,mixtral,olmoe")
    args = ap.parse_args(argv)
    pin_one_core()

    result: dict = {"workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        real_all, per_family = [], {}
        for family in args.families.split(","):
            routes, e, k = real_routes(family, args.sequences, 1024, Path(tmp))
            per_family[family] = measure(routes, e, k, args.repeats)
            real_all.append((routes, e, k))
        # one combined real row: all tiny models share E and K, so their records pool cleanly
        assert len({(e, k) for _, e, k in real_all}) == 1
        pooled = [r for routes, _, _ in real_all for r in routes]
        real = measure(pooled, real_all[0][1], real_all[0][2], args.repeats)
        real["per_family"] = {f: m["bytes_per_token_layer"] for f, m in per_family.items()}
        result["workloads"]["real"] = real
    routes, e, k = synthetic_routes(args.sequences, 2048)
    result["workloads"]["synthetic_qwen3_30b_a3b"] = measure(routes, e, k, args.repeats)
    result["targets"] = {
        "moe_replay_at_or_below_bound": all(
            w["bytes_per_token_layer"]["moe_replay"] <= w["bytes_per_token_layer"]["bound"] for w in result["workloads"].values()
        ),
        "decode_ge_20M": all(w["decode_token_layers_per_s"] >= 20e6 for w in result["workloads"].values()),
        "encode_ge_10M": all(w["encode_token_layers_per_s"] >= 10e6 for w in result["workloads"].values()),
    }
    print(json.dumps(result, indent=None if args.json else 2))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
