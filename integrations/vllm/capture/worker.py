"""Worker side: ties route arena, sampler stage, slot cache and records to one model runner.

Per engine step (see patch.py for the wrappers) only cheap snapshots happen, in the sampler: each
hook a step enters costs ~10-25 us inside a busy engine before it does much (the first touch of its
code and data after a 30 ms forward, docs/findings.md), so a step has one hook of ours after its
forward, not one after the forward and one after the sampler, and none before the step on host
runners (`before_step` runs only where the route rows must be armed before the forward: device
runners, data parallelism; route_hook.RouteCapture.arm_before).
  forward       routers hand their ids to the route capture (held on eager CPU engines, else
                written into the step buffer bound at model load: route_hook.py);
  truncation    the sampler's truncated logits are held (sampler_hook.py);
  after_sample  the step is filed (`_file`; after_forward instead where capture wraps no sampler,
                and the bracket's after_unsampled for a step no sampler runs for): its finished
                requests are queued (they move to the unclaimed pool at the next flush, before any
                row is mapped); the pending steps are flushed first if the route arena or the host
                rings could not hold this step (`_tokens_left`); the step's layout (step.py, shared
                with scoring: request ids, query_start_loc, positions, the discard mask) and its KV
                slots are taken (on CPU runners one byte copy each into host rings, read at the
                flush); the route rows are filed and re-armed; which records own the input batch's
                rows is looked up only when the batch changes; a request seen for the first time
                whose first position is past its route_start hit the prefix cache: a slot-cache
                read is queued for the flush. Then the step's sampled tokens are committed to the
                support stage, and everything is flushed if the stage could not take another batch.
                Nothing the runner wrote for the step changes between its forward and its sampler:
                the next execute_model writes the step buffers (patch.StepBracket).

`flush()` then maps every pending step's rows to records with a handful of array ops: slot-cache
writes and prefix reads in step order (block_cache.py), then the window's routes and sampler rows
go to the row log whole, each row tagged with its record (rows the runner discards, a chunked
prefill not yet at the end of its prompt, are tagged with none). Taken records are laid out from
the log together (row_log.py), so no flush or take does array work per record. A flush runs when a
buffer is about to fill, and before every take/discard/stats, so the client never sees a partial
record. Why: per step, each small tensor or Python operation inside a busy engine costs ~10-70 us;
batching many steps into one pass is what keeps capture near free (benchmarks/capture.py).

The client reaches this through endpoint.py; this module registers the `capture.*` ops in the
runner's op table (runner.py) and keeps its WorkerCapture in the runner's one state object.
Capture and scoring share the runner's one execute_model wrapper (patch.StepBracket) and its step
layout (step.py); capture ignores requests registered for scoring.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ....capture_config import CaptureConfig
from ..errors import CaptureHookError
from ..model import geometry_from_runner
from ..patch import patch_runner
from ..runner import OPS, RunnerState, installed, register_part_ops, runner_state
from ..runners import port_of
from ..step import RingRows, StepLayout, join_rows
from ..timings import PartTimes, Tally
from ..versions import check_release
from ..wire import CaptureRecord, InstallReply
from .block_cache import SlotRouteCache, route_kv_group
from .records import RecordBook, RequestRecord
from .route_hook import RouteCapture
from .row_log import RowLog, ranks_within
from .sampler_hook import SupportStage
from .speculation import SpecRows, emitted_tokens, spec_info, spec_rows


@dataclass
class _Batch:
    """Records owning the rows of one input-batch composition (B requests, in batch order)."""

    req_ids: list[str]
    records: list[RequestRecord | None]
    uid_B: np.ndarray
    """int64 record uid per request, -1 where nothing is captured (scoring or already taken)."""
    prompt_len_B: np.ndarray


@dataclass(slots=True)
class _Step:
    """Snapshot of one engine step, enough to map its rows to records at the next flush (one made
    per step: slots, no instance dict)."""

    batch: _Batch
    layout: StepLayout
    """The step's rows (step.py; the same arrays scoring saw)."""
    arena_row: int
    slots_T: "np.ndarray | RingRows | None"
    problem: str | None
    reads: "list[tuple[RequestRecord, np.ndarray, int, int]] | tuple[()]" = ()
    """Prefix-cache hits: (record, block table row, route_start, first forwarded position)."""
    sample_row: int | None = None
    """First support-stage row of this step's samples (None until the sampler ran)."""
    spec: SpecRows | None = None
    """A speculative step's drafts and emitted tokens per row (None: one sample per row)."""
    index: int = 0
    """The engine step's number since install (the provenance of its rows: row_log.py)."""


