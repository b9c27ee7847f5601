"""Which HF transformers router classes we can replay, and how each one weighs its experts.

Dispatcher: registered adapters are tried in registration order, first isinstance match wins
(the explicit path). Any other router-shaped module gets an adapter inferred from its attributes
and config. Both are verified bit for bit on the router (infer.py): at attach, in the model's dtype
and the autocast state of the attach, and again on the first forward of each (input dtype, weight
dtype, autocast dtype) the router meets; a router no rule reproduces in a context is refused by
name there. Family-specific knowledge (attribute names, whether HF casts weights back to the logits
dtype) lives only here, in infer.py's hint lists and in outputs.py's output conventions. Registered
adapters work on HF's router modules that return (router_logits [T, E], weights [T, K], ids [T, K])
from hidden states [T, H]; inferred ones locate those three in whatever order the router returns
them, or read them through the output convention registered for the router's class (outputs.py).

Route layers (`route_layer`, the one place this numbering lives): a trace records one expert choice per
token per route layer. Where every decoder layer holding routers holds one, route layer = decoder layer.
A family that routes its tokens R > 1 times in each decoder layer (JetMoE: its attention's mixture of
heads JetMoeMoA and its MLP JetMoeMoE, each a JetMoeTopKGating) numbers its routers
`decoder_layer * R + slot`, slot = the router's order within its layer in `named_modules()` order (known
before any forward, unlike call order; JetMoE registers its MLP before its attention: MLP router slot 0,
attention router slot 1, though the attention runs first), and its geometry counts R route layers
per decoder layer (`num_route_layers`). Decoder layers holding different numbers of routers are refused by
name, and so is a block whose routers are alternatives a token takes one of (structure.py
ALTERNATIVE_EXPERT_SETS: ERNIE-4.5-VL's text and vision experts, chosen by token type).

Decoder-layer ids come from the decoder stack's `layers.<i>` index. A router outside the decoder's layer
list (a multi-token-prediction or draft layer, e.g. transformers' MtpModel, whose own `layers.0`
would collide with decoder layer 0) is refused by name: no trace records routes for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from moe_replay.registry import Registry
from moe_replay.replay.errors import UnsupportedRouterError
from moe_replay.replay.gates import GATE_RULES, GateSpec

from .outputs import lookup_class


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
    upcast: bool = True
    """HF scores fp32 logits (`softmax(dtype=float32)`, `.float()`), or scores the logits in their own dtype
    (DeepSeek-V3's `logits.sigmoid()`, GPT-OSS's `softmax(dtype=logits.dtype)`): GateSpec.upcast."""

    def __post_init__(self) -> None:
        if not self.module or not self.class_name:
            raise ValueError(f"RouterAdapter {self.family!r} needs module and class_name, got {self.module!r}, {self.class_name!r}")
        GATE_RULES.get(self.rule)  # an unknown rule fails at registration, listing the known ones

    def router_class(self) -> type | None:
        """The class, or None when this transformers version lacks it (looked up once per process:
        `find_routers` asks every adapter about every module, ~200 lookups for the tiny 2-layer model,
        ~1 ms of each replayed micro-batch when each was an import_module call)."""
        return lookup_class(self.module, self.class_name)

    def spec(self, router: nn.Module) -> GateSpec:
        return GateSpec(self.rule, top_k=int(router.top_k), upcast=self.upcast, **self.spec_kwargs(router))

    def num_experts(self, router: nn.Module) -> int:
        return int(router.weight.shape[0])

    def top_k(self, router: nn.Module) -> int:
        return int(router.top_k)

    def unpack(self, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [T, E], weights [T, K], ids [T, K]) from the router's output."""
        return output[0], output[1], output[2]

    def repack(self, output, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """The router's output with replayed weights, in the dtype of HF's own weights in this call, and ids."""
        return logits, weights.to(output[1].dtype), ids

    def register_hook(self, router: nn.Module, hook):
        """A removable forward hook (router, args, output) on the router, whose output the block consumes."""
        return router.register_forward_hook(hook)

    def describe(self) -> str:
        return f"{self.rule}{'' if self.upcast else ' logits-dtype'} (registered {self.family})"


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
    RouterAdapter("mixtral", f"{_M}.mixtral.modeling_mixtral", "MixtralTopKRouter", "softmax_topk_renorm")
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
        upcast=False,  # `router_logits.sigmoid()`: fp32 logits, bf16 under autocast
    )
)
register_router(RouterAdapter("gpt_oss", f"{_M}.gpt_oss.modeling_gpt_oss", "GptOssTopKRouter", "topk_softmax", upcast=False))


