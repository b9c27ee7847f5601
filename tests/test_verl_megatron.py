"""verl's Megatron actor (`actor.strategy=megatron`) and moe_replay, on a CPU machine.

verl 0.9.1's Megatron engine does not run here (it builds its model through mbridge / Transformer
Engine on a CUDA device); what runs: its R3 helpers on a real GPTModel fed the project's traces
(tests/test_megatron_native_ranks.py, in spawned processes because verl's router patch is
process-wide), and here the switch: with the plugin installed, verl's "megatron" engine entries are
verl's own class unless the model config names a moe_replay preset, which is refused by name before
anything is built (instead of training on free routes with the preset silently ignored).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def registry():
    from moe_replay.integrations.verl import use_cpu

    use_cpu()
    from verl.workers.engine import EngineRegistry

    from moe_replay.integrations.verl.registry import install

    install()
    return EngineRegistry._engines["language_model"]


def test_megatron_engine_refuses_a_preset_and_is_verls_own_without_one(registry):
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from moe_replay.integrations.verl import VerlOptionError
    from moe_replay.integrations.verl.registry import install, uninstall

    cls = registry["megatron"]["cuda"]
    assert cls is not MegatronEngineWithLMHead and issubclass(cls, MegatronEngineWithLMHead)
    config = types.SimpleNamespace(override_config={"moe_replay": "r3_support"})
    with pytest.raises(VerlOptionError, match=r"actor_rollout_ref.actor.strategy='megatron' is not supported \(expected fsdp2 "
                                              r"with \+actor_rollout_ref.model.override_config.moe_replay=r3_support\).*"
                                              r"router_replay.mode=R3"):
        cls(config, None, None, None)
    uninstall()
    try:
        assert registry["megatron"]["cuda"] is MegatronEngineWithLMHead
    finally:
        install()
    assert registry["megatron"]["cuda"] is not MegatronEngineWithLMHead


def test_routed_experts_are_verls_r3_layout_and_refuse_missing_rows(registry):
    """`routed_experts(traces)`: one [T_b - 1, L, K] int16 row block per sample (verl aligns it to T_b);
    a trace whose first routes were not stored (route_start > 0) is refused by name."""
    from moe_replay.integrations.verl.megatron import routed_experts
    from moe_replay.replay import BatchLayoutError

    from .trace_factory import TINY_GEOMETRY, random_trace

    rng = np.random.default_rng(0)
    traces = [random_trace(f"v{i}", rng, num_tokens=n, prompt_len=2) for i, n in enumerate((7, 5))]
    nested = routed_experts(traces)
    parts = nested.unbind()
    assert [tuple(p.shape) for p in parts] == [(6, TINY_GEOMETRY.num_moe_layers, 2), (4, TINY_GEOMETRY.num_moe_layers, 2)]
    assert all(p.dtype == torch.int16 for p in parts)
    assert all(np.array_equal(p.numpy(), t.routes_TLK) for p, t in zip(parts, traces))
    late = random_trace("late", rng, num_tokens=7, prompt_len=3, route_start=2)
    with pytest.raises(BatchLayoutError, match=r"record 'late'.*route_start.*expected 0, found 2"):
        routed_experts([late])