_NO_READS: tuple[()] = ()
"""The reads of a step whose batch was seen before (only a new batch composition has prefix reads)."""


@dataclass
class _Window:
    """Pending steps laid end to end: S steps, B rows (requests) and T tokens in all."""

    n_S: np.ndarray
    """Tokens forwarded per step."""
    b_S: np.ndarray
    """Rows per step."""
    step_B: np.ndarray
    step_T: np.ndarray
    uid_B: np.ndarray
    prompt_B: np.ndarray
    discard_B: np.ndarray
    last_pos_B: np.ndarray
    """Position of each row's last forwarded token (its sample is the token after it)."""
    uid_T: np.ndarray
    pos_T: np.ndarray
    ntok_B: np.ndarray
    """Tokens each row forwarded in its step."""
    index_S: np.ndarray
    """Each step's number since install (`_Step.index`: the provenance of its rows)."""
    drafts_B: np.ndarray | None = None
    """Speculative windows: draft tokens each row forwarded after its last sampled token (0 elsewhere)."""
    emitted_B: np.ndarray | None = None
    """Speculative windows: tokens each row emitted (1 elsewhere)."""

    @classmethod
    def of(cls, steps: list[_Step]) -> "_Window":
        lay = StepLayout.joined([st.layout for st in steps])
        n_S, b_S = lay.n_S, lay.b_S
        S = np.arange(len(steps))
        uid_B = np.concatenate([st.batch.uid_B for st in steps])
        ntok_B = lay.stop_B - lay.start_B
        win = cls(n_S, b_S, np.repeat(S, b_S), np.repeat(S, n_S), uid_B,
                  np.concatenate([st.batch.prompt_len_B for st in steps]),
                  lay.discard_B, lay.pos_T[lay.stop_B - 1], np.repeat(uid_B, ntok_B), lay.pos_T, ntok_B,
                  np.fromiter((st.index for st in steps), dtype=np.int64, count=len(steps)))
        if any(st.spec is not None for st in steps):
            win.drafts_B = np.concatenate([np.zeros(len(st.batch.uid_B), np.int64) if st.spec is None else st.spec.drafts_B
                                           for st in steps])
            win.emitted_B = np.concatenate([np.ones(len(st.batch.uid_B), np.int64) if st.spec is None else st.spec.emitted_B
                                            for st in steps])
        return win

    def rejected_T(self) -> np.ndarray | None:
        """Speculative windows: tokens forwarded as drafts the rejection sampler rejected (and the
        drafts after them): row b keeps positions up to last_pos - drafts + emitted - 1 (speculation.py)."""
        if self.drafts_B is None:
            return None
        keep_B = self.last_pos_B - self.drafts_B + self.emitted_B - 1
        return self.pos_T > np.repeat(keep_B, self.ntok_B)


