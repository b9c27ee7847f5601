"""Which experts each MoE layer of an HF model actually ran: the route-flip probe of the demo's
trainer and of the remedy lab (moe_replay/lab/arms.py), in a module of its own so neither imports the other.

Why the experts module's input and not the router's output: replay rewrites the router's output;
the ids the experts receive are the ground truth of which experts ran.

Legend: T tokens of the forward (flat), K top-k.
"""

from __future__ import annotations

from typing import Sequence

import torch


class ExpertsUsed:
    """Records, per MoE layer id, the expert ids [T, K] its experts module receives in each forward
    (a forward pre-hook on `model.model.layers[lid].mlp.experts`); `close()` removes the hooks."""

    def __init__(self, model: torch.nn.Module, layer_ids: Sequence[int]) -> None:
        self.ids: dict[int, torch.Tensor] = {}
        self._handles = []
        for lid in layer_ids:
            experts = model.model.layers[lid].mlp.experts

            def pre_hook(module, args, lid=lid):
                self.ids[lid] = args[1].detach().reshape(-1, args[1].shape[-1]).clone()

            self._handles.append(experts.register_forward_pre_hook(pre_hook))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
