"""Route capture through vLLM's official hook, `BaseRouter.set_capture_fn`.

Each MoE layer's router calls our function with its logical top-k ids [T, K] (before any EPLB
remap, in the column order the experts kernel consumes). The function only copies them into one
preallocated narrow arena routes_TLK[capacity, L, K], at the current step's offset: consecutive
steps fill consecutive rows, and mapping rows to requests happens in batches, when the worker
flushes the arena (see worker.py), never inside the forward.
"""

from __future__ import annotations

from typing import Any

import torch

from ...geometry import ModelGeometry
from .errors import CaptureHookError, NoMoeLayersError


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
    """Preallocated routes_TLK arena plus one capture function per MoE layer.

    The arena holds `capacity` rows: at least one full step (max_num_tokens), else as many as
    `budget_bytes` allows. `offset` is where the current step's rows go.
    """

    def __init__(self, runner: Any, geometry: ModelGeometry, budget_bytes: int = 0) -> None:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        self.geometry = geometry
        self.step_rows = int(runner.max_num_tokens)
        self.dtype = torch_route_dtype(geometry.num_experts)
        row_bytes = geometry.num_moe_layers * geometry.top_k * torch.empty(0, dtype=self.dtype).element_size()
        self.capacity = max(self.step_rows, budget_bytes // row_bytes)
        self.routes_TLK = torch.zeros((self.capacity, geometry.num_moe_layers, geometry.top_k), dtype=self.dtype)
        self.routes_np = self.routes_TLK.numpy()
        self.offset = 0
        """First arena row of the current step."""
        self._base = [0]  # what the capture closures read: the offset of the running forward
        self.rows_seen_L = [0] * geometry.num_moe_layers
        """Rows written by each layer in the current forward (reset per step)."""
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
        buf_TLK, buf_np, cap, seen, base = self.routes_TLK, self.routes_np, self.capacity, self.rows_seen_L, self._base

        def capture(topk_ids_TK: torch.Tensor) -> None:
            n = topk_ids_TK.shape[0]
            b = base[0]
            m = n if b + n <= cap else cap - b  # padded dummy steps may exceed; check_step reports real ones
            if topk_ids_TK.is_cpu:  # a numpy copy skips torch dispatch: ~3x cheaper at decode sizes
                buf_np[b : b + m, j] = topk_ids_TK.numpy()[:m]
            else:
                buf_TLK[b : b + m, j].copy_(topk_ids_TK[:m])
            seen[j] = n

        return capture

    def reset_step(self, offset: int) -> None:
        """Start a step whose rows go to arena rows [offset, offset + tokens)."""
        self.offset = self._base[0] = offset
        for j in range(len(self.rows_seen_L)):
            self.rows_seen_L[j] = -1

    def room_for_step(self, offset: int) -> bool:
        return offset + self.step_rows <= self.capacity

    def check_step(self, num_tokens: int) -> str | None:
        """None when every layer wrote exactly num_tokens rows this step, else what went wrong."""
        bad = [(self.geometry.moe_layer_ids[j], n) for j, n in enumerate(self.rows_seen_L) if n < num_tokens]
        if bad:
            return f"layers (id, rows) {bad} routed fewer than the {num_tokens} scheduled tokens"
        if self.offset + num_tokens > self.capacity:
            return f"step of {num_tokens} tokens at row {self.offset} exceeds the route arena ({self.capacity} rows)"
        return None

    def uninstall(self) -> None:
        for router in self._routers:
            router.set_capture_fn(None)
        self._routers.clear()
