"""Forced routes inside SGLang's scheduler process: the hook at its top-k selection that π_old scoring needs.

SGLang 0.5.23 has no input that forces experts. This module, loaded in the scheduler process (see
`install_on_import`), makes a request's MoE layers route the experts a trace recorded:

  * the request carries its routes in `sampling_params.custom_params` (ROUTES_KEY: base64 of the trace's
    narrow ids [T, L, K], with their start position, shape, dtype and MoE layer ids; JSON scalars, as
    SGLang's custom_params require); `Req.__init__` registers them by rid (`FORCED`, bounded);
  * `ModelRunner.forward` lays out, per forward, which rows of the batch are which request's positions
    (ForwardBatch: `rids`, `extend_seq_lens_cpu` for extend / mixed batches or one row a request in decode,
    `positions`): `Rows`, set for the duration of the forward;
  * `select_experts` names the layer it routes; the torch-native top-k (`fused_topk_native`, what SGLang runs
    on CPU) takes the forced ids on those rows and computes their weights exactly as it computes its own:
    the scores (softmax / sigmoid of the fp32 logits) gathered at the ids, renormalised the same way. Rows of
    other requests route freely.

Fail closed: a forced request's position without a recorded route (other than its last token, whose
logits no score reads: invariant 1), a layer that routes by another path (grouped top-k, a custom routing
function, a kernel other than the torch-native top-k) or a layer the hook cannot name raises in the
forward, so the request fails by name instead of scoring freely.

Legend: R rows of the forward batch, T recorded positions, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

import base64
import contextlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from .import_hook import patch_on_import, wrap_method

ROUTES_KEY = "moe_replay_routes"
"""custom_params key of a request's forced routes (a dict of JSON scalars: see `routes_param`)."""
MAX_HELD = 4096
"""Requests whose routes the scheduler holds at once (the oldest is dropped: a request scored after its
routes were dropped fails by name)."""


def routes_param(routes_TLK: np.ndarray, route_start: int, layer_ids: tuple[int, ...]) -> dict[str, Any]:
    """The custom_params value carrying a trace's routes to the scheduler."""
    arr = np.ascontiguousarray(routes_TLK)
    return {"ids": base64.b64encode(arr.tobytes()).decode("ascii"), "dtype": arr.dtype.str,
            "shape": ",".join(map(str, arr.shape)), "start": int(route_start), "layers": ",".join(map(str, layer_ids))}


@dataclass
class Forced:
    """One request's recorded routes, decoded in the scheduler."""

    routes_TLK: np.ndarray
    start: int
    layer_index: dict[int, int]
    """MoE layer id -> column of routes_TLK."""

    @classmethod
    def of(cls, param: dict[str, Any]) -> "Forced":
        shape = tuple(int(x) for x in str(param["shape"]).split(","))
        ids = np.frombuffer(base64.b64decode(param["ids"]), dtype=np.dtype(param["dtype"])).reshape(shape)
        layers = [int(x) for x in str(param["layers"]).split(",")]
        return cls(ids.astype(np.int64), int(param["start"]), {lid: j for j, lid in enumerate(layers)})


FORCED: "OrderedDict[str, Forced]" = OrderedDict()
_LOCK = threading.Lock()
_STATE = threading.local()


class ForceRouteError(RuntimeError):
    """A forced request cannot be routed as recorded (raised in SGLang's forward: the request fails)."""


@dataclass
class Rows:
    """Which rows of this forward are forced, per request: rows_R (batch rows) and, per MoE layer, their ids."""

    rows_R: Any
    ids_by_layer: dict[int, Any]
    """layer id -> int64 [R, K] (torch), the recorded ids of rows_R."""


def _register(req: Any) -> None:
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    if not isinstance(params, dict) or ROUTES_KEY not in params:
        return
    with _LOCK:
        FORCED[str(req.rid)] = Forced.of(params[ROUTES_KEY])
        while len(FORCED) > MAX_HELD:
            FORCED.popitem(last=False)


