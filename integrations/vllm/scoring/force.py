"""Worker side of scoring: force a trace's routes per request row and score its generated tokens.

A scoring request is the trace's full token sequence submitted as a prompt (max_tokens=1). The
client first registers it here under its request id (`ScoreJob`: tokens, routes, support,
temperature), through the `score.*` ops this module registers in runner.OPS. Then, per engine
step (StepBracket in patch.py):

  before_forward (inputs prepared, model not yet run; outside any compiled graph) the step's rows
                are mapped to requests from the layout capture uses too (step.py: request ids,
                query_start_loc, positions) and the rows of registered requests at positions
                [route_start, S-1) are written into the forcing buffers (force_step.py) with the
                trace's ids (column order kept); every other row stays free.
  router call   inside the forward, compiled or eager, each MoE router takes the forced ids on
                those rows and the engine's own top-k elsewhere; gate weights at forced ids are
                recomputed from the engine's router logits by the router's own rule, read into a
                GateSpec by router_rules.ROUTER_GATES and computed by the trainer's GATE_RULES: only
                ids are replayed (invariant 4). An engine whose router kind has no rule, or a
                compiled engine whose routers got no forcing step at load, still scores freely;
                registering routes on it is refused by name. A forced row that some layer did not
                acknowledge fails its request.
  after_forward the rows at positions [prompt_len-1, S-1) (those whose next token is generated)
                go through the model's own `compute_logits`; per row, only
                x[target] - logsumexp(x[support]) (x = logits / temperature) is kept: one float per
                generated token, never full-vocabulary logprobs (the math is the core's
                `replay.scoring.engine_support_logprobs`).

Why not prompt_logprobs: vLLM computes them for every prompt position and ships top-k lists per
position through the output processor; here logits are computed at the G scored rows only and the
support normaliser is exact (the same fp32 logits, summed over the kept ids).

Prefix caching: cached tokens are not forwarded (no routes forced, no rows to score). Full
re-scoring skips cache reads; prompt reuse (prefix.py) lets a request read at most its prompt
minus the last token (`max_cached`). A request first seen past that position is reported as a
problem, never scored silently; the position it was first seen at is returned (`cached`), the
engine's own count of prefix-cache hit tokens for it.

Legend: T rows of one engine step, L MoE layers, K top-k, E experts, R scored rows of a step,
V vocabulary, N kept ids over the scored rows, S tokens of a sequence, G generated tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ....replay.scoring import SupportCSR, engine_support_logprobs
from ..errors import CaptureHookError, ForceRouteError
from ..model import find_moe_layers, forward_is_traced, geometry_from_runner
from ..patch import step_bracket
from ..runner import OPS, RunnerState, installed, register_part_ops
from ..step import external_id
from ..wire import InstallReply, ScoreRequest, ScoreResult
from .force_step import FORCE_STEP_ATTR, ForceStep, eager_routing


def data_parallel_force_refusal(vllm_config: Any) -> str | None:
    """Why routes cannot be forced on an engine of this config's data parallelism (None: they can).

    The forcing step maps router row t to step row t; under data_parallel_size > 1 vLLM's MoE
    layers gather every DP rank's rows before routing (naive dispatch), and a rank would have to
    force the rows of another rank with ids only that rank holds. The scorer refuses at attach,
    the worker at register."""
    dp = int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1)
    if dp <= 1:
        return None
    return (f"data_parallel_size={dp}: MoE routers see rows gathered from other data-parallel ranks, which the "
            "forcing buffers (one row per row of this rank's step) cannot address. Score freely on this engine "
            "(VllmScorerConfig(force_routes=False)) or force routes on an engine with data_parallel_size=1")


# -- one registered request -----------------------------------------------------------------------

@dataclass
class ScoreJob:
    """A registered scoring request and the scores it has produced so far (worker side)."""

    key: str
    tokens_S: np.ndarray
    prompt_len: int
    temperature: float
    route_start: int = 0
    routes_TLK: np.ndarray | None = None
    """int32 forced ids of positions [route_start, S-1); None: free routing."""
    sup_offsets_G1: np.ndarray | None = None
    sup_ids_N: np.ndarray | None = None
    logprobs_G: np.ndarray = field(init=False)
    filled_G: np.ndarray = field(init=False)
    max_cached: int = 0
    """Prompt tokens this request may read from the prefix cache (prompt reuse: P - 1, else 0)."""
    cached: int = -1
    """Tokens the engine read from the prefix cache (the first forwarded position); -1: not seen."""
    problems: list[str] = field(default_factory=list)
    seen: bool = False
    finished: bool = False

    def __post_init__(self) -> None:
        g = len(self.tokens_S) - self.prompt_len
        self.logprobs_G = np.full(g, np.nan, dtype=np.float32)
        self.filled_G = np.zeros(g, dtype=bool)

    @classmethod
    def from_request(cls, p: ScoreRequest, geometry: Any) -> "ScoreJob":
        tokens = np.asarray(p.tokens_S).astype(np.int64).reshape(-1)
        S, P = len(tokens), int(p.prompt_len)
        if not 1 <= P < S:
            raise ForceRouteError(f"scoring request {p.key!r}: expected 1 <= prompt_len < {S} tokens, found {P}")
        job = cls(str(p.key), tokens, P, float(p.temperature), int(p.route_start))
        job.max_cached = int(p.max_cached)
        if not 0 <= job.max_cached <= P - 1:
            raise ForceRouteError(f"scoring request {job.key!r}: expected max_cached in [0, {P - 1}], found {job.max_cached}")
        if p.routes_TLK is not None:
            L, K = geometry.num_moe_layers, geometry.top_k
            r = np.asarray(p.routes_TLK).astype(np.int64).reshape(-1, L, K)
            if len(r) != S - 1 - job.route_start or job.route_start > P - 1:
                raise ForceRouteError(
                    f"scoring request {job.key!r}: expected routes for positions [route_start <= {P - 1}, {S - 1}), "
                    f"found {len(r)} rows from route_start={job.route_start}"
                )
            if r.size and (r.min() < 0 or r.max() >= geometry.num_experts):
                raise ForceRouteError(f"scoring request {job.key!r}: expert ids must lie in [0, {geometry.num_experts})")
            job.routes_TLK = r.astype(np.int32)
        if p.support_offsets_G1 is not None:
            off = np.asarray(p.support_offsets_G1).astype(np.int64).reshape(-1)
            if len(off) != S - P + 1:
                raise ForceRouteError(f"scoring request {job.key!r}: support has {len(off) - 1} rows, expected {S - P}")
            job.sup_offsets_G1, job.sup_ids_N = off, np.asarray(p.support_ids_N).astype(np.int64).reshape(-1)
        return job

    def result(self) -> ScoreResult:
        problems = list(self.problems)
        if not self.filled_G.all():
            problems.append(f"generated token {int(np.flatnonzero(~self.filled_G)[0])} was never scored")
        return ScoreResult("ok", logprobs_G=self.logprobs_G, problems=problems, cached=self.cached)


@dataclass
class _StepPlan:
    """Rows of one engine step that belong to registered requests."""

    n: int
    jobs: list[tuple[ScoreJob, int, int, int]]
    """(job, first row, end row, first position) per registered request in the step."""
    force_rows_R: np.ndarray | None = None
    force_ids_RLK: np.ndarray | None = None
    filled: bool = False
    """The forcing buffers hold this plan's rows (before_forward ran for this step)."""


