"""Read a ModelGeometry from an HF config: which decoder layers route, over how many experts.

Keyed by the config's `model_type`, so it works for checkpoints the factory did not build. A
checkpoint directory is read as plain JSON: no transformers import needed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from ..geometry import ModelGeometry
from ..registry import Registry

_MISSING = object()


class ConfigView:
    """Uniform read access to a config given as dict, config.json contents or HF config object."""

    def __init__(self, cfg: Any) -> None:
        if isinstance(cfg, Mapping) and isinstance(cfg.get("text_config"), Mapping):
            cfg = cfg["text_config"]  # multimodal wrapper: the decoder is what routes
        elif not isinstance(cfg, Mapping) and getattr(cfg, "text_config", None) is not None:
            cfg = cfg.text_config
        self._cfg = cfg

    def get(self, *names: str, default: Any = _MISSING) -> Any:
        """First present, non-None value among `names`; KeyError naming all of them otherwise."""
        for name in names:
            value = self._cfg.get(name) if isinstance(self._cfg, Mapping) else getattr(self._cfg, name, None)
            if value is not None:
                return value
        if default is not _MISSING:
            return default
        raise KeyError(f"config (model_type {self.model_type!r}) has none of {names}")

    @property
    def model_type(self) -> str:
        if isinstance(self._cfg, Mapping):
            return str(self._cfg.get("model_type", ""))
        return str(getattr(self._cfg, "model_type", ""))


Layout = Callable[[ConfigView], tuple[list[int], int]]
"""config -> (MoE layer ids, routed experts per layer)."""

LAYOUTS: Registry[Layout] = Registry("MoE layout (HF model_type)")


def _every_layer(experts_key: tuple[str, ...]) -> Layout:
    def layout(c: ConfigView) -> tuple[list[int], int]:
        return list(range(c.get("num_hidden_layers"))), c.get(*experts_key)

    return layout


def _qwen_sparse_step(c: ConfigView) -> tuple[list[int], int]:
    """Qwen2/3-MoE rule: MoE unless listed in mlp_only_layers or off the decoder_sparse_step."""
    n, experts = c.get("num_hidden_layers"), c.get("num_experts", "num_local_experts")
    dense, step = set(c.get("mlp_only_layers", default=[])), c.get("decoder_sparse_step", default=1)
    return [i for i in range(n) if i not in dense and experts > 0 and (i + 1) % step == 0], experts


def _deepseek(c: ConfigView) -> tuple[list[int], int]:
    """First `first_k_dense_replace` layers dense; vLLM also honours moe_layer_freq, HF does not."""
    n, first_dense = c.get("num_hidden_layers"), c.get("first_k_dense_replace", default=0)
    freq = c.get("moe_layer_freq", default=1)
    if freq != 1:
        raise ValueError(f"deepseek moe_layer_freq ({freq}) != 1: HF and vLLM would route different layers")
    return [i for i in range(first_dense, n)], c.get("n_routed_experts")


for _t in ("qwen2_moe", "qwen3_moe"):
    LAYOUTS.add(_t, _qwen_sparse_step)
for _t in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
    LAYOUTS.add(_t, _deepseek)
LAYOUTS.add("mixtral", _every_layer(("num_local_experts", "num_experts")))
LAYOUTS.add("olmoe", _every_layer(("num_experts", "num_local_experts")))
LAYOUTS.add("gpt_oss", _every_layer(("num_local_experts", "num_experts")))


def read_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {str(model_dir)!r}: not an HF checkpoint directory")
    return json.loads(path.read_text())


def geometry_of(model: str | os.PathLike | Mapping[str, Any] | Any) -> ModelGeometry:
    """Geometry of a checkpoint dir, a config dict or an HF config object.

    `family` is the HF model_type (the architecture that decides gate-weight rules), so a
    `qwen3_moe_sparse` build reports `qwen3_moe`.
    """
    cfg = ConfigView(read_config(model) if isinstance(model, (str, os.PathLike)) else model)
    layer_ids, num_experts = LAYOUTS.get(cfg.model_type)(cfg)
    return ModelGeometry(
        num_layers=cfg.get("num_hidden_layers"),
        moe_layer_ids=tuple(layer_ids),
        num_experts=num_experts,
        top_k=cfg.get("num_experts_per_tok", "experts_per_token"),
        vocab_size=cfg.get("vocab_size"),
        family=cfg.model_type,
    )