class WorkerCapture:
    """Capture state installed on one model runner; `uninstall()` leaves the runner as it was."""

    def __init__(self, runner: Any, config: CaptureConfig) -> None:
        self.runner, self.config = runner, config
        self.port = port_of(runner)
        """The runner's port (runners/): what differs between the V1 runner and Model Runner V2."""
        self.port.check_capture(speculative=getattr(runner, "speculative_config", None) is not None)
        self.spec = spec_info(runner, self.port.path)
        """The engine's speculative decoding (speculation.py), None without."""
        self.geometry = geometry_from_runner(runner)
        self.book = RecordBook(config.max_unclaimed, RowLog(self.geometry.num_moe_layers, self.geometry.top_k,
                                                            self.geometry.route_dtype))
        self.routes: RouteCapture | None = (
            RouteCapture(runner, self.geometry, config.flush_bytes) if config.routes else None)
        self.slot_cache: SlotRouteCache | None = None
        self.kv_group = 0
        """KV-cache group whose block table and slot mapping key the slot route cache."""
        if self.routes is not None and config.prefix_cache_routes and runner.cache_config.enable_prefix_caching:
            self.kv_group, spec = route_kv_group(runner.kv_cache_config, self.port.num_block_tables())
            block_size = self.port.block_size(self.kv_group)
            self.slot_cache = SlotRouteCache(
                runner.kv_cache_config.num_blocks * (int(spec.block_size) // block_size),
                block_size,
                self.geometry.num_moe_layers,
                self.geometry.top_k,
                self.routes.dtype,
            )
        self.max_rows = self.port.max_num_reqs * (1 + (self.spec.num_speculative_tokens if self.spec else 0))
        """The most sampled tokens one step commits (every request emits 1 + its drafts under speculation)."""
        self.support = SupportStage(config.max_support, config.support, config.logprobs,
                                    config.flush_bytes, self.max_rows)
        self.pending: list[_Step] = []
        self._finished: list[Any] = []
        """finished_req_ids of the steps since the last flush (sets from the scheduler, not copied)."""
        self._batch: _Batch | None = None
        self._arena_row = 0
        self.steps = 0
        self.flushes = 0
        self.preemptions = 0
        self.route_rearms = 0
        """Flushes that found the host route step buffer written outside the engine's steps (then
        the rows are armed before each forward from there on: route_hook.RouteCapture.check_armed)."""
        self.support_misses = 0
        """Sampled tokens found outside their recorded support (each fails its trace)."""
        self.rerouted = 0
        """Positions of taken records whose route a later forward changed (row_log.py, provenance)."""
        self.stale = 0
        """Sampled tokens of taken records that depended on a route changed after they were drawn."""
        self.spec_drafts = 0
        """Draft tokens the target model verified (speculative decoding)."""
        self.spec_accepted = 0
        """Draft tokens it accepted (the rest were rejected: their routes are dropped)."""
        self.hook_s = 0.0
        """Seconds spent in capture code outside the forward (snapshots, flushes, support staging),
        less the per-step parts still in their tallies (`stats` adds them)."""
        self.times = PartTimes()
        """Host seconds per part (timings.py): step.* per engine step, flush.*, take.*."""
        self._after_forward_s = Tally("step.after_forward")
        self._after_sample_s = Tally("step.after_sample")
        """Filing the step and committing its samples, in the sampler wrapper's one hook."""
        self._tallies = (self._after_forward_s, self._after_sample_s, self.support.stage_times)
        """The per-step parts, added to `times` when they are read (`timings`)."""
        self.take_s = 0.0
        """Seconds inside take() (its flush and take.assemble): the client subtracts it from its call."""
        self.support.times = self.times
        self._tokens_left = 0
        self.samples = bool(config.support or config.logprobs or self.spec is not None)
        """Whether capture wraps the sampler: for the kept sets or logprobs, and on a speculative engine
        also for routes alone (which rows of a step its rejected drafts forwarded: speculation.py)."""
        self._file_hook = ("after_unsampled",) if self.samples else ("after_forward",)
        """Where each step is filed: in the sampler wrapper's hook (after_sample; the bracket's
        after_unsampled for a step no sampler runs for) where capture wraps the sampler, else in
        after_forward. One hook a step, not two: each costs ~10-25 us of cold code and data inside
        the engine whatever it does (the module docstring)."""
        self.step_hooks = (("before_step",) if self.routes is not None and self.routes.arm_before else ()) \
            + self._file_hook
        """The StepBracket hooks this listener runs (patch.py)."""
        self._patches = None
        try:
            self._patches, self._bracket = patch_runner(runner, self)
            self.views = self._bracket.views
            if self.slot_cache is not None:
                self.port.enable_slots(self._patches, self.kv_group)
        except Exception:
            if self._patches is not None:
                self._patches.undo()
            if self.routes is not None:
                self.routes.uninstall()
            raise
        self._set_room()

    # -- step hooks ---------------------------------------------------------------------------
    def before_step(self, scheduler_output: Any) -> None:
        """Only where the route rows are armed before the forward (step_hooks)."""
        t0 = time.perf_counter()
        self.routes.arm(scheduler_output.total_num_scheduled_tokens)
        self.times.add("step.arm", time.perf_counter() - t0)

    @property
    def stepping(self) -> bool:
        """Inside an engine step whose sampler has not run yet (False in dummy / warm-up sampler runs)."""
        return self._bracket.scheduled is not None

    def after_sample(self, sampled_B1: Any, temps: "float | np.ndarray") -> None:
        """The step's one hook where a sampler wrapper runs (support or logprobs captured), given the
        step's sampled tokens [B, 1] and the rows' temperatures (the port's: runners/): file the
        step (`_file`), commit its samples, then flush if the support stage could not take another
        full batch (its next truncation runs before this hook)."""
        t0 = time.perf_counter()
        bracket = self._bracket
        scheduler_output = bracket.scheduled
        if scheduler_output is None:  # a dummy/profile sampler run: no engine step
            self.support.drop_pending()
            return
        bracket.scheduled = None
        tally = self._after_sample_s
        step = self._file(scheduler_output, tally)
        if step is None:
            self.support.drop_pending()
        else:
            support = self.support
            step.sample_row = support.commit_rows(sampled_B1, temps)
            if support.rows + self.max_rows > support.capacity:
                t1 = time.perf_counter()
                self.flush()  # timed as flush.*; the step is filed and sampled, its route rows re-armed
                tally.s -= time.perf_counter() - t1
        tally.s += time.perf_counter() - t0
        tally.calls += 1

    def after_spec_sample(self, sampled_BJ: Any, metadata: Any, target_DV: Any, sampling_metadata: Any) -> None:
        """A speculative step on the V1 runner (its rejection sampler's wrapper, runners/v1.py): each
        emitted token's target row is its draft row or the bonus row the sampler truncated
        (speculation.py); then `after_spec_step`."""
        support = self.support
        bonus, support.spec_bonus = support.spec_bonus, None
        if not self.stepping:  # a dummy/profile run: no engine step
            support.drop_pending()
            return
        spec, row_X = spec_rows(sampled_BJ, metadata.num_draft_tokens)
        rows_XV, temps = None, 0.0
        if bonus:  # random rows exist: the sampler truncated the bonus rows (else every row is greedy)
            if target_DV is None:
                raise CaptureHookError("a speculative step sampled at random but its draft rows' target logits "
                                       "were not seen (rejection_sample not reached through capture's wrapper)")
            rows_XV = torch.cat([target_DV.to(bonus[0].dtype), bonus[0]])[torch.from_numpy(row_X).to(bonus[0].device)]
            if sampling_metadata.all_random or sampling_metadata.temperature is None:
                temps = 1.0
            else:
                temps = np.repeat(sampling_metadata.temperature.cpu().numpy(), spec.emitted_B)
        self.after_spec_step(spec, rows_XV, emitted_tokens(sampled_BJ), temps)

    def after_spec_step(self, spec: SpecRows, rows_XV: Any, tokens_X1: Any, temps: "float | np.ndarray") -> None:
        """The step's one hook on a speculative step, either runner: file the step, stage each
        emitted token's target row (rows_XV: the truncated target logits of the X emitted tokens in
        batch order, None when every row is greedy) and commit the emitted tokens [X, 1] with their
        temperatures."""
        t0 = time.perf_counter()
        support, bracket = self.support, self._bracket
        scheduler_output = bracket.scheduled
        if scheduler_output is None:  # a dummy/profile run: no engine step
            support.drop_pending()
            return
        bracket.scheduled = None
        tally = self._after_sample_s
        step = self._file(scheduler_output, tally)
        if step is None:
            support.drop_pending()
        else:
            step.spec = spec
            self.spec_drafts += int(spec.drafts_B.sum())
            self.spec_accepted += int((spec.emitted_B - 1).sum())
            if rows_XV is not None:
                support.stage(rows_XV)
            step.sample_row = support.commit_rows(tokens_X1, temps)
            if support.rows + self.max_rows > support.capacity:
                t1 = time.perf_counter()
                self.flush()
                tally.s -= time.perf_counter() - t1
        tally.s += time.perf_counter() - t0
        tally.calls += 1

    def after_forward(self, scheduler_output: Any) -> None:
        """The step's hook where no sampler wrapper runs (neither support nor logprobs captured)."""
        t0 = time.perf_counter()
        tally = self._after_forward_s
        self._file(scheduler_output, tally)
        tally.s += time.perf_counter() - t0
        tally.calls += 1

    after_unsampled = after_forward
    """A step whose execute_model returned its output itself is filed as without a sampler (StepBracket)."""

    def _file(self, scheduler_output: Any, tally: Tally) -> _Step | None:
        """File the step after its forward (see the module docstring); None when nothing was
        forwarded. Flushes first where the route arena or the host rings could not take its
        tokens (that flush's seconds come off `tally`: they are timed as flush.*)."""
        if scheduler_output.finished_req_ids:
            self._finished.append(scheduler_output.finished_req_ids)
        preempted = getattr(scheduler_output, "preempted_req_ids", None)
        if preempted:
            self.preemptions += len(preempted)
            for rid in preempted:  # (a native source's routes of these are refused: capture/preemption.py)
                rec = self.book.get(rid)
                if rec is not None:
                    rec.preempted = True
        n = scheduler_output.total_num_scheduled_tokens
        if not n:
            return None
        flushed = n + 1 > self._tokens_left
        if flushed:
            t1 = time.perf_counter()
            self._flush()  # every pending step has sampled (a step's sampler runs before the next forward)
            tally.s -= time.perf_counter() - t1
        self._tokens_left -= n + 1  # the step's n tokens, its <= n + 1 query starts
        if self.slot_cache is not None:  # (read whether or not the routes land: used only if they do)
            layout, slots_T = self.views.layout_slots(n, self.kv_group)
        else:
            layout, slots_T = self.views.layout(n), None
        routes, problem, row0 = self.routes, None, self._arena_row
        if routes is not None:
            problem = routes.land(row0, n)
            if problem is None:
                self._arena_row += n
            else:
                slots_T = None
        batch, reads = self._batch, _NO_READS
        if batch is None or batch.req_ids != layout.req_ids:
            reads = []
            batch = self._batch = self._resolve_batch(layout, reads, scheduler_output)
        step = _Step(batch, layout, row0, slots_T, problem, reads, index=self.steps)
        self.pending.append(step)
        self.steps += 1
        if flushed:
            self._check_route_arming()  # the step's rows are filed and re-armed: the buffer should be clean
        return step

    def _check_route_arming(self) -> None:
        """Where `land` re-arms the host step buffer (no hook before the step), check, at a flush and
        between forwards, that nothing else wrote it; if something did, arm before every step from
        now on (route_hook.RouteCapture.check_armed)."""
        if self.routes is not None and self.routes.check_armed():
            self.route_rearms += 1
            self.step_hooks = ("before_step",) + self._file_hook
            self._bracket.resync()

    def _set_room(self) -> None:
        """After a flush: how many tokens the route arena and the host rings take before the next
        flush (the support stage counts its own rows; it is sized at its first step). The hook
        after the forward is timed as one part: a perf_counter pair and a dict update per sub-part
        cost ~5 us each inside the step."""
        tokens = self.views.free_items()
        if self.routes is not None:
            tokens = min(tokens, self.routes.capacity - self._arena_row)
        self._tokens_left = tokens

    def _resolve_batch(self, layout: StepLayout, reads: list[tuple[RequestRecord, np.ndarray, int, int]],
                       scheduler_output: Any) -> _Batch:
        """Records of a new batch composition; new requests get a record (and a queued prefix read)."""
        scoring = runner_state(self.runner).scoring
        records: list[RequestRecord | None] = []
        qsl, pos_T = layout.qsl_B1, layout.pos_T
        for i, rid in enumerate(layout.req_ids):
            rec = self.book.get(rid)
            if rec is None and scoring is not None and scoring.owns(rid):
                records.append(None)  # a scoring request: its routes are forced, not captured
                continue
            if rec is None:
                first = int(pos_T[qsl[i]]) if qsl[i + 1] > qsl[i] else 0
                rec = self._new_record(rid, i, first, reads, scheduler_output)
            records.append(rec)
        uid_B = np.array([-1 if rec is None else rec.uid for rec in records], dtype=np.int64)
        prompt_B = np.array([0 if rec is None else rec.prompt_len for rec in records], dtype=np.int64)
        return _Batch(list(layout.req_ids), records, uid_B, prompt_B)

    def _new_record(self, rid: str, row: int, first_pos: int, reads: list[tuple[RequestRecord, np.ndarray, int, int]],
                    scheduler_output: Any) -> RequestRecord | None:
        prompt_len, route_start = self.port.request(rid, scheduler_output)
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
        block_ids = self.port.block_ids(rid, row, self.kv_group, scheduler_output)
        reads.append((rec, block_ids, route_start, first_pos))
        return rec

    # -- flush --------------------------------------------------------------------------------
    def flush(self) -> None:
        """Map every pending step's rows to their records (see the module docstring), between
        engine steps (an RPC: the engine serves them between steps)."""
        self._flush()
        self._check_route_arming()

    def _flush(self) -> None:
        # Flushes run between the samplers of two engine steps (in after_forward, before the step is
        # filed, or in an RPC), so every pending step has had its sampler call, if it has one.
        finished, self._finished = self._finished, []
        for ids in finished:  # before any row is mapped, in step order: as if each step had done it
            for rid in ids:
                self.book.finish(rid)
        steps, self.pending = self.pending, []
        if not steps:
            return
        try:
            self._map(steps)
        finally:
            self.views.rewind()  # the steps' layouts and slots have been read (step.HostRing)
            self._set_room()

    def _map(self, steps: list[_Step]) -> None:
        clock, times = time.perf_counter, self.times
        t0 = clock()
        self.flushes += 1
        win = _Window.of(steps)
        records = _records_of(steps)
        gone = [uid for uid, rec in records.items() if not self.book.holds(rec)]
        if gone:  # evicted since its step ran: its rows are tagged with no record
            win.uid_T = np.where(np.isin(win.uid_T, gone), -1, win.uid_T)
            win.uid_B = np.where(np.isin(win.uid_B, gone), -1, win.uid_B)
        rejected_T = win.rejected_T()
        if rejected_T is not None and rejected_T.any():  # rejected drafts' rows belong to no record
            win.uid_T = np.where(rejected_T, -1, win.uid_T)
        t1 = clock()
        times.add("flush.window", t1 - t0)
        if self.routes is not None:
            routed_S = np.array([st.problem is None for st in steps])
            chunk_TLK, unwritten_TL = self.routes.chunk(int(win.n_S[routed_S].sum()))
            self._arena_row = 0
            t0, t1 = t1, clock()
            times.add("flush.route_read", t1 - t0)
            written_T = None
            if unwritten_TL is not None:  # a layer left rows at the sentinel: those steps fail
                written_T = ~unwritten_TL.any(axis=1)
                self._report_unwritten(steps, unwritten_TL)
            for st in steps:
                if st.problem is not None:
                    for rec in st.batch.records:
                        if rec is not None:
                            rec.problems.append(f"engine step: {st.problem}")
            if self.slot_cache is not None:
                if rejected_T is not None and rejected_T.any():  # a rejected draft's KV slot holds no kept token's route
                    kept_T = ~rejected_T[routed_S[win.step_T]]
                    written_T = kept_T if written_T is None else written_T & kept_T
                self._slot_cache_pass(steps, chunk_TLK, written_T)
                t0, t1 = t1, clock()
                times.add("flush.slot_cache", t1 - t0)
            # routed steps hold consecutive route rows 0, 1, ... in step order (route_hook.RouteCapture)
            routed_T = routed_S[win.step_T]
            self.book.log.add_routes(win.uid_T[routed_T], win.pos_T[routed_T], chunk_TLK, None,
                                     win.index_S[win.step_T[routed_T]])
            times.add("flush.route_records", clock() - t1)
        sampled_S = np.array([st.sample_row is not None for st in steps])
        if sampled_S.any():
            self._distribute_samples(steps, win, sampled_S)

    def _report_unwritten(self, steps: list[_Step], unwritten_TL: np.ndarray) -> None:
        """Name, per routed step, the layers that left some of its rows unwritten."""
        ids = self.geometry.moe_layer_ids
        for st in steps:
            if st.problem is not None:
                continue
            n = st.layout.num_tokens
            bad_TL = unwritten_TL[st.arena_row : st.arena_row + n]
            if bad_TL.any():
                counts = bad_TL.sum(axis=0)
                bad = [(ids[j], n - int(counts[j])) for j in np.flatnonzero(counts)]
                st.problem = f"layers (id, rows) {bad} routed fewer than the {n} scheduled tokens"

    def _distribute_samples(self, steps: list[_Step], win: "_Window", sampled_S: np.ndarray) -> None:
        """Sampler rows of the sampled steps occupy stage rows 0, 1, ... in step order (one commit per
        step, sampler_hook.SupportStage), so row x of the window's sampled rows is stage row x."""
        first_S = np.array([st.sample_row for st in steps if st.sample_row is not None])
        sampled_B = sampled_S[win.step_B]
        uid_B = np.where(win.discard_B, -1, win.uid_B)
        step_B = win.index_S[win.step_B]
        if win.emitted_B is None:  # one sample per row, the token after its last forwarded one
            size_S = win.b_S[sampled_S]
            uid_X = uid_B[sampled_B]
            g_X = (win.last_pos_B + 1 - win.prompt_B)[sampled_B]
            step_X = step_B[sampled_B]
        else:  # speculative steps: each row's emitted tokens follow its last sampled one (speculation.py)
            size_S = np.bincount(win.step_B, weights=win.emitted_B, minlength=len(steps)).astype(np.int64)[sampled_S]
            count_B = win.emitted_B[sampled_B]
            uid_X = np.repeat(uid_B[sampled_B], count_B)
            g0_B = (win.last_pos_B - win.drafts_B + 1 - win.prompt_B)[sampled_B]
            g_X = np.repeat(g0_B, count_B) + ranks_within(count_B)
            step_X = np.repeat(step_B[sampled_B], count_B)
        if not np.array_equal(first_S, np.cumsum(size_S) - size_S):
            raise CaptureHookError(f"support stage rows {first_S.tolist()} do not follow the steps' sizes {size_S}")
        t0 = time.perf_counter()
        staged = self.support.compute()  # times flush.kept_sets itself
        if staged.outside_R is not None:
            self.support_misses += int(staged.outside_R.sum())
        t1 = time.perf_counter()
        self.book.log.add_samples(uid_X, g_X, staged, step_X)
        self.times.add("flush.sample_records", time.perf_counter() - t1)

    def _flush_between_steps(self) -> None:
        """Flush for an RPC (discard/stats): its time counts as capture time too (inside a step, the
        step bracket times before_step, flush included)."""
        t0 = time.perf_counter()
        self.flush()
        self.hook_s += time.perf_counter() - t0

    def _slot_cache_pass(self, steps: list[_Step], chunk_TLK: np.ndarray, written_T: np.ndarray | None) -> None:
        """Slot-cache writes and prefix reads in step order (a read sees every earlier write); rows a
        layer never wrote are stored as not valid."""
        assert self.slot_cache is not None
        seg: list[_Step] = []
        for st in steps:
            if st.slots_T is not None:
                seg.append(st)
            if st.reads:
                self._write_slots(seg, chunk_TLK, written_T)
                seg = []
                for rec, block_ids, start, stop in st.reads:
                    if not self.book.holds(rec):
                        continue
                    rows, valid = self.slot_cache.read(block_ids, start, stop)
                    if not valid.all():
                        bad = int(np.flatnonzero(~valid)[0]) + start
                        rec.problems.append(
                            f"prefix-cache hit: routes of cached position {bad} were computed while capture was "
                            "off; reset the prefix cache (llm.reset_prefix_cache()) after installing capture"
                        )
                    self.book.log.add_routes(np.full(len(rows), rec.uid, dtype=np.int64), np.arange(start, stop),
                                             rows, valid, np.full(len(rows), st.index, dtype=np.int64))
        self._write_slots(seg, chunk_TLK, written_T)

    def _write_slots(self, seg: list[_Step], chunk_TLK: np.ndarray, written_T: np.ndarray | None) -> None:
        """Steps with slots are routed steps, so their route rows are one consecutive range."""
        if not seg:
            return
        rows = slice(seg[0].arena_row, seg[-1].arena_row + seg[-1].layout.num_tokens)
        self.slot_cache.write(join_rows([st.slots_T for st in seg]), chunk_TLK[rows],
                              None if written_T is None else written_T[rows])

    # -- control ------------------------------------------------------------------------------
    def take(self, keys: list[str]) -> list[CaptureRecord]:
        t0 = time.perf_counter()
        self.flush()
        self._batch = None  # a taken live request gets no record on its next step
        t1 = time.perf_counter()
        out = self.book.take(keys)
        for rec in out:
            if rec.rerouted:
                self.rerouted += len(rec.rerouted)
                self.stale += len(rec.stale)
        t2 = time.perf_counter()
        self.times.add("take.assemble", t2 - t1)
        self.take_s += t2 - t0
        self.hook_s += t2 - t0  # flush + assembling the records: capture work too
        return out

    def discard(self, keys: list[str]) -> int:
        self._flush_between_steps()
        self._batch = None
        return sum(self.book.discard(k) for k in keys)

    def stats(self) -> dict[str, Any]:
        self._flush_between_steps()
        return {
            "live": len(self.book.live),
            "unclaimed": len(self.book.finished),
            "evicted": len(self.book.evicted),
            "steps": self.steps,
            "flushes": self.flushes,
            "preemptions": self.preemptions,
            "support_misses": self.support_misses,
            "rerouted": self.rerouted,
            "stale": self.stale,
            "spec": None if self.spec is None else self.spec.to_dict(),
            "spec_drafts": self.spec_drafts,
            "spec_accepted": self.spec_accepted,
            "log_rows": self.book.log.rows,
            "hook_s": self.hook_s + sum(tally.s for tally in self._tallies),
            "route_mode": self.routes.mode if self.routes is not None else None,
            "route_arm_before": self.routes.arm_before if self.routes is not None else None,
            "route_rearms": self.route_rearms,
            "kv_group": self.kv_group if self.slot_cache is not None else None,
        }

    def timings(self, reset: bool = False) -> dict[str, Any]:
        """{"parts": host seconds and calls per part since install (or the last reset), "take_s":
        seconds inside take()}, after a flush (timed as flush.* like any other); see timings.py.
        The route functions inside an eager forward (hold mode) are not timed (route_hook.py)."""
        self._flush_between_steps()
        for tally in self._tallies:
            self.hook_s += tally.s
            tally.into(self.times)
        out = {"parts": self.times.to_dict(), "take_s": self.take_s}
        if reset:
            self.times.reset()
            self.take_s = 0.0
        return out

    def uninstall(self) -> None:
        self._patches.undo()
        if self.routes is not None:
            self.routes.uninstall()


def _records_of(steps: list[_Step]) -> dict[int, RequestRecord]:
    """uid -> record over the distinct batch compositions of `steps`."""
    out: dict[int, RequestRecord] = {}
    for batch in {id(st.batch): st.batch for st in steps}.values():
        out.update((rec.uid, rec) for rec in batch.records if rec is not None)
    return out


# -- ops (endpoint.py) ----------------------------------------------------------------------------
@OPS.register("capture.install")
def _capture_install(runner: Any, st: RunnerState, config: dict[str, Any]) -> dict[str, Any]:
    check_release(runner=port_of(runner).path)  # the names the hooks read on this runner (surface/needs.py)
    if st.capture is not None:
        raise CaptureHookError("capture is already installed on this engine; uninstall() it first")
    st.capture = WorkerCapture(runner, CaptureConfig.from_dict(config))
    return InstallReply(st.capture.geometry.to_dict(), st.capture.slot_cache is not None).to_dict()


register_part_ops("capture", "capture")


@OPS.register("capture.timings")
def _capture_timings(runner: Any, st: RunnerState, reset: Any) -> dict[str, Any]:
    return installed(st, "capture").timings(bool(reset))
