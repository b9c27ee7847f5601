"""Which checkpoints SGLang 0.5.23 serves as their config says, and the geometry capture reads from it.

Refused by name before any rollout: a config SGLang's model code ignores part of, so its routes and
tokens are another model's. qwen2_moe / qwen3_moe in SGLang 0.5.23 build every decoder layer sparse
(`is_layer_sparse = True` in models/qwen2_moe.py and qwen3_moe.py): `mlp_only_layers` and
`decoder_sparse_step` are not read, so a checkpoint with dense layers loads uninitialised experts in
them and samples NaN (measured: ../shared/notes/sglang-cpu.md).
"""

from __future__ import annotations

from typing import Any

from ...geometry import ModelGeometry
from ...models.layout import ConfigView, geometry_of
from .errors import SglangServedError

SPARSE_EVERY_LAYER = ("qwen2_moe", "qwen3_moe")
"""Families whose SGLang 0.5.23 model makes every decoder layer an MoE layer, whatever the config says."""


def check_served(config: Any, where: str = "the model") -> None:
    """SglangServedError naming the family and the config keys SGLang ignores, if it would mis-serve them."""
    c = ConfigView(config)
    if c.model_type not in SPARSE_EVERY_LAYER:
        return
    dense = list(c.get("mlp_only_layers", default=[]) or [])
    step = c.get("decoder_sparse_step", default=1)
    if dense or step != 1:
        raise SglangServedError(
            f"{where}: SGLang 0.5.23 mis-serves this {c.model_type} checkpoint: its {c.model_type} model makes "
            f"every decoder layer an MoE layer and ignores mlp_only_layers={dense} and decoder_sparse_step={step}, "
            "so the dense layers load uninitialised experts (NaN samples). Refused before any rollout; serve it "
            "with vLLM, or use a checkpoint whose every layer is MoE")


def served_geometry(config: Any, where: str = "the model") -> ModelGeometry:
    """The geometry of a config SGLang serves as written (check_served first)."""
    check_served(config, where)
    return geometry_of(config)