def _rows_of(forward_batch: Any) -> Rows | None:
    """The forced rows of a forward batch, or None when no request of it is forced."""
    import torch

    rids = list(getattr(forward_batch, "rids", None) or [])
    with _LOCK:
        held = {i: FORCED.get(str(r)) for i, r in enumerate(rids)}
    if not any(held.values()):
        return None
    lens = forward_batch.extend_seq_lens_cpu if forward_batch.forward_mode.is_extend() else None
    lens = list(lens) if lens is not None else [1] * len(rids)
    positions = forward_batch.positions.detach().cpu().numpy()
    rows, per_layer = [], {}
    offset = 0
    for i, n in enumerate(lens):
        f = held.get(i)
        if f is not None:
            pos = positions[offset: offset + n]
            t = pos - f.start
            last = f.start + len(f.routes_TLK)  # the request's last token: never recorded, its logits unread
            keep = pos != last
            if ((t[keep] < 0) | (t[keep] >= len(f.routes_TLK))).any():
                bad = int(pos[keep][(t[keep] < 0) | (t[keep] >= len(f.routes_TLK))][0])
                raise ForceRouteError(f"request {rids[i]!r}: position {bad} has no recorded route (recorded: "
                                      f"{f.start}..{last - 1}); refusing to route it freely")
            rows.append(np.arange(offset, offset + n)[keep])
            for lid, j in f.layer_index.items():
                per_layer.setdefault(lid, []).append(f.routes_TLK[t[keep], j, :])
        offset += n
    rows_R = torch.from_numpy(np.concatenate(rows))
    return Rows(rows_R, {lid: torch.from_numpy(np.concatenate(v)) for lid, v in per_layer.items()})


@contextlib.contextmanager
def _forward_rows(forward_batch: Any):
    _STATE.rows = _rows_of(forward_batch)
    try:
        yield
    finally:
        _STATE.rows = None


def _patch_model_runner(module: Any) -> None:
    def make(inner):
        def forward(self, forward_batch, *args, **kwargs):
            with _forward_rows(forward_batch):
                return inner(self, forward_batch, *args, **kwargs)

        return forward

    wrap_method(module.ModelRunner, "forward", make)


def _patch_req(module: Any) -> None:
    def make(inner):
        def __init__(self, *args, **kwargs):
            inner(self, *args, **kwargs)
            _register(self)

        return __init__

    wrap_method(module.Req, "__init__", make)


def _patch_topk(module: Any) -> None:
    if getattr(module.select_experts, "_moe_replay", False):
        return
    select, native = module.select_experts, module.fused_topk_native
    eps = getattr(module, "_RENORMALIZE_SUM_EPSILON", 0.0)

    def select_experts(hidden_states, router_logits, topk_config, *args, layer_id=None, **kwargs):
        rows = getattr(_STATE, "rows", None)
        if rows is not None and (topk_config.use_grouped_topk or topk_config.custom_routing_function is not None
                                 or not topk_config.torch_native):
            how = ("grouped top-k" if topk_config.use_grouped_topk else "a custom routing function"
                   if topk_config.custom_routing_function is not None else "a kernel")
            raise ForceRouteError(f"layer {layer_id}: SGLang routes it by {how}, not the torch-native top-k the force "
                                  "hook replaces; refusing to score it freely")
        _STATE.layer = layer_id
        try:
            return select(hidden_states, router_logits, topk_config, *args, layer_id=layer_id, **kwargs)
        finally:
            _STATE.layer = None

    def fused_topk_native(hidden_states, gating_output, topk, renormalize, correction_bias=None, scoring_func="softmax"):
        rows = getattr(_STATE, "rows", None)
        if rows is None:
            return native(hidden_states, gating_output, topk, renormalize, correction_bias, scoring_func)
        import torch

        layer = getattr(_STATE, "layer", None)
        if layer not in rows.ids_by_layer:
            raise ForceRouteError(f"a forced forward routes layer {layer!r}, which the recorded routes do not name "
                                  f"(they hold layers {sorted(rows.ids_by_layer)})")
        weights, ids = native(hidden_states, gating_output, topk, False, correction_bias, scoring_func)
        scores = {"softmax": lambda x: x.softmax(dim=-1), "sigmoid": lambda x: x.sigmoid()}[scoring_func](gating_output.float())
        ids = ids.clone()
        ids[rows.rows_R] = rows.ids_by_layer[layer].to(ids.dtype)
        weights = scores.gather(1, ids.long()).to(weights.dtype)
        if renormalize:  # as SGLang's torch-native top-k renormalises (fp32 sum, its epsilon)
            weights = weights / (weights.sum(dim=-1, keepdim=True, dtype=torch.float32) + eps)
        return weights, ids

    select_experts._moe_replay = True
    module.select_experts, module.fused_topk_native = select_experts, fused_topk_native


PATCHES = {
    "sglang.srt.layers.moe.topk": _patch_topk,
    "sglang.srt.model_executor.model_runner": _patch_model_runner,
    "sglang.srt.managers.schedule_batch": _patch_req,
}
"""Module -> the patch applied when it is first imported (or at once, if it already is)."""


def install_on_import() -> None:
    """Patch SGLang's modules as they are imported (and those already imported, now). Run it in every
    SGLang process, the scheduler included, before the model is built: from a sitecustomize on the
    processes' PYTHONPATH (scoring.SITE_DIR), which Python imports at start-up in each of them."""
    patch_on_import(PATCHES)
