"""Worker side: ties route buffer, sampler hook, slot cache and records to one model runner.

Per engine step (see patch.py for the wrappers):
  before_step   finished requests move to the unclaimed pool; per-layer row counters reset;
  forward       routers copy ids into routes_TLK (route_hook.py);
  after_forward rows -> requests: request i of input_batch owns rows query_start_loc[i:i+2] at
                positions[...]; rows go to the slot cache (block_cache.py) and to each record;
                a request seen for the first time whose first position is past its route_start
                hit the prefix cache: its cached rows are read back from the slot cache;
  after_sample  sampler row i belongs to input_batch.req_ids[i]; rows the runner discards (a
                chunked prefill that has not reached the end of the prompt) are skipped.

`CaptureWorkerExtension` exposes this through collective_rpc (vLLM's worker_extension_cls), which
works the same in the in-process and the multi-process engine. vLLM takes one extension class, so
it also carries scoring (force.py: forced routes + per-token scores, `moe_replay_score_*`); both
share the runner's one execute_model wrapper (patch.StepBracket), and capture ignores requests
registered for scoring.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .block_cache import SlotRouteCache
from .config import CaptureConfig
from .errors import CaptureHookError
from .records import RecordBook, RequestRecord
from .route_hook import RouteCapture, geometry_from_runner
from .sampler_hook import SupportCapture


class WorkerCapture:
    """Capture state installed on one model runner; `uninstall()` leaves the runner as it was."""

    def __init__(self, runner: Any, config: CaptureConfig) -> None:
        from .patch import patch_runner

        self.runner, self.config = runner, config
        _check_runner(runner)
        self.geometry = geometry_from_runner(runner)
        self.book = RecordBook(config.max_unclaimed)
        self.routes: RouteCapture | None = RouteCapture(runner, self.geometry) if config.routes else None
        self.slot_cache: SlotRouteCache | None = None
        if self.routes is not None and config.prefix_cache_routes and runner.cache_config.enable_prefix_caching:
            bt = runner.input_batch.block_table.block_tables[0]
            self.slot_cache = SlotRouteCache(
                runner.kv_cache_config.num_blocks * (runner.cache_config.block_size // bt.block_size),
                bt.block_size,
                self.geometry.num_moe_layers,
                self.geometry.top_k,
                self.routes.dtype,
            )
        self.support = SupportCapture(config.max_support, config.support, config.logprobs)
        self._step: dict[str, Any] | None = None
        self.steps = 0
        self.preemptions = 0
        self.hook_s = 0.0
        """Seconds spent in capture code outside the forward (bookkeeping, support extraction)."""
        try:
            self._patches = patch_runner(runner, self)
        except Exception:
            if self.routes is not None:
                self.routes.uninstall()
            raise

    # -- step hooks ---------------------------------------------------------------------------
    def before_step(self, scheduler_output: Any) -> None:
        for rid in scheduler_output.finished_req_ids:
            self.book.finish(rid)
        self.preemptions += len(getattr(scheduler_output, "preempted_req_ids", None) or ())
        self._step = None
        if self.routes is not None:
            self.routes.reset_step()

    def after_forward(self, scheduler_output: Any) -> None:
        n = scheduler_output.total_num_scheduled_tokens
        if not n:
            return
        r = self.runner
        num_reqs = r.input_batch.num_reqs
        req_ids = list(r.input_batch.req_ids[:num_reqs])
        qsl = r.query_start_loc.np[: num_reqs + 1].astype(np.int64)
        pos_T = r.positions[:n].numpy()
        records: list[RequestRecord | None] = []
        route_problem = self.routes.check_step(n) if self.routes is not None else None
        if self.routes is not None and route_problem is None and self.slot_cache is not None:
            slots_T = r.input_batch.block_table.block_tables[0].slot_mapping.cpu[:n]
            self.slot_cache.write(slots_T, self.routes.routes_TLK[:n])
        scoring = getattr(r, "_moe_replay_scoring", None)
        for i, rid in enumerate(req_ids):
            rec = self.book.get(rid)
            first = int(pos_T[qsl[i]]) if qsl[i + 1] > qsl[i] else 0
            if rec is None and scoring is not None and scoring.owns(rid):
                records.append(None)  # a scoring request: its routes are forced, not captured
                continue
            if rec is None:
                rec = self._new_record(rid, i, first)
            records.append(rec)
            if rec is None or self.routes is None:
                continue
            if route_problem is not None:
                rec.problems.append(f"engine step {self.steps}: {route_problem}")
                continue
            rec.write_routes(first, self.routes.routes_np[qsl[i] : qsl[i + 1]])
        keep_B = ~r.discard_request_mask.np[:num_reqs].copy()
        last_pos_B = np.array([int(pos_T[qsl[i + 1] - 1]) for i in range(num_reqs)], dtype=np.int64)
        self._step = {"records": records, "keep": keep_B, "sample_pos": last_pos_B + 1}
        self.steps += 1

    def after_sample(self, sampled_B1: Any, sampling_metadata: Any) -> None:
        step, self._step = self._step, None
        if step is None:  # dummy/profile sampler runs have no requests
            self.support._observed = None
            return
        s = self.support.finish(sampled_B1, sampling_metadata)
        for i, rec in enumerate(step["records"]):
            if rec is None or not step["keep"][i]:
                continue
            g = int(step["sample_pos"][i]) - rec.prompt_len
            ids = s.ids_N[s.offsets_B1[i] : s.offsets_B1[i + 1]]
            rec.write_sample(g, int(s.tokens_B[i]), float(s.logprobs_B[i]), int(s.sizes_B[i]), ids)

    def _new_record(self, rid: str, row: int, first_pos: int) -> RequestRecord | None:
        state = self.runner.requests[rid]
        prompt_len = int(state.num_prompt_tokens)
        sp = state.sampling_params
        route_start = int(getattr(sp, "routed_experts_prompt_start", 0) or 0) if sp is not None else 0
        g = self.geometry
        rec = self.book.add(RequestRecord(rid, prompt_len, route_start, g.num_moe_layers, g.top_k, g.route_dtype))
        if rec is None or self.routes is None or first_pos <= route_start:
            return rec
        # Prefix-cache hit: positions [route_start, first_pos) were not forwarded for this request.
        if self.slot_cache is None:
            rec.problems.append(
                f"prefix-cache hit of {first_pos} tokens but no slot route cache "
                "(prefix_cache_routes=False or prefix caching off): routes before it are missing"
            )
            return rec
        block_ids = self.runner.input_batch.block_table.block_tables[0].block_table.np[row]
        rows, valid = self.slot_cache.read(block_ids, route_start, first_pos)
        if not valid.all():
            bad = int(np.flatnonzero(~valid)[0]) + route_start
            rec.problems.append(
                f"prefix-cache hit: routes of cached position {bad} were computed while capture was off; "
                "reset the prefix cache (llm.reset_prefix_cache()) after installing capture"
            )
        rec.write_routes(route_start, rows, valid)
        return rec

    # -- control ------------------------------------------------------------------------------
    def take(self, keys: list[str]) -> list[dict[str, Any]]:
        return [self.book.take(k) for k in keys]

    def discard(self, keys: list[str]) -> int:
        return sum(self.book.discard(k) for k in keys)

    def stats(self) -> dict[str, Any]:
        return {
            "live": len(self.book.live),
            "unclaimed": len(self.book.finished),
            "evicted": len(self.book.evicted),
            "steps": self.steps,
            "preemptions": self.preemptions,
            "hook_s": self.hook_s,
        }

    def uninstall(self) -> None:
        self._patches.undo()
        if self.routes is not None:
            self.routes.uninstall()


def _check_runner(runner: Any) -> None:
    needed = ("model", "input_batch", "query_start_loc", "positions", "discard_request_mask", "requests", "sampler")
    missing = [a for a in needed if not hasattr(runner, a)]
    if missing:
        raise CaptureHookError(
            f"model runner {type(runner).__name__} lacks {missing}: capture hooks the V1 CPU/GPU model runner "
            "(on GPU Model Runner V2 use LLM(enable_return_routed_experts=True); collect() reads it)"
        )
    if getattr(runner, "speculative_config", None) is not None:
        raise CaptureHookError("speculative decoding is on: per-token sampling capture does not support draft tokens")
    if not hasattr(runner.sampler, "topk_topp_sampler"):
        raise CaptureHookError(f"sampler {type(runner.sampler).__name__} has no topk_topp_sampler to hook")


# -- RPC surface -----------------------------------------------------------------------------

def _runner_of(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise CaptureHookError(f"worker {type(worker).__name__} has no model_runner")
    return runner


def install_on_worker(worker: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Install capture on this worker's runner; reply {'ok', 'geometry' | 'error', 'kind'}."""
    try:
        runner = _runner_of(worker)
        if getattr(runner, "_moe_replay_capture", None) is not None:
            raise CaptureHookError("capture is already installed on this engine; uninstall() it first")
        cap = WorkerCapture(runner, CaptureConfig.from_dict(config))
        runner._moe_replay_capture = cap
        return {"ok": True, "geometry": cap.geometry.to_dict(), "slot_cache": cap.slot_cache is not None}
    except Exception as e:  # typed errors travel as (kind, message) and are re-raised client-side
        return {"ok": False, "kind": type(e).__name__, "error": str(e)}


