"""Model structures replay refuses by name at attach, whatever their routers: where no forward hook on a router
module can force the routes a trace records, for a reason of the family's own structure.

- Encoder-decoder models (`config.is_encoder_decoder`: Switch Transformers, NLLB-MoE): routers sit in an encoder
  stack and a decoder stack. The encoder's route source tokens that no rollout trace holds (an engine records one
  decoder stack's routes per prompt and sampled token), and both stacks index their layers from 0, so an encoder
  router has no layer id a trace could name.
- MoE blocks that compute their routing inline (INLINE_ROUTING, per block class): no router module returns
  (weights, ids) for replay's hook to replace. Each entry says why the family's block cannot be forced at the
  block either (Doge's product-key routing mixes tokens; Jamba's older block has no router module).
- MoE blocks holding alternative expert sets (ALTERNATIVE_EXPERT_SETS, per block class), each with its own router,
  of which a token takes one (ERNIE-4.5-VL: text experts or vision experts, by token type). Each token routes
  once per layer, but through a router its token type picks, and a trace records ids with no token type; routers
  that each route every token (JetMoE's attention and MLP routers) are route sites of their own instead
  (routers.py). Checked by `refuse_alternatives`, which find_routers calls where a decoder layer holds several
  routers.

The first two are checked by `refuse_structure`, which routers.find_routers calls before it looks for routers. A
block class is looked up only in modeling modules already imported (a model of that family exists only once its module is),
so the check imports nothing and costs one isinstance per module.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

from torch import nn

from moe_replay.registry import Registry
from moe_replay.replay.errors import UnsupportedRouterError


@dataclass(frozen=True)
class InlineRouting:
    """An MoE block class that routes inline, and why replay cannot force its routes."""

    family: str
    module: str
    """Modeling module that defines the block class."""
    class_name: str
    reason: str
    """What in the family's own structure rules replay out, with the numbers where there are some."""
    applies: Callable[[nn.Module], bool] = lambda block: True
    """Whether this block instance routes inline (a transformers release may have moved its routing into a router
    module since)."""


INLINE_ROUTING: Registry[InlineRouting] = Registry("inline-routing MoE block")


def register_inline(entry: InlineRouting) -> InlineRouting:
    INLINE_ROUTING.add(entry.family, entry)
    return entry


_M = "transformers.models"
register_inline(InlineRouting(
    "doge", f"{_M}.doge.modeling_doge", "DogeCDMoE",
    "product-key routing computed inline in DogeCDMoE.forward: router_gate's [B, S, 2 * keys] logits are viewed as "
    "[2, B * S, keys], so a token's two key scores come from different tokens of the batch (HF's own note: routing is "
    "not causal in a full forward), and its top-k of keys^2 experts is scored from those sums; a token's experts "
    "depend on the other tokens and the padding of its batch, and no router module returns (weights, ids) to replace",
))
register_inline(InlineRouting(
    "jamba", f"{_M}.jamba.modeling_jamba", "JambaSparseMoeBlock",
    "this transformers' JambaSparseMoeBlock scores a plain nn.Linear router and takes its top-k inline "
    "(route_tokens_to_experts): no router module returns (weights, ids) to replace; transformers releases whose "
    "Jamba has a JambaTopKRouter module (5.24) replay it",
    applies=lambda block: isinstance(getattr(block, "router", None), nn.Linear),
))


@dataclass(frozen=True)
class AlternativeExpertSets:
    """An MoE block class holding expert sets of which each token takes one, each set with its own router."""

    family: str
    module: str
    """Modeling module that defines the block class."""
    class_name: str
    reason: str
    """How the block picks a token's set, and why its routers are not route sites of their own."""


ALTERNATIVE_EXPERT_SETS: Registry[AlternativeExpertSets] = Registry("MoE block of alternative expert sets")


def register_alternatives(entry: AlternativeExpertSets) -> AlternativeExpertSets:
    ALTERNATIVE_EXPERT_SETS.add(entry.family, entry)
    return entry


register_alternatives(AlternativeExpertSets(
    "ernie4_5_vl_moe", f"{_M}.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe", "Ernie4_5_VLMoeMoeBlock",
    "text_moe and vision_moe, each with its own router, and a token's type (moe_mm_token_type_ids) picks its set: "
    "text tokens the text experts, image and video tokens the vision experts. A token routes once per layer, "
    "through the router its type picks, so numbering both routers as route layers would give every token a route "
    "in a set it never visits, and a trace records a token's ids without the token type that says which set they index",
))


def _loaded_class(entry: InlineRouting | AlternativeExpertSets) -> type | None:
    return getattr(sys.modules.get(entry.module), entry.class_name, None)


def refuse_structure(model: nn.Module, modules: dict[str, nn.Module], family: str) -> None:
    """Raise UnsupportedRouterError naming the family, the module and the reason where `model`'s structure rules
    replay out (module docstring); else return. `modules`: model.named_modules() as a dict."""
    config = getattr(model, "config", None)
    if bool(getattr(config, "is_encoder_decoder", False)):
        stacks = sorted({n.split(".", 1)[0] for n in modules if n.split(".", 1)[0] in ("encoder", "decoder")} |
                        {n.rsplit(".", 1)[-1] for n in modules if n.rsplit(".", 1)[-1] in ("encoder", "decoder")})
        raise UnsupportedRouterError(
            f"{family}: {type(model).__name__} is an encoder-decoder model (config.is_encoder_decoder; stacks "
            f"{stacks or ['encoder', 'decoder']}): the encoder's routers route source tokens no rollout trace holds, "
            "and both stacks number their layers from 0, so an encoder router has no layer id a trace could name; "
            "traces record one decoder-only stack's routes"
        )
    entries = [(e, cls) for e in (INLINE_ROUTING.get(n) for n in INLINE_ROUTING) if (cls := _loaded_class(e)) is not None]
    if not entries:
        return
    for name, module in modules.items():
        for entry, cls in entries:
            if isinstance(module, cls) and entry.applies(module):
                raise UnsupportedRouterError(f"{family}: MoE block {name!r} ({cls.__name__}) routes inline: {entry.reason}")


def refuse_alternatives(modules: dict[str, nn.Module], family: str, router_names: list[str]) -> None:
    """Raise UnsupportedRouterError naming the family, the block and the reason where one of `router_names` (the
    model's routers, several to a decoder layer) sits inside a block of ALTERNATIVE_EXPERT_SETS; else return."""
    entries = [(e, cls) for e in (ALTERNATIVE_EXPERT_SETS.get(n) for n in ALTERNATIVE_EXPERT_SETS)
               if (cls := _loaded_class(e)) is not None]
    for router in router_names if entries else ():
        parts = router.split(".")
        for name in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)):
            for entry, cls in entries:
                if isinstance(modules.get(name), cls):
                    inside = sorted(r for r in router_names if r.startswith(f"{name}."))
                    raise UnsupportedRouterError(f"{family}: MoE block {name!r} ({cls.__name__}) holds expert sets a token "
                                                 f"takes one of (routers "
                                                 f"{', '.join(repr(r) for r in inside)}): {entry.reason}")
