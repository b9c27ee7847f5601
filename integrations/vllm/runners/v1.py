"""The V1 model runner's port (runners/base.py): vLLM's V1 `GPUModelRunner` and vLLM-CPU's
`CPUModelRunner` on it (vllm/v1/worker/gpu_model_runner.py).

What it reads: the persistent input batch (`runner.input_batch`: request ids in batch order, the
computed-token counts, block tables with their slot mappings), the runner's step buffers
(`query_start_loc`, `positions`, `discard_request_mask`, `input_ids`), its request states
(`runner.requests`) and its sampler (`sampler.forward`, `sampler.topk_topp_sampler.forward`,
`rejection_sampler.forward` under speculation).

Where they come from: on HOST_MIRROR_DEVICES runners (CPU) `positions` and the slot mapping are
host tensors, copied as they are into host rings with one byte-view copy each (step.HostRing: no
numpy or ctypes call inside the step). Other runners (GPU) fill those on the device; positions and
slots are derived from host mirrors (num_computed_tokens_cpu, query_start_loc, the block table),
the same way vLLM computes them, so nothing waits on a device copy.

The forward point is `runner._model_forward` (inputs prepared, model not yet run); the sampler's
truncation is wrapped where it happens (`TopKTopPSampler.forward`: capture/sampler_hook.py), and
under speculative decoding its rejection sampler (capture/speculation.py).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
import torch

from ..errors import CaptureHookError
from ..step import HostRing, RingRows, StepLayout, byte_view, kv_slots, take_rows
from .base import RunnerPort, require

HOST_MIRROR_DEVICES = {"cpu"}
"""Runner device types whose `positions` and slot mapping are host tensors, read as they are."""


class V1Port(RunnerPort):
    """The V1 runner's port: its per-step host buffers, viewed once per input batch, one layout per
    step; its sampler's truncation; its requests and block tables.

    Host runners copy each step's rows into HostRings (byte views, no numpy inside the step): the
    layouts stay valid until `rewind`, which the capture listener calls after each flush; a ring
    without room starts over by itself, so a listener that keeps layouts counts the items it took
    against `free_items` and flushes first (a step of n tokens takes n positions, n slots, <= n
    discard flags and <= n + 1 query starts)."""

    path = "v1"

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self._ib: Any = None
        self._direct = False
        self._host = False
        self.current: StepLayout | None = None
        """The current step's layout once a listener took it; the step bracket sets it to None
        before each engine step (an attribute store: a method call there was one more frame a step)."""
        self._rings: dict[str, HostRing] = {}
        """Host runners: "qsl", "pos", "discard" and "slots<group>" rings (allocated at first bind)."""
        self._layout_src: tuple[tuple[HostRing, memoryview], ...] = ()
        """Host runners: the qsl, pos and discard rings with a byte view of their runner buffer."""
        self._ids: list[str] | None = None
        """The request ids of the last layout taken (a copy; shared by the next one while the batch
        keeps them: a list of B ids compared by identity instead of a new slice per step)."""
        self._slot_src: dict[int, tuple[tuple[HostRing, memoryview]]] = {}
        """Host runners: per KV group, its slot ring and a byte view of vLLM's slot mapping (`take_rows`)."""
        self._with_slots: dict[int, tuple[tuple[HostRing, memoryview], ...]] = {}
        """Host runners: per KV group, the layout's sources and then its slots' (`layout_slots`)."""
        tokens = int(getattr(runner, "max_num_tokens", 0) or 0)
        self.ring_tokens = max(1 << 16, 4 * tokens)
        """Tokens the host rings hold: 64 Ki (512 KiB of int64 positions) or four full steps."""

    def _bind(self) -> None:
        r = self.runner
        ib = self._ib = r.input_batch
        # The list and map that InputBatch's `req_ids` / `num_reqs` properties read, read directly
        # where they are what the properties return: the two property calls (one a typing.cast) were
        # ~5 us a step inside the engine (benchmarks/capture.py, step.after_forward).
        self._direct = (type(getattr(ib, "_req_ids", None)) is list and ib.req_ids is ib._req_ids
                        and type(getattr(ib, "req_id_to_index", None)) is dict
                        and ib.num_reqs == len(ib.req_id_to_index))
        self._qsl, self._discard = r.query_start_loc.np, r.discard_request_mask.np
        self._host = torch.device(r.device).type in HOST_MIRROR_DEVICES
        self._slot_src = {}
        self._with_slots = {}
        if not self._host:
            return
        # the runner's host buffers, viewed once: a `.numpy()` per step is ~4 dispatcher ops
        src = {"qsl": self._qsl, "pos": r.positions.numpy(), "discard": self._discard}
        sizes = {"qsl": 2 * self.ring_tokens, "pos": self.ring_tokens, "discard": 2 * self.ring_tokens}
        for name, a in src.items():
            ring = self._rings.get(name)
            if ring is None or ring.array.dtype != a.dtype:
                self._rings[name] = HostRing(a.dtype, sizes[name])
        self._layout_src = tuple((self._rings[name], byte_view(a)) for name, a in src.items())

    def free_items(self) -> int:
        """Items the fullest host ring takes before it starts over (rings not made yet: ring_tokens;
        off host the layouts are copies and the rings are not used)."""
        return min((ring.capacity - ring.used for ring in self._rings.values()), default=self.ring_tokens)

    def rewind(self) -> None:
        """Start every host ring over: layouts and slots taken before are no longer valid, except
        the current step's layout (a listener that flushes inside a step keeps what another
        listener took of it before the forward)."""
        keep = {}
        if self.current is not None and self._host:
            lay = self.current
            keep = {id(r[0]): r[2] for r in (lay._qsl, lay._pos, lay._discard)}
        for ring in self._rings.values():
            ring.used = keep.get(id(ring.array), 0)

    def layout(self, n: int) -> StepLayout:
        """The current step's layout for its n scheduled tokens (taken once, then shared)."""
        if self.current is not None:
            return self.current
        if self._ib is not self.runner.input_batch:  # re-bound if the input batch is rebuilt
            self._bind()
        return self._take(n, self._layout_src)[0]

    def layout_slots(self, n: int, kv_group: int) -> "tuple[StepLayout, np.ndarray | RingRows]":
        """`layout(n)` and `slots(layout, kv_group)`; where the layout is not taken yet on a host
        runner, the slots ride in its one `take_rows` call (their own call was ~3 us a step inside
        the engine: bench model, compiled)."""
        if self.current is None:
            if self._ib is not self.runner.input_batch:  # re-bound if the input batch is rebuilt
                self._bind()
            if self._host:
                src = self._with_slots.get(kv_group)
                if src is None:
                    src = self._with_slots[kv_group] = self._layout_src + self._slot_source(kv_group)
                return self._take(n, src)
        layout = self.layout(n)
        return layout, self.slots(layout, kv_group)

    def _take(self, n: int, src: "tuple[tuple[HostRing, memoryview], ...]") -> "tuple[StepLayout, RingRows | None]":
        """Take the step's layout (and, on a host runner, the rows of any sources past the layout's
        three: the slots of `layout_slots`)."""
        ib, req_ids = self._ib, self._ids
        if self._direct:  # the input batch's live list (condensed: num_reqs long)
            num_reqs, ids = len(ib.req_id_to_index), ib._req_ids
        else:
            num_reqs, ids = ib.num_reqs, ib.req_ids
        if len(ids) != num_reqs or ids != req_ids:
            req_ids = self._ids = ids[:num_reqs]  # a slice: a new list
        if self._host:
            rows = take_rows(src, (num_reqs + 1, n, num_reqs, n))  # zip stops at the sources given
            self.current = StepLayout(req_ids, rows[0], rows[1], rows[2])
            return self.current, (rows[3] if len(rows) > 3 else None)
        qsl_B1 = self._qsl[: num_reqs + 1].copy()
        row_T = np.repeat(np.arange(num_reqs), np.diff(qsl_B1))
        pos_T = ib.num_computed_tokens_cpu[row_T].astype(np.int64) + np.arange(n) - qsl_B1[row_T]
        self.current = StepLayout(req_ids, qsl_B1, pos_T, self._discard[:num_reqs].copy())
        return self.current, None

    def _slot_source(self, kv_group: int) -> "tuple[tuple[HostRing, memoryview]]":
        """Host runners: `kv_group`'s slot ring and a byte view of vLLM's slot mapping, bound once
        per input batch."""
        # the tensor vLLM's kernel writes: on CPU runners `.gpu` is a host tensor, and it is not
        # always `.cpu` (an input batch rebuilt for a hybrid KV layout gets separate buffers)
        mapping = self._ib.block_table.block_tables[kv_group].slot_mapping.gpu
        if not mapping.is_contiguous() or mapping.dtype != torch.int64:
            raise RuntimeError(f"vLLM slot mapping of KV group {kv_group} is {mapping.dtype}, not contiguous int64")
        name = f"slots{kv_group}"
        if name not in self._rings:
            self._rings[name] = HostRing(np.dtype(np.int64), self.ring_tokens)
        bound = self._slot_src[kv_group] = ((self._rings[name], byte_view(mapping.numpy())),)
        return bound

    def slots(self, layout: StepLayout, kv_group: int) -> "np.ndarray | RingRows":
        """KV slot of each forwarded token in `kv_group`'s block table (`rows_of` gives the array)."""
        n = layout.num_tokens
        if self._host:
            bound = self._slot_src.get(kv_group)  # per step: one lookup (the first time, the buffers)
            return take_rows(bound or self._slot_source(kv_group), (n,))[0]
        bt = self._ib.block_table.block_tables[kv_group]
        row_T = np.repeat(np.arange(len(layout.req_ids)), np.diff(layout.qsl_B1))
        size = int(bt.block_size)
        return kv_slots(bt.block_table.np[row_T, layout.pos_T // size], layout.pos_T, size)

    # -- hook points ---------------------------------------------------------------------------------
    def wrap_forward(self, patches: Any, before_forward: Callable[[], None]) -> bool:
        if not hasattr(self.runner, "_model_forward"):
            return False

        def make(orig):
            def model_forward(*args, **kwargs):
                before_forward()
                return orig(*args, **kwargs)

            return model_forward

        patches.wrap(self.runner, "_model_forward", make)
        return True

    def wrap_sampler(self, patches: Any, capture: Any) -> None:
        """`sampler.forward` (the step's one hook: after_sample) and the truncation
        (`topk_topp_sampler.forward`, a C-level partial: no Python frame of its own in every sampler
        call); under speculation the rejection sampler (`_make_rejection`)."""
        runner = self.runner
        sampler, support = runner.sampler, capture.support
        after_sample, truncate = capture.after_sample, support.truncate_and_observe

        def make_sampler(orig):  # both wrappers' work times itself (step.after_sample, step.support_stage)
            def forward(logits, sampling_metadata, *args, **kwargs):
                out = orig(logits, sampling_metadata, *args, **kwargs)
                if support.spec_bonus is None:  # (a speculative step's bonus rows: its rejection sampler files it)
                    after_sample(out.sampled_token_ids, _temperatures(support, sampling_metadata))
                return out

            return forward

        patches.wrap(sampler, "forward", make_sampler)
        patches.wrap(sampler.topk_topp_sampler, "forward", lambda orig: functools.partial(truncate, orig))
        if getattr(capture, "spec", None) is not None:
            patches.wrap(runner.rejection_sampler, "forward", _make_rejection(capture))

    def check_capture(self, speculative: bool) -> None:
        require(self.runner, ("model", "input_batch", "query_start_loc", "positions", "discard_request_mask",
                              "requests", "sampler"), "capture on the V1 runner")
        if not hasattr(self.runner.sampler, "topk_topp_sampler"):
            raise CaptureHookError(f"sampler {type(self.runner.sampler).__name__} has no topk_topp_sampler to hook")

    # -- requests and KV blocks ------------------------------------------------------------------------
    @property
    def max_num_reqs(self) -> int:
        return int(self.runner.input_batch.max_num_reqs)

    def num_block_tables(self) -> int:
        return len(self.runner.input_batch.block_table.block_tables)

    def block_size(self, kv_group: int) -> int:
        return int(self.runner.input_batch.block_table.block_tables[kv_group].block_size)

    def request(self, rid: str, scheduler_output: Any) -> tuple[int, int]:
        state = self.runner.requests[rid]
        sp = state.sampling_params
        start = int(getattr(sp, "routed_experts_prompt_start", 0) or 0) if sp is not None else 0
        return int(state.num_prompt_tokens), start

    def block_ids(self, rid: str, row: int, kv_group: int, scheduler_output: Any) -> np.ndarray:
        return self.runner.input_batch.block_table.block_tables[kv_group].block_table.np[row].copy()

    # -- values of the step just run ------------------------------------------------------------------
    def step_token_ids(self, n: int) -> np.ndarray:
        return self.runner.input_ids.cpu[:n].numpy()

    def num_reqs(self) -> int:
        return int(self.runner.input_batch.num_reqs)


def _temperatures(support: Any, sampling_metadata: Any) -> "float | np.ndarray":
    """The step's temperatures as capture commits them: 0 where the truncation never ran (every row
    greedy), 1 where every row is random at temperature 1 (`all_random` or none given), else a copy
    of the per-row tensor (a persistent buffer: greedy rows below step.GREEDY_EPS)."""
    if not support.staged:
        return 0.0
    if sampling_metadata.all_random or sampling_metadata.temperature is None:
        return 1.0
    return sampling_metadata.temperature.cpu().numpy().copy()


def _make_rejection(capture: Any) -> Callable[[Callable], Callable]:
    """The rejection sampler's wrapper (speculative decoding): the Sampler it calls for the bonus
    rows truncates into `support.spec_bonus` (sampler_hook.py) and files nothing; the draft rows'
    target logits are taken from the `rejection_sample` call, the one function that samples from
    them (its module global swapped for the length of the call: vLLM calls it by that name); then
    the step is filed with the emitted tokens (capture.worker.WorkerCapture.after_spec_sample)."""
    import inspect

    from vllm.v1.sample import rejection_sampler as module

    support, after = capture.support, capture.after_spec_sample
    params = list(inspect.signature(module.rejection_sample).parameters)
    if "target_logits" not in params:
        raise CaptureHookError(f"vllm.v1.sample.rejection_sampler.rejection_sample{tuple(params)} has no target_logits "
                               "parameter to read the draft rows' target distribution from (vLLM version mismatch?)")
    at = params.index("target_logits")

    def make(orig):
        def forward(metadata, draft_probs, logits, sampling_metadata, *args, **kwargs):
            seen: list[Any] = []
            inner = module.rejection_sample

            def rejection_sample(*a, **kw):
                seen.append(a[at] if len(a) > at else kw["target_logits"])
                return inner(*a, **kw)

            support.spec_bonus = []
            module.rejection_sample = rejection_sample
            try:
                out = orig(metadata, draft_probs, logits, sampling_metadata, *args, **kwargs)
            except BaseException:
                support.spec_bonus = None
                raise
            finally:
                module.rejection_sample = inner
            after(out.sampled_token_ids, metadata, seen[0] if seen else None, sampling_metadata)
            return out

        return forward

    return make
