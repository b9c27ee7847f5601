"""Route forcing as tensor work inside the forward: buffers at fixed addresses, one `where` per router.

Every MoE router's `_compute_routing` is wrapped by `forced_routing`, which reads three buffers
allocated once per model (ForceStep), so torch.compile traces it into the graph and a CUDA graph
replays it with the step's values:

  ids_TLK  [rows, L, K] int32  forced expert ids of each row of the running forward;
  mask_T   [rows]       bool   True where a row is forced (registered request, position to force);
  ack_TL   [rows, L]    bool   what each layer forced, written by the forward itself.

Per call: ids = where(mask, ids_TLK[:, j], own ids); weights = where(mask, rule(logits, ids), own
weights), the rule being the router's own (router_rules.RouterGate: invariant 4, ids are replayed,
weights never); then ack[:, j] = mask. No Python branch on a tensor value, no data-dependent shape:
unforced rows (free requests, padding) keep the engine's routing exactly.

Host side (force.py, through the step bracket's before_forward, outside any graph) fills the rows
of registered requests before each forward and clears them after. After the forward, a forced row
that some layer did not acknowledge (a router that never ran the forcing step: a graph traced
before it was bound, a monolithic kernel) fails its request; it is never scored as if forced.

Row t of a router call is row t of the engine step (vLLM 0.26-0.32 route the whole step in one
call per layer; padding rows come after the scheduled ones and stay free). Data parallelism, whose
routers see rows gathered from other ranks, is refused (force.py).

Two ways to bind, one per kind of forward (as capture/route_hook.py does for capture):

  load time  (compiled / graph forwards) `bind_force_at_load` wraps the routers when the model is
             loaded (patch.py's load hook, engines built with scoring_engine_kwargs), before
             torch.compile traces the forward; the wrapper always runs the `where` above.
  install    (eager forwards) WorkerScoring wraps the routers itself; the wrapper skips the
             forcing math in steps that force no row (`active`, a Python flag: eager only) and
             otherwise runs the same function, so eager and compiled engines force identically.

Legend: T rows of one forward, L MoE layers, K top-k, E experts, R forced rows.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from ....replay import gates
from ..errors import ForceRouteError
from ..model import find_moe_layers
from ..patch import FORCE_FLAG, LOAD_STEPS, LoadStep, patch_routers
from . import router_rules
from .router_rules import RouterGate, forced_gate_weights, router_gate

FORCE_STEP_ATTR = "_moe_replay_force_step"
"""Attribute of the loaded model that holds its load-time ForceStep."""


def forced_routing(step: "ForceStep", j: int, gate: RouterGate, orig: Callable) -> Callable:
    """The traceable replacement of router j's `_compute_routing` (same signature and outputs).

    A forward with more rows than the buffers fails here, loudly (shape mismatch)."""
    ids_TLK, mask_T, ack_TL = step.ids_TLK, step.mask_T, step.ack_TL

    def compute_routing(hidden_states, router_logits, indices_type, *, input_ids=None):
        w_TK, own_TK = orig(hidden_states, router_logits, indices_type, input_ids=input_ids)
        T = own_TK.shape[0]
        m_T = mask_T[:T]
        m_T1 = m_T.unsqueeze(1)
        ids_TK = torch.where(m_T1, ids_TLK[:T, j].to(own_TK.dtype), own_TK)
        w2_TK = torch.where(m_T1, forced_gate_weights(gate, router_logits, ids_TK), w_TK)
        ack_TL[:T, j].copy_(m_T)
        return w2_TK.contiguous(), ids_TK

    return compute_routing


def eager_routing(step: "ForceStep", j: int, gate: RouterGate, orig: Callable) -> Callable:
    """Eager-only variant: the engine's own routing in steps that force nothing, else `forced_routing`."""
    forced = forced_routing(step, j, gate, orig)

    def compute_routing(hidden_states, router_logits, indices_type, *, input_ids=None):
        if not step.active:
            return orig(hidden_states, router_logits, indices_type, input_ids=input_ids)
        return forced(hidden_states, router_logits, indices_type, input_ids=input_ids)

    return compute_routing