def adapter_for(module: nn.Module) -> RouterAdapter | None:
    """First adapter whose router class `module` is an instance of, else None."""
    for adapter in _DISPATCH_ORDER:
        cls = adapter.router_class()
        if cls is not None and isinstance(module, cls):
            return adapter
    return None


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_DRAFT_RE = re.compile(r"(?:^|\.)(mtp\w*|nextn\w*|draft\w*)(?:\.|$)", re.IGNORECASE)
"""Path parts naming modules outside the decoder stack (multi-token prediction, draft heads)."""


@dataclass(frozen=True)
class RouterSite:
    """One router module of a model, with the route layer a trace records its routes under."""

    name: str
    layer_id: int
    """Route layer (`route_layer`): the global decoder-layer id where each decoder layer holds one router."""
    module: nn.Module
    adapter: Any
    """A registered RouterAdapter, or an InferredAdapter verified on this module."""
    decoder_layer: int
    """The decoder layer holding the router (`layers.<i>`)."""
    slot: int
    """The router's order among its decoder layer's routers (named_modules() order), 0 where it is alone."""

    @property
    def spec(self) -> GateSpec:
        return self.adapter.spec(self.module)


_LAYER_LISTS = ("layers", "blocks")
"""Names HF decoders give their layer list (`blocks`: DBRX)."""


def _decoder_layers_prefix(model: nn.Module) -> str | None:
    """Qualified name of the decoder's layer list (ending in '.'), when the model says which it is."""
    get_decoder = getattr(model, "get_decoder", None)
    try:
        decoder = get_decoder() if callable(get_decoder) else None
    except Exception:  # some composite models raise here; fall back to the path rules
        decoder = None
    layers = next((getattr(decoder, n) for n in _LAYER_LISTS if isinstance(getattr(decoder, n, None), nn.ModuleList)), None)
    if layers is None:
        return None
    for name, module in model.named_modules():
        if module is layers:
            return f"{name}." if name else ""
    return None


