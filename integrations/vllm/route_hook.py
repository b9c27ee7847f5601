"""Route capture through vLLM's official hook, `BaseRouter.set_capture_fn`.

Each MoE layer's router calls our function with its logical top-k ids [T, K] (before any EPLB
remap, in the column order the experts kernel consumes). Inside the forward the function only keeps
them (a reference on CPU engines, a copy into a preallocated narrow arena elsewhere); rows of many
steps are stacked and mapped to requests in one pass when the worker flushes (see worker.py).
Why: each small op costs ~10 us inside a busy CPU engine, and a step has one call per MoE layer.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from ...geometry import ModelGeometry
from .errors import CaptureHookError, NoMoeLayersError

HOLD_DEVICES = {"cpu"}
"""Runner device types whose router ids are held by reference (fresh per call, never overwritten);
every other device copies them into an arena on the device."""


def torch_route_dtype(num_experts: int) -> torch.dtype:
    """Narrowest torch integer dtype that holds every expert id and supports copy_/index_copy_."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 1 << 15:
        return torch.int16
    return torch.int32


def find_moe_layers(model: torch.nn.Module) -> list[tuple[int, Any]]:
    """(global layer id, MoERunner) of every MoE layer, sorted by layer id."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    found = [(int(m.layer_id), m) for m in model.modules() if isinstance(m, MoERunner)]
    found.sort(key=lambda x: x[0])
    ids = [i for i, _ in found]
    if len(set(ids)) != len(ids):
        raise CaptureHookError(f"MoE layer ids must be unique per model; found {ids}")
    return found


def geometry_from_runner(runner: Any) -> ModelGeometry:
    """Geometry of the served model, read from the live modules (not guessed from config)."""
    layers = find_moe_layers(runner.model)
    model_config = runner.model_config
    if not layers:
        raise NoMoeLayersError(
            f"model {model_config.model!r} ({type(runner.model).__name__}) has no MoE layer "
            "(no vllm MoERunner module): there are no routes to capture"
        )
    experts = {int(m.router.global_num_experts) for _, m in layers}
    top_ks = {int(m.router.top_k) for _, m in layers}
    if len(experts) != 1 or len(top_ks) != 1:
        raise CaptureHookError(
            f"every MoE layer must share num_experts and top_k; found num_experts={sorted(experts)}, "
            f"top_k={sorted(top_ks)}"
        )
    return ModelGeometry(
        num_layers=int(model_config.get_total_num_hidden_layers()),
        moe_layer_ids=tuple(i for i, _ in layers),
        num_experts=experts.pop(),
        top_k=top_ks.pop(),
        vocab_size=int(model_config.get_vocab_size()),
        family=str(getattr(model_config.hf_config, "model_type", "")),
    )


class RouteCapture:
    """Route rows of recent steps (`capacity` rows at most) plus one capture function per MoE layer.

    Two ways to hold them until the worker flushes (worker.py), chosen by the runner's device:
      hold  (CPU)   each layer's top-k output tensor is kept as is; `land` files the step's tensors
                    and `chunk` stacks every held step in one pass at the flush. vLLM's CPU router
                    allocates these per call and nothing writes to them afterwards (the capture
                    tests compare every captured route with HF's routing);
      arena (other) each layer copies its ids into a preallocated narrow arena routes_TLK on the
                    runner's device at the step's offset (an async device copy; the buffers a
                    device kernel reuses must be copied at once); `chunk` moves the window to the
                    host once per flush. The capture tests run this mode on the CPU engine too.
    Either way `capacity` is at least one full step (max_num_tokens), else what `budget_bytes`
    allows; rows are numbered from 0 since the last flush, and `offset` is the current step's first.
    """

    def __init__(self, runner: Any, geometry: ModelGeometry, budget_bytes: int = 0) -> None:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        self.geometry = geometry
        L, K = geometry.num_moe_layers, geometry.top_k
        self.step_rows = int(runner.max_num_tokens)
        self.dtype = torch_route_dtype(geometry.num_experts)
        self.hold = torch.device(runner.device).type in HOLD_DEVICES
        id_bytes = 8 if self.hold else self.dtype.itemsize  # held: the router's own int32/int64 ids
        self.capacity = max(self.step_rows, budget_bytes // (L * K * id_bytes))
        self.routes_TLK = None if self.hold else torch.zeros((self.capacity, L, K), dtype=self.dtype,
                                                             device=runner.device)
        self.offset = 0
        """First row of the current step."""
        self._base = [0]  # what the capture closures read: the offset of the running forward
        self._copy_s = [0.0]
        self._held_L: list[torch.Tensor | None] = [None] * L
        """Each layer's top-k ids of the running forward (hold mode)."""
        self._landed: list[tuple[int, list[torch.Tensor]]] = []
        """Per landed step (hold mode): its token count and its layers' ids, [>= count, K] each."""
        self.rows_seen_L = [0] * L
        """Rows written by each layer in the current forward (reset per step)."""
        self._unseen_L = [-1] * L
        self._routers: list[Any] = []
        for j, (layer_id, moe) in enumerate(find_moe_layers(runner.model)):
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
            router.set_capture_fn(self._make_fn(j))
            self._routers.append(router)

    def _make_fn(self, j: int):
        buf_TLK, cap, seen, base, held = self.routes_TLK, self.capacity, self.rows_seen_L, self._base, self._held_L
        spent, clock, hold = self._copy_s, time.perf_counter, self.hold

        def capture(topk_ids_TK: torch.Tensor) -> None:
            t0 = clock()
            n = topk_ids_TK.shape[0]
            if hold:
                held[j] = topk_ids_TK
            else:
                b = base[0]
                m = n if b + n <= cap else cap - b  # padded dummy steps may exceed; check_step reports real ones
                buf_TLK[b : b + m, j].copy_(topk_ids_TK[:m])
            seen[j] = n
            spent[0] += clock() - t0

        return capture

    def land(self, num_tokens: int) -> None:
        """File this step's rows (called once `check_step` passed): rows [offset, offset + num_tokens)."""
        if self.hold:
            self._landed.append((num_tokens, self._held_L[:]))  # one list copy; trimmed at chunk()

    def chunk(self, stop: int) -> np.ndarray:
        """Rows [0, stop) of every landed step as one narrow array [stop, L, K]; starts a new window."""
        if not self.hold:  # one device-to-host copy per flush
            return self.routes_TLK[:stop].cpu().numpy().copy()
        landed, self._landed = self._landed, []
        L, K = self.geometry.num_moe_layers, self.geometry.top_k
        if not landed:
            return torch.empty((0, L, K), dtype=self.dtype).numpy()
        if any(held[0].shape[0] != n for n, held in landed):  # a padded forward routed extra rows
            landed = [(n, [h[:n] for h in held]) for n, held in landed]
        per_layer = [torch.cat([held[j] for _, held in landed]) for j in range(L)]
        out = torch.stack(per_layer, dim=1).to(self.dtype).numpy()
        if len(out) != stop:
            raise CaptureHookError(f"route window holds {len(out)} rows, expected {stop}")
        return out

    @property
    def copy_s(self) -> float:
        """Seconds spent inside the forward by the capture functions (all layers, all steps)."""
        return self._copy_s[0]

    def reset_step(self, offset: int) -> None:
        """Start a step whose rows go to arena rows [offset, offset + tokens)."""
        self.offset = self._base[0] = offset
        # In place (the capture closures hold these lists). Held ids of a forward that never landed
        # (a dummy run) need no clearing: every layer of the next forward replaces its entry, and
        # check_step refuses a step where some layer did not.
        self.rows_seen_L[:] = self._unseen_L

    def room_for_step(self, offset: int) -> bool:
        return offset + self.step_rows <= self.capacity

    def check_step(self, num_tokens: int) -> str | None:
        """None when every layer wrote exactly num_tokens rows this step, else what went wrong."""
        if min(self.rows_seen_L) < num_tokens:
            bad = [(self.geometry.moe_layer_ids[j], n) for j, n in enumerate(self.rows_seen_L) if n < num_tokens]
            return f"layers (id, rows) {bad} routed fewer than the {num_tokens} scheduled tokens"
        if self.offset + num_tokens > self.capacity:
            return f"step of {num_tokens} tokens at row {self.offset} exceeds the route arena ({self.capacity} rows)"
        return None

    def uninstall(self) -> None:
        for router in self._routers:
            router.set_capture_fn(None)
        self._routers.clear()
