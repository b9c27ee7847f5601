"""The sidecar layout of benchmarks/estimator.py: a rollout AsyncLLM and a scoring AsyncLLM (with
the EstimatorService) each pinned to its own core, and the /proc affinity readers that record it.
estimator.py's docstring describes the layout and what each figure measures."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import time
import uuid
from pathlib import Path

import numpy as np

from moe_replay.estimator.core import EstimatorConfig

SIDECAR_N = 4
"""Replicas per rollout in the sidecar figures."""
BLOCK = 32
"""KV block size of every engine here: prompt reuse reads whole blocks and the prompts are 20-83
tokens; vLLM-CPU's default is 128 and its attention takes multiples of 32 only."""


# -- CPU affinity -----------------------------------------------------------------------------------
def pin_process(cpus: set[int]) -> None:
    """Pin every thread of this process (sched_setaffinity(0) would pin the calling thread only);
    threads and processes started afterwards inherit the mask."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that just exited
            pass


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def affinity_tree(pid: int) -> list[dict]:
    """This process and its descendants: name, thread count, the union of its threads' CPU masks."""
    rows, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        try:
            name = Path(f"/proc/{p}/comm").read_text().strip()
            cpus: set[int] = set()
            tids = os.listdir(f"/proc/{p}/task")
            for tid in tids:
                try:
                    cpus |= os.sched_getaffinity(int(tid))
                except OSError:
                    pass
        except OSError:
            continue
        rows.append({"pid": p, "name": name, "threads": len(tids), "cpus": sorted(cpus)})
        todo += _children(p)
    return rows


