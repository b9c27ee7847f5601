"""The trainer side on a GPU: HF replay on CUDA in bf16 under FSDP2 over NCCL, and the project's
collectives on an NCCL group. Needs one CUDA GPU; never run by the tests (`--plan` checks it anywhere).

One process, world size 1, `init_process_group("nccl")`: the layout verl's FSDP2 actor and Megatron-LM
start from on one GPU. Checks, each reported separately (a failure is a finding, never a stop):

  collectives   `moe_replay.collectives.collective_device` on the NCCL group (expected: this rank's
                GPU), and a real all_gather of the int64 [S, B] shapes Megatron's allgather shape
                check sends, placed by `on_collective_device` (an NCCL group serves no CPU tensors);
  hf[family]    `integrations.hf.coverage.fsdp2_replay_check`: the family's coverage model on CUDA,
                FSDP2-sharded before replay attaches, in fsdp2_bf16 (MixedPrecisionPolicy(param_dtype=
                bf16), verl's default) and fsdp2_autocast_bf16 (bf16 autocast over fp32 params):
                replaying its own routes must be bit-identical with 0 flips. Families: qwen3_moe (a
                registered adapter) and glm4_moe, deepseek_v2 (gate rules inferred at attach: the
                attach probe that once failed on sharded parameters);
  train_step    the project's tiny qwen3_moe checkpoint (build_tiny_model) sharded the same way:
                self-replay gap, and a replayed forward + backward with finite router gradients.

Prints one JSON object labelled with the GPU and torch / transformers versions.
Usage: python benchmarks/gpu_trainer.py [--families qwen3_moe,glm4_moe,deepseek_v2] [--plan]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v2")
MODES = ("fsdp2_bf16", "fsdp2_autocast_bf16")


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


def check_collectives() -> dict:
    import torch
    import torch.distributed as dist

    from moe_replay.collectives import collective_device, on_collective_device

    out: dict = {"backend": str(dist.get_backend()), "backend_config": str(dist.get_backend_config())}
    device = collective_device(None)
    out["collective_device"] = str(device)
    shapes = torch.tensor([[11, 2], [9, 2]], dtype=torch.int64)  # host ints, as the shape check builds them
    placed = on_collective_device(shapes)
    gathered = [torch.empty_like(placed) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, placed)
    out["all_gather_ok"] = bool(all(torch.equal(g.cpu(), shapes) for g in gathered))
    out["placed_on"] = str(placed.device)
    try:  # the unfixed call: CPU tensors over an NCCL group (the crash the placement prevents)
        dist.all_gather([torch.empty_like(shapes) for _ in range(dist.get_world_size())], shapes)
        out["cpu_tensors_over_nccl"] = "accepted"
    except Exception as e:  # noqa: BLE001 - the refusal is the finding
        out["cpu_tensors_over_nccl"] = _error(e)
    return out


def check_family(family: str, tmp: Path, device: str = "cuda") -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from moe_replay.integrations.hf.coverage import fsdp2_shard
    from moe_replay.integrations.hf.replay import model_geometry, replay, self_replay_gap, self_routed_trace
    from moe_replay.models import build_tiny_model
    from moe_replay.replay import build_plan

    path = build_tiny_model(family, tmp / family, seed=0)
    rng = np.random.default_rng(0)
    out: dict = {}
    for mode in MODES:
        row: dict = {}
        t0 = time.perf_counter()
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device)
            fsdp2_shard(model, torch.bfloat16 if mode == "fsdp2_bf16" else None)
            vocab = int(model.config.vocab_size)
            ctx = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if mode == "fsdp2_autocast_bf16" \
                else contextlib.nullcontext
            tokens = [rng.integers(0, vocab, n).astype(np.int64) for n in (24, 17, 31, 9)]
            with ctx():  # each sequence's own free routes, run alone as an engine runs it
                traces = [self_routed_trace(model, t, 4, f"req-{i}") for i, t in enumerate(tokens)]
            row["self_replay_gap"] = self_replay_gap(model, traces, ctx)
            row["bit_identical"] = row["self_replay_gap"] == 0.0
            plan = build_plan(traces, model_geometry(model))
            with ctx(), replay(model, plan, track_flips=True) as session:
                logits = model(**session.model_inputs()).logits
                loss = logits.float().logsumexp(-1).mean()
            loss.backward()
            row["flip_rate"] = session.flips.rate if session.flips is not None else None
            grads = [p.grad for n, p in model.named_parameters() if n.endswith(".gate.weight") and p.grad is not None]
            row["router_grads"] = len(grads)
            row["grads_finite"] = bool(grads) and all(
                bool(torch.isfinite(g.full_tensor() if hasattr(g, "full_tensor") else g).all()) for g in grads)
            del model
        except Exception as e:  # noqa: BLE001 - reported per family and mode
            row["error"] = _error(e)
            row["traceback_tail"] = traceback.format_exc()[-1500:]
        row["s"] = round(time.perf_counter() - t0, 2)
        out[mode] = row
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--plan", action="store_true", help="print the plan and exit (no GPU needed)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the same checks over gloo on the CPU (rehearses the script where no GPU is)")
    args = ap.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    if args.plan:
        print(json.dumps({"benchmark": "gpu_trainer", "families": families, "modes": MODES,
                          "checks": ["collectives", "hf"]}))
        return 0
    import torch
    import torch.distributed as dist
    import transformers

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("gpu_trainer.py needs a CUDA GPU (use --plan or --device cpu to check the script without one)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if cuda:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    result: dict = {"benchmark": "gpu_trainer", "gpu": torch.cuda.get_device_name() if cuda else "cpu",
                    "torch": torch.__version__,
                    "transformers": transformers.__version__, "world_size": 1}
    try:
        try:
            result["collectives"] = check_collectives()
        except Exception as e:  # noqa: BLE001
            result["collectives"] = {"error": _error(e), "traceback_tail": traceback.format_exc()[-1500:]}
        result["hf"] = {}
        from moe_replay.integrations.hf.coverage import fsdp2_replay_check

        for fam in families:
            result["hf"][fam] = {}
            for mode in MODES:
                try:
                    result["hf"][fam][mode] = fsdp2_replay_check(fam, args.device, mode)
                except Exception as e:  # noqa: BLE001 - a failure is a finding
                    result["hf"][fam][mode] = {"error": _error(e), "traceback_tail": traceback.format_exc()[-1500:]}
            print(json.dumps({fam: result["hf"][fam]}, default=str), file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            result["train_step"] = {"qwen3_moe": check_family("qwen3_moe", Path(tmp), args.device)}
    finally:
        dist.destroy_process_group()
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
