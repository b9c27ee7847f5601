"""The engine-noise model on a vLLM engine (opt-in, seeded, undoable): an instrument calibrated to GPU
figures (moe_replay/noise.py, docs/noise.md), never a GPU result.

    from moe_replay.noise import EngineNoise
    from moe_replay.integrations.vllm.noise import VllmEngineNoise
    with VllmCapture(llm, cfg) as cap, VllmEngineNoise(llm, EngineNoise(seed=0), captures=[cap]):
        outputs, traces = cap.generate(prompts, params)   # trace.engine.noise names the setting

Worker side (`noise.*` ops on runner.OPS): `WorkerNoise` wraps the model instance's `compute_logits`
(patch.patch_compute_logits: the step's request count picks the numerics variant) and, when the
setting flips routes, every MoE router's `_compute_routing` (patch.patch_routers: the router logits
of the selected token-layer rows get their k-th and (k+1)-th experts swapped). The router wrapper
is a Python call inside the forward, so route flips need an eager engine (a compiled forward never
calls it: refused); the logits wrapper runs outside the graph on any engine. Scoring forces routes
through the same router attribute, so scoring and route flips do not share an engine (refused at
whichever installs second).

Client side (`VllmEngineNoise`): installs on every worker and stamps `EngineInfo.noise` on the
captures it is given, so their traces say they were perturbed; installing on an engine that holds
a capture it was not given is refused (that capture would record perturbed traces as clean).
`uninstall()` (or leaving the `with`) restores the clean engine and the captures' engine info.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ...noise import EngineNoise, NoiseState
from .errors import EngineNoiseError
from .link import SyncLink
from .model import find_moe_layers, forward_is_traced
from .patch import InstancePatches, patch_compute_logits, patch_routers
from .runner import OPS, RunnerState

_LINK = {"what": "engine noise", "default": EngineNoiseError, "kwargs_fn": "capture_engine_kwargs"}


class WorkerNoise:
    """The engine-noise model installed on one model runner."""

    def __init__(self, runner: Any, config: EngineNoise) -> None:
        self.runner, self.config = runner, config
        self.state = NoiseState(config)
        self._patches: list[InstancePatches] = []
        model = runner.model
        try:
            self._patches.append(patch_compute_logits(model, self._make_logits))
            if config.flip_fraction > 0.0:
                if forward_is_traced(runner.vllm_config):
                    raise EngineNoiseError(
                        f"route flips (flip fraction {config.flip_fraction}) need an eager engine "
                        "(enforce_eager=True): a compiled forward never calls the router wrapper; "
                        "set route_flip_fraction=0 for logit variants only")
                layers = find_moe_layers(model)
                self.layer_ids = [lid for lid, _ in layers]
                routers = [m.router for _, m in layers]
                self._patches.append(patch_routers(routers, lambda j, orig: self._make_router(j, routers[j], orig)))
        except Exception:
            self.uninstall()
            raise

    def _make_logits(self, orig):
        from .runners import port_of

        state, port = self.state, port_of(self.runner)

        def compute_logits(hidden_states, *args, **kwargs):
            logits = orig(hidden_states, *args, **kwargs)
            if logits is None:  # non-last pipeline ranks
                return logits
            return state.perturb_logits(logits, hidden_states, port.num_reqs())

        return compute_logits

    def _make_router(self, j: int, router: Any, orig):
        state, lid = self.state, self.layer_ids[j]
        if self.config.flip_weights == "rule":  # the flipped ids, weighed by the router's rule from its own logits
            from .scoring.router_rules import forced_gate_weights, router_gate

            gate = router_gate(router, lid)

            def _compute_routing(hidden_states, router_logits, indices_type, *args, **kwargs):
                flipped = state.flip_router_logits(lid, router_logits, hidden_states, int(router.top_k))
                w_TK, ids_TK = orig(hidden_states, flipped, indices_type, *args, **kwargs)
                if flipped is router_logits:  # nothing flipped in this call
                    return w_TK, ids_TK
                return forced_gate_weights(gate, router_logits, ids_TK).contiguous(), ids_TK

            return _compute_routing

        def _compute_routing(hidden_states, router_logits, indices_type, *args, **kwargs):
            flipped = state.flip_router_logits(lid, router_logits, hidden_states, int(router.top_k))
            return orig(hidden_states, flipped, indices_type, *args, **kwargs)

        return _compute_routing

    def stats(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), **self.state.stats()}

    def uninstall(self) -> None:
        while self._patches:
            self._patches.pop().undo()


def _install(runner: Any, st: RunnerState, payload: Any) -> dict[str, Any]:
    if st.noise is not None:
        raise EngineNoiseError(f"engine noise is already installed on this engine ({st.noise.config}); uninstall it first")
    st.noise = WorkerNoise(runner, EngineNoise.from_dict(payload))
    return {"capture_installed": st.capture is not None}


def _uninstall(runner: Any, st: RunnerState, payload: Any) -> bool:
    if st.noise is None:
        return False
    st.noise.uninstall()
    st.noise = None
    return True


def _stats(runner: Any, st: RunnerState, payload: Any) -> dict[str, Any]:
    if st.noise is None:
        raise EngineNoiseError("engine noise is not installed on this engine")
    return st.noise.stats()


OPS.add("noise.install", _install)
OPS.add("noise.uninstall", _uninstall)
OPS.add("noise.stats", _stats)


class VllmEngineNoise:
    """The engine-noise model on one `vllm.LLM` (see the module docstring); a context manager."""

    def __init__(self, llm: Any, config: EngineNoise, *, captures: Sequence[Any] = ()) -> None:
        if not isinstance(config, EngineNoise):
            raise TypeError(f"config must be an EngineNoise, got {type(config).__name__}")
        self.llm, self.config = llm, config
        self._link, replies = SyncLink.open(llm, "noise.install", config.to_dict(), **_LINK)
        if any(r.get("capture_installed") for r in replies) and not captures:
            self._link.call("noise.uninstall")
            raise EngineNoiseError(
                "this engine holds a capture, and engine noise was given no `captures=[...]` to stamp: its "
                "traces would say they came from a clean engine; pass the capture (its traces then carry "
                "EngineInfo.noise)")
        self._stamped: list[tuple[Any, Any]] = []
        for cap in captures:
            self._stamped.append((cap, cap.engine_info))
            cap.engine_info = dataclasses.replace(cap.engine_info, noise=config)

    def stats(self) -> dict[str, Any]:
        """Steps, rows perturbed, route rows flipped and steps per variant since install (first worker)."""
        return self._link.call("noise.stats")

    def uninstall(self) -> None:
        if self._link is None:
            return
        self._link.call("noise.uninstall")
        self._link = None
        while self._stamped:
            cap, info = self._stamped.pop()
            cap.engine_info = info

    def __enter__(self) -> "VllmEngineNoise":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()