def _capture_of(worker: Any) -> WorkerCapture:
    cap = getattr(_runner_of(worker), "_moe_replay_capture", None)
    if cap is None:
        raise CaptureHookError("capture is not installed on this engine")
    return cap


class CaptureWorkerExtension:
    """Methods mixed into vLLM's worker class (ParallelConfig.worker_extension_cls).

    Names are prefixed so they cannot clash with the worker's own attributes.
    """

    def moe_replay_install(self, config: dict[str, Any]) -> dict[str, Any]:
        return install_on_worker(self, config)

    def moe_replay_take(self, keys: list[str]) -> list[dict[str, Any]]:
        return _capture_of(self).take(keys)

    def moe_replay_discard(self, keys: list[str]) -> int:
        return _capture_of(self).discard(keys)

    def moe_replay_stats(self) -> dict[str, Any]:
        return _capture_of(self).stats()

    def moe_replay_uninstall(self) -> bool:
        runner = _runner_of(self)
        cap = getattr(runner, "_moe_replay_capture", None)
        if cap is None:
            return False
        cap.uninstall()
        runner._moe_replay_capture = None
        return True

    def moe_replay_score_install(self, options: dict[str, Any]) -> dict[str, Any]:
        return score_install_on_worker(self, options)

    def moe_replay_score_register(self, payloads: list[dict[str, Any]]) -> dict[str, Any]:
        return score_register_on_worker(self, payloads)

    def moe_replay_score_take(self, keys: list[str]) -> list[dict[str, Any]]:
        return score_take_on_worker(self, keys)

    def moe_replay_score_discard(self, keys: list[str]) -> int:
        return score_discard_on_worker(self, keys)

    def moe_replay_score_stats(self) -> dict[str, Any]:
        return score_stats_on_worker(self)

    def moe_replay_score_uninstall(self) -> bool:
        return score_uninstall_on_worker(self)


