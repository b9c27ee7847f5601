"""A pipeline stage's routes, read alone: each stage (and each virtual-pipeline chunk set) reads
from the store only the MoE layers it computes.

Under pipeline parallelism a stage's routers are a contiguous run of decoder layers; the routes
of every other layer are no use to it. verl #6211 broadcast a whole step's routes (45 GB) to every
rank of a PP group and timed out. Here a stage reads its own: `stage_traces(store, keys, model)`
gives each trace with the routes of the stage's layers only (`RolloutTrace.route_layer_ids`), and
of each shared route chunk the store reads just those layers' bytes (store/chunks.py: ~half the
route bytes at PP = 2, benchmarks/store.py `pp2_bytes_per_rank_share`). Build the stage's plans
with `build_plan(..., layers=stage_layers(model))` and replay with `partial=True`:

    layers = stage_layers(model)
    plans = [build_plan(stage_traces(store, keys, model), geometry, layers=layers) for keys in micro_batches]
    with replay(model, plans, partial=True):
        ...

Importing this module does not import megatron; the first call does.
"""

from __future__ import annotations

from typing import Sequence

from moe_replay.trace import RolloutTrace

from .routers import ModelOrRouters, find_routers


def stage_layers(model_or_chunks: ModelOrRouters) -> tuple[int, ...]:
    """The global MoE layer ids this rank's model (or its virtual-pipeline chunks) routes."""
    return tuple(find_routers(model_or_chunks))


def stage_traces(store, keys: Sequence[str], model_or_chunks: ModelOrRouters) -> list[RolloutTrace]:
    """`store.get_many(keys, layers=...)` for the layers this rank computes (a TraceStore)."""
    layers = stage_layers(model_or_chunks)
    if not layers:  # reading no layer's routes is not supported yet: say so rather than read them all
        raise ValueError("this rank's model holds no MoE router, so it replays nothing: build its plans with "
                         "build_plan(..., routes=False) from traces read without layers=")
    return store.get_many(list(keys), layers=layers)
