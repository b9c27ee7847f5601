"""The model's own routing of the audited tokens: what a trainer's adapter hands the audit.

A trainer binding's `free_routes(model, token_ids, context)` (integrations/hf/audit.py,
integrations/megatron/audit.py) runs one forward without gradients and with free routing over the
samples' tokens, laid out by `token_batch` (the plan's own right-padded batch), and returns a
`FreeRoutes`: per sample the model's top-k at every position, every MoE layer.

Legend: S tokens of a sample, L MoE layers, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..geometry import ModelGeometry


@dataclass(frozen=True)
class FreeRoutes:
    """The model's own top-k ids per sample, position and MoE layer (`geometry.moe_layer_ids` order)."""

    geometry: ModelGeometry
    ids_SLK: tuple[np.ndarray, ...]
    """Per sample, int [S, L, K]: row s is the route the model chose for position s."""
    forward_s: float = 0.0
    """Seconds the forward took (what the audit costs besides its comparison)."""

    def __post_init__(self) -> None:
        for b, ids in enumerate(self.ids_SLK):
            if ids.ndim != 3 or ids.shape[1:] != (self.geometry.num_moe_layers, self.geometry.top_k):
                raise ValueError(f"FreeRoutes.ids_SLK[{b}]: expected [S, {self.geometry.num_moe_layers}, "
                                 f"{self.geometry.top_k}], found {list(ids.shape)}")


def token_batch(token_ids: Sequence[np.ndarray], geometry: ModelGeometry):
    """A RoutePlan laying out `token_ids` as the trainer's replay lays out a batch (right padding, positions
    counted over real tokens), with no routes and nothing to score: its `model_inputs()` (HF) or
    `megatron_inputs(plan)` feed the audit's forward. A sample is one whole prompt here."""
    from ..replay.plan import build_plan
    from ..trace import RolloutTrace

    traces = [RolloutTrace(f"audit-{b}", np.asarray(t, dtype=np.int64), len(t), geometry) for b, t in enumerate(token_ids)]
    return build_plan(traces, geometry, routes=False)


def split_rows(ids_LBSK: np.ndarray, lengths: Sequence[int]) -> tuple[np.ndarray, ...]:
    """Per sample [S_b, L, K] from a right-padded batch's [L, B, S, K] ids."""
    return tuple(np.ascontiguousarray(ids_LBSK[:, b, :n].transpose(1, 0, 2)) for b, n in enumerate(lengths))
