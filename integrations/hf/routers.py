"""Which HF transformers router classes we can replay, and how each one weighs its experts.

Dispatcher: adapters are tried in registration order, first isinstance match wins. Family-specific
knowledge (attribute names, whether HF casts weights back to the logits dtype) lives only here.
All adapters work on HF's router modules, which return (router_logits [T, E], weights [T, K],
ids [T, K]) from hidden states [T, H].
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from moe_replay.registry import Registry
from moe_replay.replay.errors import UnsupportedRouterError
from moe_replay.replay.gates import GATE_RULES, GateSpec


@dataclass(frozen=True)
class RouterAdapter:
    """How to replay one HF router class."""

    family: str
    module: str
    """Python module that defines the router class (imported lazily)."""
    class_name: str
    rule: str
    """Gate-weight rule name in moe_replay.replay.GATE_RULES."""
    spec_kwargs: Callable[[nn.Module], dict[str, Any]] = lambda m: {}
    """Reads the router's numbers (renormalisation, scaling, groups) as GateSpec keyword arguments."""
    selection_bias: Callable[[nn.Module], torch.Tensor | None] = lambda m: None
    """A bias that takes part in choosing experts only (never in their weights)."""
    weights_in_logits_dtype: bool = True
    """HF casts the weights back to the logits dtype (Qwen, OLMoE, GPT-OSS) or keeps fp32."""

    def __post_init__(self) -> None:
        if not self.module or not self.class_name:
            raise ValueError(f"RouterAdapter {self.family!r} needs module and class_name, got {self.module!r}, {self.class_name!r}")
        GATE_RULES.get(self.rule)  # an unknown rule fails at registration, listing the known ones

    def router_class(self) -> type | None:
        """The class, or None when this transformers version lacks it."""
        try:
            return getattr(importlib.import_module(self.module), self.class_name, None)
        except ImportError:
            return None

    def spec(self, router: nn.Module) -> GateSpec:
        return GateSpec(self.rule, top_k=int(router.top_k), **self.spec_kwargs(router))

    def num_experts(self, router: nn.Module) -> int:
        return int(router.weight.shape[0])


ROUTER_ADAPTERS: Registry[RouterAdapter] = Registry("HF router family")
_DISPATCH_ORDER: list[RouterAdapter] = []


def register_router(adapter: RouterAdapter) -> RouterAdapter:
    """Add an adapter; it is tried after every adapter registered before it."""
    ROUTER_ADAPTERS.add(adapter.family, adapter)
    _DISPATCH_ORDER.append(adapter)
    return adapter


def _norm_topk(m: nn.Module) -> dict[str, Any]:
    return {"renormalize": bool(m.norm_topk_prob)}


_M = "transformers.models"
register_router(RouterAdapter("qwen3_moe", f"{_M}.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter", "softmax_topk", _norm_topk))
register_router(RouterAdapter("qwen2_moe", f"{_M}.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeTopKRouter", "softmax_topk", _norm_topk))
register_router(RouterAdapter("olmoe", f"{_M}.olmoe.modeling_olmoe", "OlmoeTopKRouter", "softmax_topk", _norm_topk))
register_router(
    RouterAdapter("mixtral", f"{_M}.mixtral.modeling_mixtral", "MixtralTopKRouter", "softmax_topk_renorm",
                  weights_in_logits_dtype=False)  # HF keeps Mixtral's weights in fp32
)
register_router(
    RouterAdapter(
        "deepseek_v3",
        f"{_M}.deepseek_v3.modeling_deepseek_v3",
        "DeepseekV3TopkRouter",
        "sigmoid_bias_group",
        lambda m: {
            "renormalize": bool(m.norm_topk_prob),
            "routed_scaling_factor": float(m.routed_scaling_factor),
            "num_groups": int(m.num_group),
            "topk_group": int(m.topk_group),
        },
        selection_bias=lambda m: m.e_score_correction_bias,
        weights_in_logits_dtype=False,  # HF computes its logits and weights in fp32
    )
)
register_router(RouterAdapter("gpt_oss", f"{_M}.gpt_oss.modeling_gpt_oss", "GptOssTopKRouter", "topk_softmax"))


def adapter_for(module: nn.Module) -> RouterAdapter | None:
    """First adapter whose router class `module` is an instance of, else None."""
    for adapter in _DISPATCH_ORDER:
        cls = adapter.router_class()
        if cls is not None and isinstance(module, cls):
            return adapter
    return None


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class RouterSite:
    """One router module of a model, with its global decoder-layer id."""

    name: str
    layer_id: int
    module: nn.Module
    adapter: RouterAdapter

    @property
    def spec(self) -> GateSpec:
        return self.adapter.spec(self.module)


def find_routers(model: nn.Module) -> dict[int, RouterSite]:
    """Every supported router in `model`, keyed by global decoder-layer id (parsed from its name).

    Raises UnsupportedRouterError when the model holds no supported router, listing what is.
    """
    sites: dict[int, RouterSite] = {}
    for name, module in model.named_modules():
        adapter = adapter_for(module)
        if adapter is None:
            continue
        match = _LAYER_RE.search(name + ".")
        if match is None:
            raise UnsupportedRouterError(f"router {name!r} ({type(module).__name__}) is not inside a 'layers.<i>' module; cannot tell its layer id")
        layer_id = int(match.group(1))
        if layer_id in sites:
            raise UnsupportedRouterError(f"two routers in layer {layer_id}: {sites[layer_id].name!r} and {name!r}")
        sites[layer_id] = RouterSite(name, layer_id, module, adapter)
    if not sites:
        supported = ", ".join(f"{a.family} ({a.class_name})" for a in _DISPATCH_ORDER)
        raise UnsupportedRouterError(
            f"no supported MoE router in {type(model).__name__}; supported router classes: {supported}. "
            "Register a RouterAdapter for this family with integrations.hf.routers.register_router"
        )
    return dict(sorted(sites.items()))
