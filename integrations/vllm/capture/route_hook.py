"""Route capture through vLLM's official hook, `BaseRouter.set_capture_fn`.

Each MoE layer's router calls a capture function with its logical top-k ids [T, K] (before any
EPLB remap, in the column order the experts kernel consumes). Two ways to keep them, one per kind
of forward:

  step buffer  (compiled / CUDA-graph forwards, device runners) `write_step_rows` copies the ids
               into `StepRoutes.step_TLK`, a buffer allocated before compilation (fixed address:
               what a replayed CUDA graph needs, and what vLLM's own routed_experts_capturer.py
               does). It is pure tensor work with no Python state, so torch.compile traces it into
               the graph. Rows a step should fill hold a sentinel (the dtype's max, never an
               expert id) when the forward starts, so a layer that did not route a row shows up after it:
               an error, never zeros. After the forward the step's rows go to an arena (one copy
               on the runner's device); the arena goes to the host once per flush. On a host
               buffer the rows just read are set back to the sentinel right then (one byte copy in
               the same hook, `RouteCapture.arm_before`), so no hook runs before the step.
  hold         (eager CPU engines) the function keeps a reference to the router's fresh id
               tensor: it is the bound `append` of the layer's list, a C call with no Python
               frame inside the forward (against a closure per layer: the eager forward -0.39% at
               150 lockstep pairs, docs/findings.md; a tensor copy inside a busy CPU engine is
               ~10-20 us); nothing overwrites those tensors.
               `land` pops one entry per layer and checks the rows.

A compiled forward only calls a function that was set before torch.compile traced it, so for
`enforce_eager=False` the step buffer is bound when the model is loaded (`bind_at_load`, run by the
load hook in patch.py in every worker process of an engine built with capture_engine_kwargs()).
Installing capture later finds it on the model.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from ....geometry import ModelGeometry
from ..errors import CaptureHookError
from ..model import EngineFlags, find_moe_layers, forward_is_traced
from ..patch import CAPTURE_FLAG, LOAD_STEPS, LoadStep
from ..step import byte_view, copy_from_addresses

HOLD_DEVICES = {"cpu"}
"""Runner device types whose eager router ids are held by reference (fresh per call, never
overwritten); compiled forwards and other devices use the step buffer."""

STEP_ROUTES_ATTR = "_moe_replay_step_routes"
"""Attribute of the loaded model that holds its load-time StepRoutes."""


def torch_route_dtype(num_experts: int) -> torch.dtype:
    """Narrowest torch integer dtype that holds every expert id and supports copy_/index_copy_."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 1 << 15:
        return torch.int16
    return torch.int32


def _routers(layers: list[tuple[int, Any]]) -> list[Any]:
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    out = []
    for layer_id, moe in layers:
        router = getattr(moe, "router", None)
        if not isinstance(router, BaseRouter):
            raise CaptureHookError(
                f"MoE layer {layer_id}: router {type(router).__name__} is not a vllm BaseRouter, "
                "so it has no set_capture_fn hook (monolithic MoE kernels are not supported)"
            )
        if router.capture_fn is not None:
            raise CaptureHookError(
                f"MoE layer {layer_id}: router already has a capture_fn ({router.capture_fn!r}); "
                "another capturer (e.g. enable_return_routed_experts) is installed"
            )
        out.append(router)
    return out


def write_step_rows(step_TLK: torch.Tensor, j: int, topk_ids_TK: torch.Tensor) -> None:
    """The graph-safe capture function of MoE layer column j: one copy into a fixed buffer.

    A forward with more rows than the buffer fails here, loudly (shape mismatch)."""
    step_TLK[: topk_ids_TK.shape[0], j].copy_(topk_ids_TK)