# -- the sidecar layout ----------------------------------------------------------------------------
class Sidecar:
    """Rollout AsyncLLM on one core, scoring AsyncLLM + EstimatorService on the other."""

    def __init__(self, model_dir: str, dtype: str, requests: int, eager: bool) -> None:
        self.model_dir, self.dtype, self.requests = model_dir, dtype, requests
        self.engine_kw = dict(model=model_dir, dtype=dtype, enforce_eager=eager, max_model_len=512,
                              max_num_seqs=max(8, requests * SIDECAR_N), max_num_batched_tokens=2048, seed=0,
                              distributed_executor_backend="uni", block_size=BLOCK)
        self.loop = asyncio.new_event_loop()
        self.rollouts_done_s: dict[str, list[float]] = {}

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def start(self, rollout_cpus: set[int], scoring_cpus: set[int]) -> None:
        self.run(self._start(rollout_cpus, scoring_cpus))

    async def _start(self, rollout_cpus, scoring_cpus) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from moe_replay.estimator.service import ServiceConfig
        from moe_replay.integrations.vllm import (AsyncVllmCapture, AsyncVllmScorer, CaptureConfig, VllmScorerConfig,
                                                  capture_engine_kwargs, scoring_engine_kwargs)

        pid = os.getpid()
        before = {r["pid"] for r in affinity_tree(pid)}
        # one OpenMP thread per engine process (each owns one core; two spinning OMP threads on one
        # core are ~10x slower); read by each engine process when it imports torch
        omp = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        pin_process(rollout_cpus)  # the rollout engine core is spawned under this mask
        self.roll = AsyncLLM.from_engine_args(AsyncEngineArgs(**capture_engine_kwargs(**self.engine_kw)))
        roll_pids = {r["pid"] for r in affinity_tree(pid)} - before
        pin_process(scoring_cpus)  # the scoring engine core, and this client from here on
        self.score_engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**scoring_engine_kwargs(**self.engine_kw)))
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = omp
        score_pids = {r["pid"] for r in affinity_tree(pid)} - before - roll_pids
        self.roles = {pid: "client (asyncio: streams, collect, EstimatorService)"}
        for pids, role in ((roll_pids, "rollout engine core (AsyncLLM, capture)"),
                           (score_pids, "scoring engine core (AsyncLLM, AsyncVllmScorer)")):
            for r in affinity_tree(pid):
                if r["pid"] in pids:
                    self.roles[r["pid"]] = role if "EngineCor" in r["name"] else "helper (multiprocessing resource tracker)"
        self.cap = await AsyncVllmCapture.attach(self.roll, CaptureConfig())
        self.backend = await AsyncVllmScorer.attach(self.score_engine, VllmScorerConfig(force_routes=True, use_support=True,
                                                                                       prompt_reuse=False))
        self.reuse_cfg = VllmScorerConfig(force_routes=True, use_support=True, prompt_reuse=True)
        self.est_cfg = EstimatorConfig(n=SIDECAR_N)
        # every replica of one rollout in flight at once (one per concurrent batch); vLLM batches them
        self.svc_cfg = ServiceConfig(batch_size=self.requests, concurrency=SIDECAR_N)

    async def _one(self, prompt: str, sp) -> object:
        from moe_replay.integrations.vllm.capture.api import sampling_summary

        rid = f"roll-{uuid.uuid4().hex[:10]}"
        final = None
        async for o in self.roll.generate(prompt, sp, request_id=rid):
            final = o
        (t,) = await self.cap.collect([final], sampling={rid: sampling_summary(sp)})
        return t

    async def rollout(self, P, sps) -> list:
        return list(await asyncio.gather(*(self._one(p, sp) for p, sp in zip(P, sps))))

    async def serial(self, P, sps):
        from moe_replay.estimator.service import estimate_stream

        traces = await self.rollout(P, sps)
        return traces, await estimate_stream(traces, self.backend, self.est_cfg, self.svc_cfg)

    def reuse_backend(self):
        """The scoring engine with prompt reuse, under a fresh salt (cold cache: nothing carried over)."""
        return self.backend.with_config(dataclasses.replace(self.reuse_cfg, salt=uuid.uuid4().hex))

    async def pipelined(self, P, sps, tag: str = "", est_cfg: EstimatorConfig | None = None, backend=None):
        from moe_replay.estimator.service import EstimatorService

        t0 = time.perf_counter()
        async with EstimatorService(backend or self.backend, est_cfg or self.est_cfg, self.svc_cfg) as svc:
            async def one(p, sp):
                t = await self._one(p, sp)
                await svc.submit(t)  # streamed in as it finishes
                return t

            traces = list(await asyncio.gather(*(one(p, sp) for p, sp in zip(P, sps))))
            self.rollouts_done_s.setdefault(tag, []).append(time.perf_counter() - t0)  # every trace collected and submitted
            svc.close()
            out = {k: e async for k, e in svc.results()}  # ends with the last estimate
        return traces, out

    def check(self, traces, out, sync_scorer, backend=None, tol: float = 1e-6) -> dict:
        """Estimates line up with the traces and equal the single score (deterministic engine; with the
        rollout as replica 0, to the prefill-vs-decode gap `tol`)."""
        single = self.run((backend or self.backend).score(traces))
        inproc = sync_scorer.score_batch(traces)
        assert set(out) == {t.key for t in traces}, "estimates do not line up with the traces"
        dev, cross = 0.0, 0.0
        for t, s, s2 in zip(traces, single, inproc):
            e = out[t.key]
            assert not isinstance(e, Exception), f"{t.key}: {e!r}"
            assert e.key == t.key and e.n == SIDECAR_N and e.logprob_G.shape == (t.num_generated,), \
                (e.key, e.n, e.logprob_G.shape)
            dev = max(dev, float(np.abs(e.logprob_G - s).max()))
            cross = max(cross, float(np.abs(s - s2).max()))
        assert dev <= tol, f"sidecar estimate differs from the single score by {dev}"
        return {"estimates": len(out), "max_abs_estimate_vs_single_score": dev,
                "max_abs_scoring_engine_vs_in_process_engine": cross, "tol": tol, "ok": True}

    def describe(self) -> dict:
        rows = affinity_tree(os.getpid())
        for r in rows:
            r["role"] = self.roles.get(r["pid"], "other (vLLM helper / earlier engine)")
        return rows

    def shutdown(self) -> None:
        for eng in (self.roll, self.score_engine):
            eng.shutdown()
        self.roll = self.score_engine = self.cap = self.backend = None  # not left to __del__ at exit
        gc.collect()
        pending = asyncio.all_tasks(self.loop)  # the engines' output handlers
        for t in pending:
            t.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()
