"""The one seam between moe_replay's worker side and a vLLM model runner: `RunnerPort`.

vLLM runs one of two model runners (model.runner_path): the V1 runner (`GPUModelRunner` of
`vllm/v1/worker/gpu_model_runner.py`, vLLM-CPU's `CPUModelRunner` on it) and Model Runner V2
(`vllm/v1/worker/gpu/model_runner.py`, the GPU default since vLLM #53183 and the only runner from
0.34). The MoE layers, their routers and `compute_logits` are the same objects under both, so route
capture (capture/route_hook.py), forcing (scoring/force_step.py) and scoring's logits are shared.
What differs is small, and it is all here, behind one interface with one implementation per
runner (v1.py, mrv2.py):

  layout        which request owns which rows of a step, at which positions, and which rows'
                samples the runner throws away (`views`, a step.StepLayout per step);
  forward point the moment between input preparation and the forward, outside any compiled
                graph (`wrap_forward`: scoring fills its forcing buffers there);
  sampler       the kept set, where the sampler truncates, and each row's sampled token and
                temperature (`wrap_sampler`: capture's one hook a step);
  requests      a new request's prompt length, first routed position and KV block ids
                (`request`, `block_ids`), and the block tables keying the slot route cache;
  step values   the forwarded token ids and hidden states of the step just run (scoring).

Everything else (step bracket, records, flushes, row log, slot route cache, forcing, scoring) is
written once against this interface. A port is made once per runner (`port_of`) and kept in the
runner's RunnerState.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from ..errors import CaptureHookError
from ..step import StepLayout


class RunnerPort:
    """What one model runner gives the worker side (see the module docstring); one per runner."""

    path: str = ""
    """"v1" or "mrv2" (model.runner_path)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    current: StepLayout | None = None
    """The current step's layout once a listener took it; the step bracket sets it to None before
    each engine step (an attribute store: a method call there was one more frame a step)."""

    def bind(self, patches: Any) -> None:
        """At step bracket install: wrap what the port reads every step (undone with `patches`)."""

    # -- the step's rows ---------------------------------------------------------------------------
    def layout(self, n: int) -> StepLayout:
        """The current step's layout for its n scheduled tokens (taken once, then shared)."""
        raise NotImplementedError

    def layout_slots(self, n: int, kv_group: int) -> "tuple[StepLayout, Any]":
        """`layout(n)` and the KV slot of each forwarded token in `kv_group` (a step.RingRows or an array)."""
        raise NotImplementedError

    def free_items(self) -> int:
        """Items the host rings take before they start over (a listener keeping layouts flushes first)."""
        raise NotImplementedError

    def rewind(self) -> None:
        """The layouts taken so far have been read: host rings may start over."""
        raise NotImplementedError

    # -- hook points -------------------------------------------------------------------------------
    def wrap_forward(self, patches: Any, before_forward: Callable[[], None]) -> bool:
        """Wrap the runner so `before_forward()` runs once per real engine step, after its inputs
        are prepared and before the model runs (outside any compiled graph). Returns False where
        the runner has no such point (then forced rows fail as never filled)."""
        raise NotImplementedError

    def wrap_sampler(self, patches: Any, capture: Any) -> None:
        """Wrap the sampler so the truncated logits of each step reach `capture.support.stage` (where
        the sampler truncates, and so that it samples from exactly them) and, after the step's
        tokens are drawn, `capture.after_sample(sampled_B1, temps)` runs (temps: a scalar for every
        row or one per row; below vLLM's epsilon a row is greedy)."""
        raise NotImplementedError

    def check_capture(self, speculative: bool) -> None:
        """Refuse (CaptureHookError, by name) a runner that lacks what capture's hooks read."""
        raise NotImplementedError

    # -- requests and KV blocks --------------------------------------------------------------------
    @property
    def max_num_reqs(self) -> int:
        raise NotImplementedError

    def num_block_tables(self) -> int:
        """Block tables the runner keeps (one per KV-cache group)."""
        raise NotImplementedError

    def block_size(self, kv_group: int) -> int:
        """Tokens per block of `kv_group`'s block table (the kernel block size)."""
        raise NotImplementedError

    def enable_slots(self, patches: Any, kv_group: int) -> None:
        """Prepare `layout_slots` for `kv_group` (a runner whose block table lives on the device keeps
        a host mirror of it from here on)."""

    def request(self, rid: str, scheduler_output: Any) -> tuple[int, int]:
        """(prompt length, first routed position: SamplingParams.routed_experts_prompt_start) of a
        request in the current step."""
        raise NotImplementedError

    def block_ids(self, rid: str, row: int, kv_group: int, scheduler_output: Any) -> np.ndarray:
        """The KV block ids of the request at row `row` of the current step, in `kv_group`."""
        raise NotImplementedError

    # -- values of the step just run (after its forward) -------------------------------------------
    def step_token_ids(self, n: int) -> np.ndarray:
        """The n token ids the step forwarded, in row order."""
        raise NotImplementedError

    def hidden_states(self) -> torch.Tensor | None:
        """The step's final hidden states [tokens, hidden] (None where the runner kept none)."""
        state = getattr(self.runner, "execute_model_state", None)
        h = getattr(state, "hidden_states", None)
        return h if isinstance(h, torch.Tensor) else None

    def num_reqs(self) -> int:
        """Requests in the running step."""
        raise NotImplementedError


def require(runner: Any, names: tuple[str, ...], what: str) -> None:
    """Refuse a runner lacking attributes capture reads, naming them."""
    missing = [a for a in names if not hasattr(runner, a)]
    if missing:
        raise CaptureHookError(f"model runner {type(runner).__name__} lacks {missing}, which {what} reads "
                               "(vLLM version mismatch? surface/table.json lists the accepted releases)")