# -- scoring (force.py) ------------------------------------------------------------------------

def score_install_on_worker(worker: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Install route forcing + scoring on this worker's runner; reply like install_on_worker."""
    from .force import WorkerScoring

    try:
        runner = _runner_of(worker)
        if getattr(runner, "_moe_replay_scoring", None) is not None:
            raise CaptureHookError("scoring is already installed on this engine; uninstall it first")
        sc = WorkerScoring(runner, **options)
        runner._moe_replay_scoring = sc
        return {"ok": True, "geometry": sc.geometry.to_dict()}
    except Exception as e:
        return {"ok": False, "kind": type(e).__name__, "error": str(e)}


def _scoring_of(worker: Any) -> Any:
    sc = getattr(_runner_of(worker), "_moe_replay_scoring", None)
    if sc is None:
        raise CaptureHookError("scoring is not installed on this engine")
    return sc


def score_register_on_worker(worker: Any, payloads: list[dict[str, Any]]) -> dict[str, Any]:
    try:
        return {"ok": True, "registered": _scoring_of(worker).register(payloads)}
    except Exception as e:
        return {"ok": False, "kind": type(e).__name__, "error": str(e)}


def score_take_on_worker(worker: Any, keys: list[str]) -> list[dict[str, Any]]:
    return _scoring_of(worker).take(keys)


def score_discard_on_worker(worker: Any, keys: list[str]) -> int:
    return _scoring_of(worker).discard(keys)


def score_stats_on_worker(worker: Any) -> dict[str, Any]:
    return _scoring_of(worker).stats()


def score_uninstall_on_worker(worker: Any) -> bool:
    runner = _runner_of(worker)
    sc = getattr(runner, "_moe_replay_scoring", None)
    if sc is None:
        return False
    sc.uninstall()
    runner._moe_replay_scoring = None
    return True


# Module-level twins of the extension methods: collective_rpc can ship these as callables when the
# engine was built without the extension (in-process engines, or VLLM_ALLOW_INSECURE_SERIALIZATION).
def take_on_worker(worker: Any, keys: list[str]) -> list[dict[str, Any]]:
    return _capture_of(worker).take(keys)


def discard_on_worker(worker: Any, keys: list[str]) -> int:
    return _capture_of(worker).discard(keys)


def stats_on_worker(worker: Any) -> dict[str, Any]:
    return _capture_of(worker).stats()


def uninstall_on_worker(worker: Any) -> bool:
    return CaptureWorkerExtension.moe_replay_uninstall(worker)