class ForceStep:
    """The forcing buffers of one model and the gate rule of each of its routers.

    `refusal` says why this model's routes cannot be forced (a router kind without a gate rule);
    then nothing is allocated or bound, and free scoring still works.
    """

    def __init__(self, layers: list[tuple[int, Any]], rows: int, device: torch.device) -> None:
        self.layer_ids = tuple(i for i, _ in layers)
        self.routers = [m.router for _, m in layers]
        self.rows = int(rows)
        self.gates: list[RouterGate] = []
        self.refusal: str | None = None
        for lid, moe in layers:
            try:
                self.gates.append(router_gate(moe.router, lid))
            except ForceRouteError as e:
                self.refusal = str(e)
                self.gates = []
                break
        self.active = False
        """Rows are forced in the running step (host flag; read only by eager wrappers)."""
        self._dirty = 0
        """Rows [0, _dirty) may hold a set mask from the last fill."""
        self._patches = None
        if self.refusal is not None:
            return
        L, K = len(layers), max(int(r.top_k) for r in self.routers)
        self.ids_TLK = torch.zeros((self.rows, L, K), dtype=torch.int32, device=device)
        self.mask_T = torch.zeros(self.rows, dtype=torch.bool, device=device)
        self.ack_TL = torch.zeros((self.rows, L), dtype=torch.bool, device=device)
        host = self.mask_T.device.type == "cpu"
        # host views: a numpy fill is ~1 us, a torch indexing op ~10 us inside a busy CPU engine
        self._np = (self.ids_TLK.numpy(), self.mask_T.numpy(), self.ack_TL.numpy()) if host else None

    @property
    def bound(self) -> bool:
        return self._patches is not None

    def bind(self, make: Callable[["ForceStep", int, RouterGate, Callable], Callable]) -> None:
        """Wrap every router's `_compute_routing` with make(step, j, gate, orig) (patch.py)."""
        if self.refusal is not None:
            raise ForceRouteError(self.refusal)
        self._patches = patch_routers(self.routers, lambda j, orig: make(self, j, self.gates[j], orig))

    def unbind(self) -> None:
        if self._patches is not None:
            self._patches.undo()
            self._patches = None

    def fill(self, rows_R: np.ndarray, ids_RLK: np.ndarray) -> None:
        """Before a forward (outside the graph): force `rows_R` to `ids_RLK`; every other row free."""
        self.clear()
        if not len(rows_R):
            return
        hi = int(rows_R.max()) + 1
        if hi > self.rows:
            raise ForceRouteError(f"forced row {hi - 1} lies past the forcing buffer ({self.rows} rows)")
        if self._np is not None:
            ids_np, mask_np, ack_np = self._np
            ids_np[rows_R] = ids_RLK
            mask_np[rows_R] = True
            ack_np[rows_R] = False
        else:  # device buffers: host -> device copies ordered before the forward on its stream
            dev = self.mask_T.device
            r = torch.from_numpy(rows_R).to(dev, non_blocking=True)
            self.ids_TLK[r] = torch.from_numpy(np.ascontiguousarray(ids_RLK, dtype=np.int32)).to(dev, non_blocking=True)
            self.mask_T[r] = True
            self.ack_TL[r] = False
        self._dirty, self.active = hi, True

    def clear(self) -> None:
        """Every row free again (after a forward, and before the next fill)."""
        if self._dirty:
            if self._np is not None:
                self._np[1][: self._dirty] = False
            else:
                self.mask_T[: self._dirty].fill_(False)
        self._dirty, self.active = 0, False

    def unforced(self, rows_R: np.ndarray) -> list[int]:
        """Layer ids whose router did not force some of `rows_R` in the last forward (after it)."""
        if self._np is not None:
            ack_RL = self._np[2][rows_R]
        else:
            ack_RL = self.ack_TL[torch.from_numpy(rows_R).to(self.ack_TL.device)].cpu().numpy()
        missed_L = ~ack_RL.all(axis=0)
        return [self.layer_ids[j] for j in np.flatnonzero(missed_L)]


def bind_force_at_load(model: torch.nn.Module, vllm_config: Any) -> ForceStep | None:
    """Give a freshly loaded model its ForceStep, bound before its first (compiling) forward.

    Registered as FORCE_FLAG's load step: patch.py's load hook runs it for engines whose
    additional_config carries FORCE_FLAG; no-op for models without MoE layers. A router kind
    without a gate rule leaves an unbound ForceStep whose `refusal` scoring reports when routes are
    asked to be forced."""
    layers = find_moe_layers(model)
    if not layers:
        return None
    rows = max(int(vllm_config.scheduler_config.max_num_batched_tokens),
               int(getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", 0) or 0))
    step = ForceStep(layers, rows, next(model.parameters()).device)
    if step.refusal is None:
        step.bind(forced_routing)
    model.__dict__[FORCE_STEP_ATTR] = step  # a plain attribute: not a submodule, not a buffer
    return step


LOAD_STEPS.add(FORCE_FLAG, LoadStep(bind_force_at_load, (__file__, router_rules.__file__, gates.__file__)))
