"""verl adapter: moe_replay in verl's FSDP/HF actor engine, switched on from verl's config.

The user's verl config changes by these lines (Hydra overrides of `verl.trainer.main_ppo`):

    actor_rollout_ref.model.external_lib=moe_replay.integrations.verl.plugin   # registers the engine
    +actor_rollout_ref.model.override_config.moe_replay=r3_support             # the preset
    actor_rollout_ref.actor.strategy=fsdp2

and the rollouts reach the actor with one moe_replay trace per sample in
`non_tensor_batch["moe_replay_traces"]` (batch.py; the route chunks a prompt's samples share in
`non_tensor_batch["moe_replay_route_chunks"]`, once per message), recorded by verl's own vLLM rollout server
(rollout.py: the plugin registers it under verl's "vllm" replica) and packed by verl's agent loop. verl imports `external_lib` in every process
that builds a model config (its plugin hook); `plugin` registers `MoeReplayFSDPEngine` for verl's
FSDP backends. Without `override_config.moe_replay` that engine is verl's own, unchanged. Both
of verl's layouts work (`use_remove_padding` on or off: routes follow verl's sequence offsets);
Ulysses sequence parallelism, `pad_to_length` and fused kernels are refused by name (options.py).

Importing this package does not import verl; verl is imported when the engine or a helper is used.
"""

from __future__ import annotations

__all__ = ["CHUNKS_KEY", "MoeReplayFSDPEngine", "MissingTraceError", "TRACES_KEY", "VerlOptionError", "encode_traces", "install",
           "share_chunks", "stitch_turns", "to_dataproto", "trace_columns", "traces_of", "use_cpu"]

_LAZY = {"CHUNKS_KEY": "batch", "MoeReplayFSDPEngine": "engine", "MissingTraceError": "batch", "TRACES_KEY": "batch",
         "VerlOptionError": "options", "encode_traces": "batch", "install": "registry", "share_chunks": "batch",
         "stitch_turns": "batch", "to_dataproto": "batch", "trace_columns": "batch", "traces_of": "batch", "use_cpu": "cpu"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
