"""Model Runner V2 on a GPU: which runner each engine runs, what capture takes from it, and whether
its traces replay (prints JSON). Written for the lent GPU machine's vLLM (0.26) and any later one.

Two variants of one tiny qwen2_moe checkpoint (the family vLLM 0.26 runs on MRV2 by default), each in
a process of its own (vLLM reads VLLM_USE_V2_MODEL_RUNNER once per process):
  mrv2   VLLM_USE_V2_MODEL_RUNNER=1: `engine_runner` says which runner the engine will run, and
         `capture_engine_kwargs` either accepts it (a release whose MRV2 has what capture's hooks read,
         runners/mrv2.py: 0.30 on; no native-output flag is ever added) or refuses by name (0.26-0.29:
         VllmReleaseError naming `Sampler._sample_random`, which their MRV2 lacks). Where it is
         accepted: an engine under CUDA graphs, capture by hooks, HF fp32 replay of the traces.
  v1     VLLM_USE_V2_MODEL_RUNNER=0: the same on the V1 runner.
Per variant: `engine_runner`, `accepted` (or `refused`: the error's class and message), and where a
run happened `traces`, `flips` (HF's own routing vs the trace's, token-layers), `token_layers`,
`max_abs_logprob` (HF fp32 replay vs the bf16 engine: bf16 rounding, not replay), `seconds`.
`--dry-run` (any machine) reports the runner and the acceptance only, no engine.

Usage: python benchmarks/gpu_mrv2.py [--dry-run] [--variants mrv2,v1] [--prompts 16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = {"mrv2": "1", "v1": "0"}
"""Variant -> VLLM_USE_V2_MODEL_RUNNER."""
MODEL = dict(family="qwen2_moe", size="tiny")


def _versions() -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    try:
        import vllm

        out["vllm"] = vllm.__version__
    except ImportError as e:
        out["vllm"] = f"not importable: {e}"
    return out


def child(variant: str, model_dir: str, dry_run: bool, prompts: int, max_tokens: int) -> dict:
    """One variant, in a process whose VLLM_USE_V2_MODEL_RUNNER the parent set."""
    from moe_replay.integrations.vllm import capture_engine_kwargs
    from moe_replay.integrations.vllm.engine_kwargs import NATIVE_FLAGS, engine_runner

    kw = dict(model=model_dir, dtype="bfloat16", max_model_len=512, max_num_seqs=prompts, seed=0,
              gpu_memory_utilization=0.2, enable_prefix_caching=True)
    out: dict = {"variant": variant, "env": os.environ.get("VLLM_USE_V2_MODEL_RUNNER")}
    t0 = time.perf_counter()
    try:
        out["engine_runner"] = engine_runner(kw)
        built = capture_engine_kwargs(**kw)
        out["accepted"] = True
        out["native_flags"] = sorted(k for k in NATIVE_FLAGS if k in built)
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        out.update(accepted=False, refused=f"{type(e).__name__}: {e}")
        return out
    if dry_run:
        return out
    from vllm import LLM, SamplingParams

    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture

    spec = importlib.util.spec_from_file_location("engine_modes", HERE / "_engine_modes.py")
    modes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(modes)
    llm = LLM(**built)
    try:
        with VllmCapture(llm, CaptureConfig()) as cap:
            out["source"] = {"native": sorted(cap.plan.native), "hooks": sorted(cap.plan.hooks), "runner": cap.runner_path}
            params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, ignore_eos=True, seed=i)
                      for i in range(prompts)]
            _, traces = cap.generate(modes_prompts(prompts), params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    rows = modes.replay_deltas(model_dir, traces)
    out.update(traces=len(traces), flips=sum(r["flips"] for r in rows), token_layers=sum(r["token_layers"] for r in rows),
               max_abs_logprob=float(max(r["delta_G"].max() for r in rows)), seconds=round(time.perf_counter() - t0, 1))
    return out


def modes_prompts(n: int) -> list[str]:
    import numpy as np

    words = "the cat route token model expert layer sample mixture alpha beta dog".split()
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(words, int(rng.integers(8, 33)))) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", "--plan", dest="dry_run", action="store_true")
    ap.add_argument("--variants", default="mrv2,v1")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per variant")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.model_dir, args.dry_run, args.prompts, args.max_tokens)))
        return 0
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"--variants: unknown {bad}; choose from {','.join(VARIANTS)}")
    from moe_replay.models import build_tiny_model
    from moe_replay.report.bench import last_json_object

    out: dict = {"benchmark": "gpu_mrv2", "dry_run": args.dry_run, "model": MODEL, **_versions(), "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(MODEL)
        model_dir = str(build_tiny_model(spec.pop("family"), Path(tmp) / "model", seed=0, **spec))
        for v in variants:
            env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": VARIANTS[v]}
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", v, "--model-dir", model_dir,
                   "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens)] + (["--dry-run"] if args.dry_run else [])
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
                row = last_json_object(proc.stdout) if proc.returncode == 0 else None
                out["variants"][v] = row if row is not None else {"rc": proc.returncode, "error": proc.stderr[-3000:]}
            except subprocess.TimeoutExpired:
                out["variants"][v] = {"timed_out": True, "limit_s": args.timeout_s}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