class DataParallelRows:
    """Cuts this data-parallel rank's rows out of the ids a router hands its capture function.

    With data_parallel_size > 1, vLLM's MoE layers gather every DP rank's tokens before routing
    (naive dispatch, with or without expert parallelism), so a router routes the whole DP batch:
    rank r's tokens are rows [sum(counts[:r]), sum(counts[:r+1])) of it, counts being the
    forward context's per-rank token counts. Kernels that dispatch inside the experts call route
    only the rank's own rows. The layouts are vLLM's own (routed_experts_capturer.py). MoE layers
    run as an opaque custom op, so this Python runs eagerly in compiled forwards too; the counts
    live on the host (~3 us per layer, paid only under DP).

    A batch in a layout it does not know yields no rows, and `odd` says why: the step's requests
    then fail by name (RouteCapture.land) instead of taking another rank's routes.
    """

    def __init__(self, dp_rank: int) -> None:
        from vllm.forward_context import get_forward_context

        self.rank, self._context = int(dp_rank), get_forward_context
        self.odd: list[str] = []
        """Why a forward's routes could not be cut (cleared at each arm)."""

    @classmethod
    def of(cls, vllm_config: Any) -> "DataParallelRows | None":
        pc = vllm_config.parallel_config
        return cls(pc.data_parallel_rank) if int(getattr(pc, "data_parallel_size", 1) or 1) > 1 else None

    def __call__(self, topk_ids_TK: torch.Tensor) -> torch.Tensor:
        meta = self._context().dp_metadata
        if meta is None:
            return topk_ids_TK
        counts_R = meta.num_tokens_across_dp_cpu
        n, own = int(topk_ids_TK.shape[0]), int(counts_R[self.rank])
        if n == own:
            return topk_ids_TK
        if n == int(counts_R.sum()):
            start = int(counts_R[: self.rank].sum())
            return topk_ids_TK[start:start + own]
        sizes = getattr(meta, "local_sizes", None)  # sequence-parallel shards gathered DP rank by DP rank
        if sizes is not None and n == sum(sizes) and len(sizes) % len(counts_R) == 0:
            start = sum(sizes[: self.rank * (len(sizes) // len(counts_R))])
            return topk_ids_TK[start:start + own]
        self.odd.append(f"a router routed {n} rows; expected this DP rank's {own}, the DP batch's "
                        f"{int(counts_R.sum())} (per-rank counts {counts_R.tolist()}) or the gathered shards' {sizes}")
        return topk_ids_TK[:0]


def write_local_step_rows(step_TLK: torch.Tensor, j: int, rows: DataParallelRows, topk_ids_TK: torch.Tensor) -> None:
    """write_step_rows of this DP rank's rows."""
    write_step_rows(step_TLK, j, rows(topk_ids_TK))


class StepRoutes:
    """step_TLK [rows, L, K]: the ids every MoE layer routed in the running forward.

    `rows` covers the largest forward the runner makes (max_num_batched_tokens, or a larger CUDA
    graph capture size). The dtype holds every expert id plus the sentinel (its max value).
    """

    def __init__(self, layers: list[tuple[int, Any]], rows: int, device: torch.device,
                 dp_rows: DataParallelRows | None = None) -> None:
        routers = _routers(layers)
        self.layer_ids = tuple(i for i, _ in layers)
        num_experts = max(int(r.global_num_experts) for r in routers)
        top_k = max(int(r.top_k) for r in routers)
        self.dtype = torch_route_dtype(num_experts + 1)
        self.sentinel = int(torch.iinfo(self.dtype).max)
        self.rows = int(rows)
        self.step_TLK = torch.full((self.rows, len(routers), top_k), self.sentinel, dtype=self.dtype, device=device)
        self._np = self.step_TLK.numpy() if self.step_TLK.device.type == "cpu" else None
        self.row_bytes = len(routers) * top_k * self.step_TLK.element_size()
        self.bytes = byte_view(self._np) if self._np is not None else None
        """Host buffer: its bytes, for the copy to the arena and the re-arm (no ctypes inside the step: step.HostRing)."""
        self._armed = byte_view(np.full(self._np.shape, self.sentinel, self._np.dtype)) if self._np is not None else None
        """Host buffer: sentinel rows to copy from."""
        self._routers = routers
        self.dp_rows = dp_rows
        for j, router in enumerate(routers):
            router.set_capture_fn(functools.partial(write_step_rows, self.step_TLK, j) if dp_rows is None else
                                  functools.partial(write_local_step_rows, self.step_TLK, j, dp_rows))

    def arm(self, num_tokens: int) -> None:
        """Set rows [0, num_tokens) to the sentinel (outside the graph)."""
        if self.bytes is not None:  # one byte copy: a numpy fill pays ~25 us first-call inside a step
            n = num_tokens * self.row_bytes
            self.bytes[:n] = self._armed[:n]
        else:
            self.step_TLK[:num_tokens].fill_(self.sentinel)

    def dirty_rows(self) -> int:
        """Host buffer: rows not at the sentinel (0 when every row is; -1 off host: not read)."""
        if self._np is None:
            return -1
        return int(np.count_nonzero((self._np != self.sentinel).reshape(self.rows, -1).any(axis=1)))

    def unbind(self) -> None:
        for router in self._routers:
            router.set_capture_fn(None)
        self._routers.clear()


def bind_at_load(model: torch.nn.Module, vllm_config: Any) -> StepRoutes | None:
    """Give a freshly loaded model its StepRoutes, before its first (compiling) forward.

    CAPTURE_FLAG's load step (patch.py's load hook runs it); no-op for models without MoE layers,
    and for engines that capture routes themselves (enable_return_routed_experts: vLLM sets the
    routers' capture function after load, over any set here; capture reads their routes from the
    outputs, capture/native.py)."""
    layers = find_moe_layers(model)
    if not layers or EngineFlags.of(vllm_config).routed_experts:
        return None
    rows = max(int(vllm_config.scheduler_config.max_num_batched_tokens),
               int(getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", 0) or 0))
    device = next(model.parameters()).device
    step = StepRoutes(layers, rows, device, DataParallelRows.of(vllm_config))
    model.__dict__[STEP_ROUTES_ATTR] = step  # a plain attribute: not a submodule, not a buffer
    return step


LOAD_STEPS.add(CAPTURE_FLAG, LoadStep(bind_at_load, (__file__,)))


def _join_held(landed: list[tuple[int, list[torch.Tensor], list[int], torch.dtype]], K: int) -> np.ndarray:
    """Every landed step's layers end to end, [sum_s L * n_s, K], the first n_s rows of each held
    tensor (a padded forward routes extra rows). Where `land` took every tensor's address (contiguous
    [rows, K] tensors of one dtype), one memmove per tensor and no touch of the tensors themselves:
    they are cold by now (reading 66 steps' through torch.cat took ~2.8 ms a flush on the bench
    model, copying from addresses ~2 ms with the frees). Else one torch.cat (a torch op inside the
    loaded vLLM-CPU engine is an OpenMP region of ~10 us to ms, so a per-layer cat + stack + cast
    took 3 + L of them per flush; joining each step's layers in the hook instead cost more than it
    saved: eager, 40 pairs each, torch.cat per step +65 us of hook, numpy per step +82 us, against
    44-46 us less here)."""
    dtype = landed[0][3]
    if dtype in _ID_NUMPY and all(d is dtype and all(ptrs) for _, _, ptrs, d in landed):
        out = np.empty((sum(n * len(ptrs) for n, _, ptrs, _ in landed), K), dtype=_ID_NUMPY[dtype])
        row = K * out.itemsize  # each tensor holds >= n rows (RouteCapture.land checked): its first n
        return copy_from_addresses(out, [p for _, _, ptrs, _ in landed for p in ptrs],
                                   [n * row for n, _, ptrs, _ in landed for _ in ptrs])
    return torch.cat([h if h.shape[0] == n else h[:n] for n, held, _, _ in landed for h in held]).numpy()


_ID_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.uint8: np.uint8}
"""Router id dtypes copied by address."""


class RouteCapture:
    """Route rows of recent steps (`capacity` rows at most), filled by one of the two ways above.

    Rows are numbered from 0 since the last flush. The window always holds at least one full step
    (max_num_tokens rows), else what `budget_bytes` allows. Per step: `land` after the forward
    (which also re-arms the rows for the next one, unless `arm_before`), `chunk` at the flush.
    """

    def __init__(self, runner: Any, geometry: ModelGeometry, budget_bytes: int = 0) -> None:
        self.geometry = geometry
        L, K = geometry.num_moe_layers, geometry.top_k
        self.step_rows = int(runner.max_num_tokens)
        self.dtype = torch_route_dtype(geometry.num_experts)
        self.step: StepRoutes | None = getattr(runner.model, STEP_ROUTES_ATTR, None)
        dp_rows = DataParallelRows.of(runner.vllm_config)
        self._own_step = False
        self.hold = False
        if self.step is not None:
            if self.step.layer_ids != geometry.moe_layer_ids:
                raise CaptureHookError(f"load-time route buffer covers layers {self.step.layer_ids}, the model "
                                       f"has MoE layers {geometry.moe_layer_ids}")
        elif forward_is_traced(runner.vllm_config):
            raise CaptureHookError(
                "this engine compiles its forward (enforce_eager=False: torch.compile / CUDA graphs), and its "
                "routers got no capture function at model load, so the compiled forward would never report "
                "routes. Build the engine with LLM(..., **capture_engine_kwargs()) (it sets additional_config "
                "'moe_replay_capture', which the moe_replay load hook needs; it is installed by the "
                "'vllm.general_plugins' entry point of the moe_replay package), or use enforce_eager=True"
            )
        elif torch.device(runner.device).type in HOLD_DEVICES:
            self.hold = True
        else:
            self.step = StepRoutes(find_moe_layers(runner.model), self.step_rows, torch.device(runner.device), dp_rows)
            self._own_step = True
        self.dp_rows = self.step.dp_rows if self.step is not None else dp_rows
        """This DP rank's row cut (None without data parallelism); a load-time step buffer has its own."""
        id_bytes = 8 if self.hold else self.dtype.itemsize  # held: the router's own int32/int64 ids
        self.capacity = max(self.step_rows, budget_bytes // (L * K * id_bytes))
        self.arena_TLK: torch.Tensor | None = None
        self._arena_np: np.ndarray | None = None
        self._arena_bytes: memoryview | None = None
        if self.step is not None:
            self.arena_TLK = torch.empty((self.capacity, L, K), dtype=self.step.dtype,
                                         device=self.step.step_TLK.device)
            if tuple(self.step.step_TLK.shape[1:]) != (L, K):
                raise CaptureHookError(f"route step buffer rows are {tuple(self.step.step_TLK.shape[1:])} "
                                       f"(layers, top-k); the model's geometry says {(L, K)}")
            if self.arena_TLK.device.type == "cpu":
                self._arena_np = self.arena_TLK.numpy()
                self._arena_bytes = byte_view(self._arena_np)
        self.arm_before = self.dp_rows is not None or (self.step is not None and self._arena_np is None)
        """Whether `arm` must run before each forward. Not on host runners without data parallelism:
        there `land` re-arms the rows it read (hold: the per-layer row counts) in the same hook, and
        the only forwards outside the engine's steps (profile, warm-up, compile) run before capture
        is installed; with DP, dummy forwards run between steps; device buffers arm with a kernel.
        A host step buffer found dirty at a flush (`check_armed`) switches to arming before."""
        self._held_L: list[list[torch.Tensor]] = [[] for _ in range(L)]
        """Hold mode: per layer, the top-k ids its router handed over in the running forward (one
        entry after a forward; `land` pops it, `arm` empties the lists)."""
        self._landed: list[tuple[int, list[torch.Tensor], list[int], torch.dtype]] = []
        """Per landed step (hold mode): its token count, its layers' ids ([>= count, K] each), their
        addresses (0: not a contiguous [rows, K] tensor of the step's dtype) and that dtype (`_join_held`)."""
        self._hold_routers: list[Any] = []
        if self.hold:
            self._hold_routers = _routers(find_moe_layers(runner.model))
            for j, router in enumerate(self._hold_routers):
                router.set_capture_fn(self._hold_fn(j))
        elif self.step is not None:
            self.step.arm(self.step.rows)  # a load-time buffer holds the warm-up forwards' rows

    def _hold_fn(self, j: int):
        """Layer j's capture function in hold mode: its list's bound `append` (see the module
        docstring); under data parallelism a closure cuts this rank's rows first."""
        held, local = self._held_L[j], self.dp_rows
        if local is None:
            return held.append

        def capture(topk_ids_TK: torch.Tensor) -> None:
            held.append(local(topk_ids_TK))

        return capture

    def _clear_held(self) -> None:
        for lst in self._held_L:
            lst.clear()

    def _held_problem(self, num_tokens: int, popped: bool) -> str:
        """Why a forward's held ids cannot be filed: some layers handed over none (their lists are
        empty), or more than one (what is left after one pop from each list)."""
        ids, left = self.geometry.moe_layer_ids, [len(lst) for lst in self._held_L]
        if not popped:
            bad = [(ids[j], 0) for j, n in enumerate(left) if not n]
            return f"layers (id, rows) {bad} routed fewer than the {num_tokens} scheduled tokens"
        bad = [(ids[j], n + 1) for j, n in enumerate(left) if n]
        return f"layers (id, calls) {bad} routed more than once in one forward"

    @property
    def mode(self) -> str:
        return "hold" if self.hold else ("load-time step buffer" if not self._own_step else "step buffer")

    def arm(self, num_tokens: int) -> None:
        """Before a forward of num_tokens rows (only where `arm_before`): its rows start unwritten."""
        if self.dp_rows is not None:
            self.dp_rows.odd.clear()
        if self.hold:  # ids a forward that never landed (a dummy run) left
            self._clear_held()
        elif num_tokens <= self.step.rows:
            self.step.arm(num_tokens)

    def land(self, offset: int, num_tokens: int) -> str | None:
        """File this step's rows after its forward at window rows [offset, offset + num_tokens);
        None when filed, else what went wrong. Re-arms the rows for the next forward (not
        `arm_before`), filed or not."""
        arena, step = self._arena_bytes, self.step
        if arena is not None and not self.arm_before and offset + num_tokens <= self.capacity \
                and num_tokens <= step.rows:
            # the host step buffer's common case in one frame (the general path below is three calls
            # and a try: ~4 us more a step inside the engine, benchmarks/capture.py): file, re-arm
            rb = step.row_bytes
            m, src = num_tokens * rb, step.bytes
            arena[offset * rb : offset * rb + m] = src[:m]
            src[:m] = step._armed[:m]
            return None
        try:
            return self._land(offset, num_tokens)
        finally:
            if not self.arm_before:
                if self.hold:
                    if any(self._held_L):  # what a refused step left (a filed one popped its ids)
                        self._clear_held()
                else:
                    self.step.arm(min(num_tokens, self.step.rows))

    def _land(self, offset: int, num_tokens: int) -> str | None:
        if offset + num_tokens > self.capacity:
            return f"step of {num_tokens} tokens at row {offset} exceeds the route window ({self.capacity} rows)"
        if self.dp_rows is not None and self.dp_rows.odd:
            return self.dp_rows.odd[0]
        if self.hold:
            lists, K = self._held_L, self.geometry.top_k
            if not all(lists):  # C loops (`all`, `map`, `any`): this runs cold after the forward
                return self._held_problem(num_tokens, popped=False)
            held = list(map(list.pop, lists))  # one entry per layer
            if any(lists):
                return self._held_problem(num_tokens, popped=True)
            # addresses now, in one loop (the tensor methods' code warm after the first layer): at
            # the flush the 66 steps' tensors are cold, and reading them through torch.cat took ~2.8 ms
            dtype = held[0].dtype
            ptrs = [h.data_ptr() if h.dtype is dtype and h.shape[1] == K and h.shape[0] >= num_tokens
                    and h.is_contiguous() else 0 for h in held]
            if not all(ptrs) and min(h.shape[0] for h in held) < num_tokens:
                ids = self.geometry.moe_layer_ids
                bad = [(ids[j], h.shape[0]) for j, h in enumerate(held) if h.shape[0] < num_tokens]
                return f"layers (id, rows) {bad} routed fewer than the {num_tokens} scheduled tokens"
            self._landed.append((num_tokens, held, ptrs, dtype))
            return None
        if num_tokens > self.step.rows:
            return f"step of {num_tokens} tokens exceeds the route step buffer ({self.step.rows} rows)"
        step = self.step
        if self._arena_np is not None:
            rb = step.row_bytes
            self._arena_bytes[offset * rb : (offset + num_tokens) * rb] = step.bytes[: num_tokens * rb]
        else:  # on the runner's device, ordered after the forward on its stream
            self.arena_TLK[offset : offset + num_tokens].copy_(step.step_TLK[:num_tokens], non_blocking=True)
        return None

    def check_armed(self) -> int:
        """At a flush, where `land` re-arms a host step buffer: rows some forward outside the
        engine's steps (a padded or dummy forward) left written. Such rows could hide a layer that
        failed to route in a later step, so from then on `arm` runs before every forward and the
        whole buffer is re-armed now. Returns the rows found (0: none)."""
        if self.arm_before or self.hold:
            return 0
        dirty = self.step.dirty_rows()
        if dirty > 0:
            self.arm_before = True
            self.step.arm(self.step.rows)
        return max(dirty, 0)

    def chunk(self, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows [0, stop) of every landed step as one narrow array [stop, L, K], and a bool [stop, L]
        of rows a layer never wrote (step buffer; None when all were written). Starts a new window."""
        if not self.hold:  # one device-to-host copy per flush (a host arena: its numpy view, no tensor op)
            out = self._arena_np[:stop] if self._arena_np is not None else self.arena_TLK[:stop].cpu().numpy()
            unwritten_TL = (out == self.step.sentinel).any(axis=2)
            return out.astype(self.geometry.route_dtype), unwritten_TL if unwritten_TL.any() else None
        landed, self._landed = self._landed, []
        L, K = self.geometry.num_moe_layers, self.geometry.top_k
        if not landed:
            return torch.empty((0, L, K), dtype=self.dtype).numpy(), None
        flat_XK = _join_held(landed, K)
        parts, x = [], 0
        for n, *_ in landed:  # step s: [L, n_s, K] -> [n_s, L, K]
            parts.append(flat_XK[x : x + L * n].reshape(L, n, K).transpose(1, 0, 2))
            x += L * n
        out = np.concatenate(parts).astype(self.geometry.route_dtype, copy=False)
        if len(out) != stop:
            raise CaptureHookError(f"route window holds {len(out)} rows, expected {stop}")
        return out, None

    def uninstall(self) -> None:
        for router in self._hold_routers:
            router.set_capture_fn(None)
        self._hold_routers.clear()
        if self._own_step:
            self.step.unbind()
        # A load-time step buffer stays bound: the compiled forward calls it whether or not
        # capture is installed (one copy per layer into a fixed buffer).