class WorkerScoring:
    """Route forcing + per-token scoring installed on one model runner (`uninstall()` undoes it)."""

    def __init__(self, runner: Any, max_jobs: int = 65536) -> None:
        self.runner, self.max_jobs = runner, max_jobs
        self.geometry = geometry_from_runner(runner)
        layers = find_moe_layers(runner.model)
        self.force: ForceStep | None = getattr(runner.model, FORCE_STEP_ATTR, None)
        """The forcing buffers: bound at load (compiled forwards) or here (eager ones, `_own_force`)."""
        self._own_force = False
        self.force_refusal: str | None = None
        """Why routes cannot be forced on this engine (None: they can); free scoring works regardless."""
        if self.force is None and forward_is_traced(runner.vllm_config):
            self.force_refusal = (
                "this engine compiles its forward (enforce_eager=False: torch.compile / CUDA graphs) and its routers "
                "got no forcing step at model load, so routes set later would never be forced. Build the engine with "
                "LLM(..., **scoring_engine_kwargs()) (it sets additional_config 'moe_replay_force', read by the "
                "moe_replay load hook), or use enforce_eager=True")
        elif self.force is None:
            self.force = ForceStep(layers, int(runner.max_num_tokens), torch.device(runner.device))
            self._own_force = True
        if self.force is not None and self.force.refusal is not None:
            self.force_refusal = self.force.refusal
        self.force_refusal = data_parallel_force_refusal(runner.vllm_config) or self.force_refusal
        if self.force is not None and self.force.layer_ids != self.geometry.moe_layer_ids:
            raise ForceRouteError(f"load-time forcing step covers layers {self.force.layer_ids}, the model has MoE "
                                  f"layers {self.geometry.moe_layer_ids}")
        self.gates = self.force.gates if self.force is not None else []
        self.jobs: dict[str, ScoreJob] = {}
        """Registered jobs by request id (the client's id, without vLLM's random suffix)."""
        self._by_internal: dict[str, ScoreJob] = {}
        self._others: set[str] = set()
        self._plan: _StepPlan | None = None
        self._step_n = 0
        self.hook_s = 0.0
        self.steps = 0
        self.forced_rows = 0
        self.scored_rows = 0
        self._bracket = step_bracket(runner, self)
        if self._own_force and self.force_refusal is None:
            try:
                self.force.bind(eager_routing)
            except Exception:
                self._bracket.remove(self)
                raise

    # -- registry ---------------------------------------------------------------------------------
    def register(self, requests: list[ScoreRequest]) -> int:
        jobs = [ScoreJob.from_request(p, self.geometry) for p in requests]
        if self.force_refusal is not None and any(j.routes_TLK is not None for j in jobs):
            raise ForceRouteError(self.force_refusal)
        dup = [j.key for j in jobs if j.key in self.jobs]
        if dup or len({j.key for j in jobs}) != len(jobs):
            raise ForceRouteError(f"scoring request ids must be unique among registered ones; repeated: {dup[:3]}")
        if len(self.jobs) + len(jobs) > self.max_jobs:
            raise ForceRouteError(f"{len(self.jobs)} scoring requests are registered and not taken (max_jobs={self.max_jobs})")
        for j in jobs:
            self.jobs[j.key] = j
        return len(jobs)

    def owns(self, internal_id: str) -> bool:
        return internal_id in self._by_internal or external_id(internal_id) in self.jobs

    def take(self, keys: list[str]) -> list[ScoreResult]:
        """Results of jobs whose request has finished on the client side; they leave the worker."""
        out = []
        for k in keys:
            job = self.jobs.pop(k, None)
            out.append(ScoreResult("unknown", known=len(self.jobs)) if job is None else job.result())
        return out

    def discard(self, keys: list[str]) -> int:
        n = 0
        for k in keys:
            job = self.jobs.pop(k, None)
            if job is not None:
                n += 1
                for rid in [r for r, j in self._by_internal.items() if j is job]:
                    del self._by_internal[rid]
        return n

    def stats(self) -> dict[str, Any]:
        return {"registered": len(self.jobs), "steps": self.steps, "forced_rows": self.forced_rows,
                "scored_rows": self.scored_rows, "hook_s": self.hook_s, "force_refusal": self.force_refusal,
                "gate_rules": sorted({g.spec.rule for g in self.gates}),
                "force_binding": None if self.force_refusal is not None else ("install" if self._own_force else "load")}

    # -- step hooks (StepBracket) -------------------------------------------------------------------
    def before_step(self, scheduler_output: Any) -> None:
        for rid in scheduler_output.finished_req_ids:
            self._others.discard(rid)
            job = self._by_internal.pop(rid, None)
            if job is not None:
                job.finished = True
        self._plan = None
        self._step_n = int(scheduler_output.total_num_scheduled_tokens)

    def _step_plan(self, n: int) -> _StepPlan:
        if self._plan is not None:
            return self._plan
        layout = self._bracket.views.layout(n)
        qsl, pos_T = layout.qsl_B1, layout.pos_T
        jobs = []
        rows, ids = [], []
        for i, rid in enumerate(layout.req_ids):
            if rid in self._others:
                continue
            job = self._by_internal.get(rid)
            if job is None:
                job = self.jobs.get(external_id(rid))
                if job is None:
                    self._others.add(rid)
                    continue
                self._by_internal[rid] = job
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            if hi <= lo:
                continue
            first = int(pos_T[lo])
            if not job.seen:
                job.cached = first
                if first > job.max_cached:
                    job.problems.append(f"first forwarded position is {first}, expected <= {job.max_cached} (a prefix-cache "
                                        "hit past what this request may read): cached positions were neither forced nor scored")
            job.seen = True
            jobs.append((job, lo, hi, first))
            if job.routes_TLK is not None:
                a = max(first, job.route_start)
                b = min(first + hi - lo, len(job.tokens_S) - 1)
                if b > a:
                    rows.append(np.arange(lo + a - first, lo + b - first))
                    ids.append(job.routes_TLK[a - job.route_start : b - job.route_start])
        plan = _StepPlan(n, jobs)
        if rows:
            plan.force_rows_R = np.concatenate(rows)
            plan.force_ids_RLK = np.concatenate(ids)
            self.forced_rows += len(plan.force_rows_R)
        self._plan = plan
        return plan

    def before_forward(self) -> None:
        """Fill the forcing buffers with this step's forced rows (StepBracket, before the model runs)."""
        if not self.jobs or not self._step_n:
            return
        plan = self._step_plan(self._step_n)
        if plan.force_rows_R is None or self.force is None:
            return
        try:
            self.force.fill(plan.force_rows_R, plan.force_ids_RLK)
        except ForceRouteError as e:
            for job, *_ in plan.jobs:
                job.problems.append(f"engine step {self.steps + 1}: {e}")
            plan.force_rows_R = None
            return
        plan.filled = True

    def after_forward(self, scheduler_output: Any) -> None:
        t0 = time.perf_counter()  # the step bracket leaves after_forward hooks to time themselves
        try:
            self._after_forward(scheduler_output)
        finally:
            self.hook_s += time.perf_counter() - t0

    def _after_forward(self, scheduler_output: Any) -> None:
        n = scheduler_output.total_num_scheduled_tokens
        plan, self._plan = self._plan, None
        if not n or not self.jobs:
            if self.force is not None:
                self.force.clear()
            return
        if plan is None:
            plan = self._step_plan(n)
            self._plan = None
        self.steps += 1
        if not plan.jobs:
            return
        if plan.force_rows_R is not None:
            # a router that did not run the forcing step (a graph traced before it was bound, a kernel
            # that bypasses the router) forced nothing: these rows were routed freely, never scored
            # as if forced
            missed = self.force.unforced(plan.force_rows_R) if plan.filled else ["all (forcing buffers never filled)"]
            self.force.clear()
            if missed:
                for job, *_ in plan.jobs:
                    if job.routes_TLK is not None:
                        job.problems.append(f"engine step {self.steps}: MoE layers {missed} did not force the "
                                            "registered rows (routes not forced)")
        port = self._bracket.views
        ids_T = port.step_token_ids(n)
        rows, targets, g_idx = [], [], []
        # (job, its scored rows) in row order: one entry per job, not one per row (the per-row Python
        # passes took 1.6 ms a step of 8,192 scored rows, ~0.19 us a row)
        runs: list[tuple[ScoreJob, int]] = []
        for job, lo, hi, first in plan.jobs:
            pos = np.arange(first, first + hi - lo)
            if pos[-1] >= len(job.tokens_S) or not np.array_equal(ids_T[lo:hi], job.tokens_S[pos]):
                job.problems.append(f"engine step {self.steps}: forwarded tokens at positions {first}.. differ "
                                    "from the registered sequence")
                continue
            keep = (pos >= job.prompt_len - 1) & (pos < len(job.tokens_S) - 1)
            if keep.any():
                p = pos[keep]
                rows.append(np.arange(lo, hi)[keep])
                targets.append(job.tokens_S[p + 1])
                g_idx.append(p + 1 - job.prompt_len)
                runs.append((job, len(p)))
        if not rows:
            return
        hidden_TH = port.hidden_states()
        if hidden_TH is None:
            for job, *_ in plan.jobs:
                job.problems.append("the runner kept no hidden states for this step (execute_model_state)")
            return
        rows_R = torch.from_numpy(np.concatenate(rows)).to(hidden_TH.device)
        g_R = np.concatenate(g_idx)
        lp_R = self._score_rows(hidden_TH[rows_R], torch.from_numpy(np.concatenate(targets)), runs, g_R)
        self.scored_rows += len(g_R)
        start = 0
        for job, cnt in runs:
            gs = g_R[start : start + cnt]
            job.logprobs_G[gs] = lp_R[start : start + cnt]
            job.filled_G[gs] = True
            start += cnt

    def _score_rows(self, h_RH: torch.Tensor, target_R: torch.Tensor, runs: list[tuple[ScoreJob, int]],
                    g_R: np.ndarray) -> np.ndarray:
        """x[target] - logsumexp over the support (or the vocabulary) of x = logits / temperature;
        `runs`: (job, rows) in row order."""
        size_R = np.zeros(len(g_R), dtype=np.int64)
        ids_N = []
        start = 0
        for job, cnt in runs:  # a job's scored rows are consecutive generated tokens
            if job.sup_offsets_G1 is not None:
                g0, g1 = int(g_R[start]), int(g_R[start + cnt - 1]) + 1
                off = job.sup_offsets_G1
                ids_N.append(job.sup_ids_N[off[g0] : off[g1]])
                size_R[start : start + cnt] = np.diff(off[g0 : g1 + 1])
            start += cnt
        off_R1 = np.zeros(len(g_R) + 1, dtype=np.int64)
        np.cumsum(size_R, out=off_R1[1:])
        support = SupportCSR(torch.from_numpy(off_R1),
                             torch.from_numpy(np.concatenate(ids_N) if ids_N else np.zeros(0, np.int64)))
        temp_R = torch.from_numpy(np.repeat(np.array([job.temperature for job, _ in runs], dtype=np.float32),
                                            [cnt for _, cnt in runs]))
        with torch.inference_mode():
            out = engine_support_logprobs(self.runner.model.compute_logits(h_RH), target_R, support, temp_R)
        return out.cpu().numpy().astype(np.float32)

    def uninstall(self) -> None:
        if self.force is not None:
            self.force.clear()
            if self._own_force:  # a load-time step stays bound: the compiled graph holds it
                self.force.unbind()
        self._bracket.remove(self)
        self.jobs.clear()
        self._by_internal.clear()


# -- ops (endpoint.py) ----------------------------------------------------------------------------
@OPS.register("score.install")
def _score_install(runner: Any, st: RunnerState, options: dict[str, Any]) -> dict[str, Any]:
    if st.scoring is not None:
        raise CaptureHookError("scoring is already installed on this engine; uninstall it first")
    st.scoring = WorkerScoring(runner, **options)
    return InstallReply(st.scoring.geometry.to_dict()).to_dict()


@OPS.register("score.register")
def _score_register(runner: Any, st: RunnerState, requests: list[dict[str, Any]]) -> int:
    return installed(st, "scoring").register([ScoreRequest.from_dict(d) for d in requests])


register_part_ops("scoring", "score")