def _family(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", "") or type(model).__name__)


def _layer_id(model: nn.Module, name: str, module: nn.Module, stack: str | None) -> int:
    family = _family(model)
    draft = _DRAFT_RE.search(name) or type(model).__name__ == "MtpModel"
    outside = stack is not None and not name.startswith(stack)
    if draft or outside:
        raise UnsupportedRouterError(
            f"{family}: router {name!r} ({type(module).__name__}) is outside the decoder stack "
            f"({stack or 'decoder layers'!r}): an MTP/draft (or encoder) layer, whose 'layers.<i>' index would collide "
            "with decoder layer <i>; traces record decoder layers only. Replay the decoder model without it"
        )
    match = re.match(r"(\d+)\.", name[len(stack):]) if stack is not None else _LAYER_RE.search(name + ".")
    if match is None:
        raise UnsupportedRouterError(f"{family}: router {name!r} ({type(module).__name__}) is not inside a 'layers.<i>' module; cannot tell its layer id")
    return int(match.group(1))


def route_layer(decoder_layer: int, slot: int, per_layer: int) -> int:
    """The layer index a trace records a router's routes under: `decoder_layer * per_layer + slot` (module
    docstring); the decoder layer itself where each layer holds one router (per_layer 1, slot 0)."""
    if not 0 <= slot < per_layer:
        raise ValueError(f"route_layer: slot must be in [0, {per_layer}), got {slot}")
    return decoder_layer * per_layer + slot


def routers_per_layer(sites: dict[int, RouterSite]) -> int:
    """R: the routers each router-holding decoder layer holds (find_routers refuses layers that differ)."""
    return 1 + max((s.slot for s in sites.values()), default=0)


def num_route_layers(num_decoder_layers: int, sites: dict[int, RouterSite]) -> int:
    """The route layers of a model of `num_decoder_layers` decoder layers: R per decoder layer
    (ModelGeometry.num_layers; a trace of another count is refused by name at every entry)."""
    return int(num_decoder_layers) * routers_per_layer(sites)


def _by_layer(model: nn.Module, modules: dict[str, nn.Module], found: list[tuple[str, nn.Module, Any, int]]) -> int:
    """R, the routers per router-holding decoder layer, after refusing layers that hold different numbers and
    blocks whose routers a token takes one of; `found`: (name, module, registered adapter, decoder layer)."""
    from .structure import refuse_alternatives

    names: dict[int, list[str]] = {}
    for name, _, _, layer in found:
        names.setdefault(layer, []).append(name)
    counts = {layer: len(n) for layer, n in names.items()}
    if len(set(counts.values())) > 1:
        few, many = min(counts, key=lambda i: (counts[i], i)), max(counts, key=lambda i: (counts[i], -i))
        raise UnsupportedRouterError(
            f"{_family(model)}: decoder layers hold different numbers of routers, layer {few} holds {counts[few]} "
            f"({', '.join(map(repr, names[few]))}) and layer {many} {counts[many]} "
            f"({', '.join(map(repr, names[many]))}); route layers are "
            "numbered decoder_layer * R + slot for the same R routers in every MoE layer, so no route-layer numbering "
            "a trace could name covers both")
    per_layer = next(iter(counts.values()), 1)
    if per_layer > 1:
        refuse_alternatives(modules, _family(model), [n for ns in names.values() for n in ns])
    return per_layer


def find_routers(model: nn.Module) -> dict[int, RouterSite]:
    """Every router in `model`, keyed by route layer (`route_layer`: the global decoder-layer id where each
    layer holds one router), each with a registered or verified adapter.

    Raises UnsupportedRouterError (family, router, layer, reason) when a router cannot be verified,
    sits outside the decoder stack, decoder layers hold different numbers of routers, or the model
    holds no router at all; all before any forward.
    """
    from .fsdp import fsdp_owner
    from .infer import attach_adapter, looks_like_router
    from .structure import refuse_structure

    modules = dict(model.named_modules())
    refuse_structure(model, modules, _family(model))  # encoder-decoder models, inline-routing blocks (structure.py)
    stack = _decoder_layers_prefix(model)
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden_dtype = _hidden_dtype(model, modules)
    found: list[tuple[str, nn.Module, Any, int]] = []
    for name, module in modules.items():
        adapter = adapter_for(module)
        if adapter is None and not looks_like_router(module):
            continue
        found.append((name, module, adapter, _layer_id(model, name, module, stack)))
    per_layer = _by_layer(model, modules, found)
    sites: dict[int, RouterSite] = {}
    slots: dict[int, int] = {}
    for name, module, adapter, layer in found:
        slot = slots[layer] = slots.get(layer, -1) + 1
        layer_id = route_layer(layer, slot, per_layer)
        parent = modules.get(name.rsplit(".", 1)[0]) if "." in name else model
        where = f"{name} (layer {layer})" if per_layer == 1 else f"{name} (layer {layer}, route layer {layer_id})"
        adapter = attach_adapter(
            module, adapter, family=_family(model), where=where,
            config=getattr(module, "config", None) or text_config, parent=parent, hidden_size=_hidden_size(module),
            hidden_dtype=hidden_dtype, fsdp_owner=fsdp_owner(modules, name),
        )
        sites[layer_id] = RouterSite(name, layer_id, module, adapter, layer, slot)
    if not sites:
        supported = ", ".join(f"{a.family} ({a.class_name})" for a in _DISPATCH_ORDER)
        raise UnsupportedRouterError(
            f"no MoE router in {type(model).__name__} ({_family(model)}); supported router classes: {supported}, "
            "and any *Router / *Gating module whose gate rule verifies. "
            "Register a RouterAdapter for this family with integrations.hf.routers.register_router"
        )
    return dict(sorted(sites.items()))


def _hidden_dtype(model: nn.Module, modules: dict[str, nn.Module]) -> torch.dtype | None:
    """The residual stream's dtype as the model's forward holds it (its input embeddings' in the forward: FSDP2's
    param dtype where a MixedPrecisionPolicy sets one): what its routers are fed outside autocast (a router HF
    keeps in fp32, like ERNIE-4.5's, still sees bf16 hidden states)."""
    from .fsdp import forward_dtype, fsdp_owner

    get = getattr(model, "get_input_embeddings", None)
    try:
        embeddings = get() if callable(get) else None
    except Exception:  # models without input embeddings (some composite ones raise)
        embeddings = None
    weight = getattr(embeddings, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        return None
    name = next((n for n, m in modules.items() if m is embeddings), None)
    return forward_dtype(None if name is None else fsdp_owner(modules, name), weight)


def _hidden_size(router: nn.Module) -> int:
    """The router's input width: the second dim of its first matrix (its gate projection)."""
    for p in router.parameters():
        if p.dim() == 2:
            return int(p.shape[1])
    raise UnsupportedRouterError(f"router {type(router).__name__} holds no weight matrix; cannot tell its input width")
