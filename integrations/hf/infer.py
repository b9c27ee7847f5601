"""Gate rules for HF routers nobody registered: inferred from the router and config, verified bit for bit.

A registered RouterAdapter (routers.py) is the explicit path. For any other module that looks like
an MoE router, `attach_adapter` reads hints from the router's attributes and the model config
(scoring function, a selection-only bias, expert groups, norm_topk_prob, a scaling factor), lists
the rule table's candidates those hints allow, and verifies them on the router itself before any
forward: the router is run on probe hidden states, and a candidate is accepted only if, given the
router's own ids, it reproduces the router's own weights bit for bit (`torch.equal`, in the
router's output dtype) and its free selection reproduces the router's id sets. A registered
adapter is checked the same way against its one rule.

The arithmetic depends on the precision context: HF routers score in fp32 or in the logits' own
dtype, and bf16 weights or bf16 autocast change which that is (DeepSeek-V3's `logits.sigmoid()` runs
in bf16 under autocast; on bf16 logits of spread 2, 28% of its weights differ from fp32 scores). So a rule is
verified per PrecisionKey (input dtype, weight dtype, device type, autocast dtype): at attach in the
model's dtype and the attach's autocast state, and again by `adapter_in_context` on the first
forward of every other context, with the probe in that forward's dtype under its autocast, and
against that forward's own router output. Replayed weights take the dtype of HF's own weights in the
same call. Routers whose output is not (logits [T, E], weights [T, K], ids [T, K]) in some order
follow an output convention registered for their class (outputs.py: Llama 4's dense scores, DBRX's
routing in its parent block, JetMoE's expert-sorted slots, ZAYA1's skip class); the rule is verified
through it: repacking HF's own ids with the rule's weights must give HF's whole output bit for bit.
A router that no candidate reproduces in a context, whose output fits no convention, or whose logits
are degenerate on the probe (uninitialised weights cannot tell rules apart) is refused by name with
what did not match.

FSDP2-sharded routers (`fully_shard`, as verl's and TRL's FSDP2 actors shard) are probed on the
parameters their forward sees: attach gathers them with the owning FSDP2 module's own
`unshard()` (in its MixedPrecisionPolicy's param dtype) and verifies in that context; in a forward
FSDP2 has gathered them already (fsdp.py).

Legend: T probe tokens, E experts, K top-k.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from moe_replay.replay.errors import UnsupportedRouterError
from moe_replay.replay.gates import GATE_RULES, GateSpec

from .fsdp import unsharded
from .outputs import Refusal, Triple, call_forward, differs, layout_for, locate_triple, seen_ids

PROBE_TOKENS = 4096
"""Probe rows. A wrong renormalisation, scale or epsilon shows in some bit of most rows, but some selection
differences are rare: scores in the wrong dtype move a bf16 DeepSeek-style selection in ~0.2% of rows (2 of
1024 measured), AXK2's 0-filled groups in 2 of 4096; 4096 rows show a 0.2% difference ~8 times."""
_PROBE_SEED = 1234
_BIAS_NAMES = ("e_score_correction_bias", "expert_bias", "balancing_biases")
"""Tensors (on the router, its submodules or its parent block) that take part in selection only."""
_SCALE_NAMES = ("routed_scaling_factor", "route_scale", "router_scaling_factor")
_EXPERT_SCALE_NAMES = ("per_expert_scale",)
"""Tensors [E] on the router that multiply each expert's weight (Gemma 4): read live, so they get their gradient."""
_JITTER_NAMES = ("router_jitter_noise",)
"""Sparsemixer's relative mask gap / 2 (Phi-3.5-MoE); its rule is a candidate only where the router or config names it."""


def looks_like_router(module: nn.Module) -> bool:
    """Router-shaped by class name: *Router, *Gating, or a *Gate that has a top_k (HunYuan)."""
    name = type(module).__name__
    if name.endswith(("Router", "Gating")):
        return True
    return name.endswith("Gate") and hasattr(module, "top_k")


@dataclass(frozen=True)
class InferredAdapter:
    """How to replay one router instance, as verified on it (same interface as RouterAdapter)."""

    family: str
    class_name: str
    gate_spec: GateSpec
    layout: Any
    """Where the router's output holds logits, weights and ids, and where replay hooks it (outputs.py)."""
    experts: int
    bias_at: tuple[Any, str] | None = None
    """(weakref to the module holding it, attribute path) of the selection-only bias the verified
    selection used; read at each call, so a later .to(device) or checkpoint load is seen."""
    scale_at: tuple[Any, str] | None = None
    """(weakref to the router, attribute path) of the per-expert scale the verified weights use (GateSpec.expert_scale);
    read at each call like the bias, so a trained scale's current value weighs and gets the gradient."""

    @property
    def rule(self) -> str:
        return self.gate_spec.rule

    def spec(self, router: nn.Module) -> GateSpec:
        return self.gate_spec

    def num_experts(self, router: nn.Module) -> int:
        return self.experts

    def top_k(self, router: nn.Module) -> int:
        return self.gate_spec.top_k

    def selection_bias(self, router: nn.Module) -> torch.Tensor | None:
        if self.bias_at is None:
            return None
        owner = self.bias_at[0]()
        return None if owner is None else _get_path(owner, self.bias_at[1])

    def expert_scale(self, router: nn.Module) -> torch.Tensor | None:
        if self.scale_at is None:
            return None
        owner = self.scale_at[0]()
        return None if owner is None else _get_path(owner, self.scale_at[1])

    def unpack(self, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.layout.unpack(output)

    def repack(self, output, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """The router's output with replayed weights, in the dtype of HF's own weights in this call, and ids."""
        return self.layout.repack(output, logits, weights, ids)

    def register_hook(self, router: nn.Module, hook):
        """A removable hook seeing (router, args, output) where this router hands its experts their routes."""
        return self.layout.register_hook(router, hook)

    def describe(self) -> str:
        s = self.gate_spec
        parts = [s.rule]
        if s.rule == "sparsemixer":
            parts.append(f"jitter={s.jitter_eps:g}")
        elif s.rule != "topk_softmax":
            parts.append("renorm" if s.renormalize else "no-renorm")
        if s.renorm_eps is not None:
            parts.append(f"eps={s.renorm_eps:g}")
        if s.renorm_p is not None and s.renormalize:
            parts.append(f"p-norm={s.renorm_p:g}")
        if s.routed_scaling_factor != 1.0:
            parts.append(f"scale={s.routed_scaling_factor:g}")
        if s.rule == "sigmoid_bias_group" and s.scoring != "sigmoid":
            parts.append(s.scoring)
        if self.bias_at is not None:
            parts.append("bias" if s.bias_on == "scores" else "bias-on-logits")
        if s.expert_scale:
            parts.append("per-expert-scale")
        if s.num_groups > 1:
            parts.append(f"groups={s.num_groups}/{s.topk_group}({s.group_score}{'' if s.group_fill is None else f', fill {s.group_fill:g}'})")
        if not s.upcast:
            parts.append("logits-dtype")
        return " ".join(parts) if type(self.layout) is Triple else " ".join(parts) + f" [{self.layout.describe()}]"


_Refuse = Refusal


class _Indistinct(_Refuse):
    """The probe cannot tell rules apart (meta or uninitialised weights, tied logits): nothing is verified."""


def _first_attr(objs: list[Any], names: tuple[str, ...]) -> Any:
    for obj in objs:
        for name in names:
            value = getattr(obj, name, None)
            if value is not None and not isinstance(value, (nn.Module, torch.Tensor)):
                return value
    return None


def _get_path(owner: nn.Module, path: str) -> torch.Tensor:
    obj: Any = owner
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _find_bias(router: nn.Module, parent: nn.Module | None, experts: int) -> tuple[nn.Module, str] | None:
    """(owner, attribute path) of a selection-only bias on the router (any depth) or its parent block."""
    owners = [(router, list(router.named_buffers()) + list(router.named_parameters()))]
    if parent is not None:
        owners.append((parent, list(parent.named_buffers(recurse=False)) + list(parent.named_parameters(recurse=False))))
    for owner, tensors in owners:
        for name, t in tensors:
            if name.rsplit(".", 1)[-1] in _BIAS_NAMES and t.numel() == experts:
                return owner, name
    return None


def _find_scale(router: nn.Module, experts: int) -> str | None:
    """Attribute path of a per-expert weight scale [E] on the router (any depth), or None."""
    for name, t in list(router.named_parameters()) + list(router.named_buffers()):
        if name.rsplit(".", 1)[-1] in _EXPERT_SCALE_NAMES and t.numel() == experts and t.is_floating_point():
            return name
    return None


def _extra_args(router: nn.Module, parent: nn.Module | None) -> list[Any]:
    """Positional arguments after the hidden states, read from the parent block by parameter name."""
    params = list(inspect.signature(router.forward).parameters.values())[1:]
    args = []
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            continue
        value = getattr(parent, p.name, None) if parent is not None else None
        if value is None and p.default is p.empty:
            raise _Refuse(f"forward needs argument {p.name!r}, which its parent block does not hold")
        if value is None:
            break
        args.append(value)
    return args


def _ordered(hint: Any, options: list) -> list:
    """`options` with the hinted value first: hints order the candidates, verification decides."""
    return [hint] + [o for o in options if o != hint] if hint in options else options


def _candidates(router: nn.Module, config: Any, top_k: int, experts: int, bias: Any, upcasts: list[bool],
                per_expert: Any = None, hints: dict | None = None) -> list[tuple[GateSpec, bool]]:
    """Rule-table candidates, the ones the hints name first: (spec, use the bias in selection). `per_expert`: the
    router's per-expert scale tensor, if it has one (candidates weigh by it first, then without). `hints`: its
    output convention's (outputs.py): a rule to try first, a p-norm renormalisation, whether it renormalises."""
    hints = hints or {}
    objs = [router, config]
    norm = hints["renormalize"] if "renormalize" in hints else _first_attr(objs, ("norm_topk_prob",))
    renorms = _ordered(None if norm is None else bool(norm), [True, False])
    scale = float(_first_attr(objs, _SCALE_NAMES) or 1.0)
    scales = _ordered(scale, [scale, 1.0]) if scale != 1.0 else [1.0]
    if top_k & (top_k - 1) == 0 and top_k > 1:  # x / k == x * (1 / k) exactly for k a power of two
        scales.append(1.0 / top_k)  # OpenAI privacy filter divides its weights by top_k
    scoring_hint = _first_attr(objs, ("scoring_func", "expert_selection_fn"))
    method = getattr(router, "topk_method", None)
    groups = int(_first_attr([router], ("num_group", "n_group")) or _first_attr([config], ("n_group",)) or 1)
    topk_group = int(_first_attr([router, config], ("topk_group",)) or 1)
    group_opts: list[dict] = [{}]
    if groups > 1 and experts % groups == 0 and method != "greedy":
        score = "max" if method == "group_limited_greedy" else "top2_sum"
        group = dict(num_groups=groups, topk_group=min(topk_group, groups), group_score=score)
        group_opts = [group, {**group, "group_fill": 0.0}, {}]
    rules = [("softmax_topk", {}), ("topk_softmax", {}), ("sigmoid_bias_group", {"scoring": "sigmoid"}), ("probs_topk", {})]
    if scoring_hint == "sqrtsoftplus":
        rules = [("sigmoid_bias_group", {"scoring": "sqrtsoftplus"})]
    elif scoring_hint == "sigmoid":
        rules = rules[2:3] + rules[:2] + rules[3:]
    elif per_expert is not None:  # a per-expert scale on a softmax router: Gemma 4 returns probabilities
        rules = rules[3:] + rules[:3]
    jitter = _first_attr(objs, _JITTER_NAMES)
    if jitter is not None and top_k == 2 and scoring_hint is None:  # Mixtral's config names it too (its input jitter)
        # in the logits' dtype first, as HF's runs: on bf16 logits fp32 scores round its 2% window otherwise in
        # 1 of ~8000 rows (97 of 800000 measured), which the 4096 probe rows may not show
        rules.append(("sparsemixer", {"jitter_eps": float(jitter)}))
    if hints.get("rule") is not None:  # Llama 4's topk_sigmoid, which only its convention names
        rules = [(hints["rule"], {})] + [r for r in rules if r[0] != hints["rule"]]
    out: list[tuple[GateSpec, bool]] = []
    for rule, extra in rules:
        for renorm in renorms if rule not in ("topk_softmax", "sparsemixer") else [False]:
            for eps in [None, 1e-6] if renorm else [None]:
                for scale_ in scales:
                    for g in group_opts if rule != "sparsemixer" else [{}]:
                        for use_bias in [True, False] if bias is not None and rule != "sparsemixer" else [False]:
                            for bias_on in ["scores", "logits"] if use_bias and rule == "sigmoid_bias_group" else ["scores"]:
                                for by_scale in [True, False] if per_expert is not None else [False]:
                                    for upcast in upcasts if rule != "sparsemixer" else upcasts[::-1]:
                                        spec = GateSpec(rule, top_k=top_k, renormalize=renorm, routed_scaling_factor=scale_,
                                                        renorm_eps=eps, upcast=upcast, bias_on=bias_on, expert_scale=by_scale,
                                                        **extra, **g)
                                        out.append((spec, use_bias))
    if hints.get("renorm_p") is not None:  # DBRX divides by the p-norm: those forms first
        out = [(replace(c, renorm_p=hints["renorm_p"]), b) for c, b in out if c.renormalize and c.renorm_eps is None] + out
    return out


PrecisionKey = tuple
"""(router input dtype, router weight dtype, device type, autocast dtype or None): what a gate rule's
arithmetic depends on besides the router's code and config."""


@dataclass
class _ProbeContext:
    """What attach knew about a router, kept to verify it again in another precision context."""

    family: str
    where: str
    config: Any
    parent: "weakref.ref[nn.Module] | None"
    hidden_size: int
    registered: Any
    """The registered RouterAdapter, or None where the rule is inferred."""
    owner: "weakref.ref[nn.Module] | None" = None
    """The FSDP2 module (fully_shard) that gathers the router's parameters, where the model is sharded."""


_PROBES: "weakref.WeakKeyDictionary[nn.Module, _ProbeContext]" = weakref.WeakKeyDictionary()
_VERIFIED: "weakref.WeakKeyDictionary[nn.Module, dict[PrecisionKey, Any]]" = weakref.WeakKeyDictionary()
"""Router -> {precision key: adapter verified on it in that context}. The rule depends on the router's code,
config and precision context, not on its weight values, so one probe per router and context is enough."""
_FORWARD: "weakref.WeakKeyDictionary[nn.Module, dict[PrecisionKey, Any]]" = weakref.WeakKeyDictionary()
"""Router -> {precision key: adapter} of the contexts a forward has run and been checked in; the last one added last."""


def _weight_of(router: nn.Module) -> torch.Tensor | None:
    return next((p for p in router.parameters() if p.is_floating_point()), None)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def precision_key(router: nn.Module, hidden_dtype: torch.dtype | None, device: torch.device | None = None) -> PrecisionKey:
    """The key of a forward feeding `router` hidden states of `hidden_dtype`, under the autocast state now."""
    param = _weight_of(router)
    device = device if device is not None else (param.device if param is not None else torch.device("cpu"))
    weight_dtype = None if param is None else param.dtype
    return (hidden_dtype or weight_dtype, weight_dtype, device.type, _autocast_dtype(device.type))


def attach_adapter(router: nn.Module, registered: Any, *, family: str, where: str, config: Any, parent: nn.Module | None,
                   hidden_size: int, hidden_dtype: torch.dtype | None, fsdp_owner: nn.Module | None = None) -> Any:
    """The adapter for `router` verified at attach: the registered one checked, or one inferred.

    Probes run in `hidden_dtype` (the model's residual dtype as its forward feeds it) under the autocast
    state of the call, on the parameters as the forward sees them (gathered by `fsdp_owner`, the FSDP2
    module around the router, where the model is sharded); `adapter_in_context` verifies again on the
    first forward of each other context. Raises UnsupportedRouterError naming family, router, layer and reason.
    """
    ctx = _ProbeContext(family, where, config, None if parent is None else weakref.ref(parent), hidden_size, registered,
                        None if fsdp_owner is None else weakref.ref(fsdp_owner))
    _PROBES[router] = ctx
    try:
        with unsharded(router, fsdp_owner, where):
            return _verified(router, precision_key(router, hidden_dtype))
    except ValueError as why:  # sharded parameters that cannot be gathered
        raise UnsupportedRouterError(f"{family}: router {where!r} ({type(router).__name__}) cannot be probed: {why}") from None


def infer_adapter(router: nn.Module, *, family: str, where: str, config: Any, parent: nn.Module | None, hidden_size: int) -> InferredAdapter:
    """The verified inferred adapter for `router` in its weight dtype, or UnsupportedRouterError naming family, layer and reason."""
    return attach_adapter(router, None, family=family, where=where, config=config, parent=parent, hidden_size=hidden_size, hidden_dtype=None)


def adapter_in_context(router: nn.Module, hidden: torch.Tensor | None, output: Any = None) -> Any:
    """The adapter verified for the forward now running: `hidden`'s dtype (None: the weights'), the router's
    weight dtype and the ambient autocast state. The first forward of a context probes the router in it (and checks the rule
    against `output`, HF's own result of this call); later ones are a dict lookup. Raises
    UnsupportedRouterError, before any replayed output, where no rule reproduces the router in this context.
    """
    key = precision_key(router, None if hidden is None else hidden.dtype, None if hidden is None else hidden.device)
    seen = _FORWARD.get(router)
    hit = None if seen is None else seen.get(key)
    if hit is not None:
        return hit
    ctx = _PROBES.get(router)
    owner = None if ctx is None or ctx.owner is None else ctx.owner()
    try:
        with unsharded(router, owner, "" if ctx is None else ctx.where):  # a no-op in a forward: FSDP2 gathered them
            adapter = _verified(router, key)
    except ValueError as why:
        raise UnsupportedRouterError(f"router {type(router).__name__} cannot be probed: {why}") from None
    if output is not None:
        _check_output(router, adapter, output, key)
    _FORWARD.setdefault(router, {})[key] = adapter
    return adapter


def forward_adapter(router: nn.Module) -> Any:
    """The adapter verified for the latest new forward context `router` ran in (None before any forward)."""
    seen = _FORWARD.get(router)
    return list(seen.values())[-1] if seen else None


def _describe_key(key: PrecisionKey) -> str:
    hidden, weight, device, autocast = key
    return f"{str(hidden).replace('torch.', '')} input, {str(weight).replace('torch.', '')} weights on {device}" + (
        f", {str(autocast).replace('torch.', '')} autocast" if autocast is not None else ", no autocast")


def _verified(router: nn.Module, key: PrecisionKey) -> Any:
    cached = _VERIFIED.get(router, {})
    if key in cached:
        return cached[key]
    ctx = _PROBES.get(router)
    if ctx is None:
        raise UnsupportedRouterError(f"router {type(router).__name__} was not attached by find_routers; no probe context to verify it in")
    parent = None if ctx.parent is None else ctx.parent()
    try:
        if ctx.registered is not None:
            adapter, verified = _check_registered(router, ctx.registered, key, parent=parent, hidden_size=ctx.hidden_size)
        else:
            adapter = _infer(router, family=ctx.family, config=ctx.config, parent=parent, hidden_size=ctx.hidden_size, key=key)
            verified = True
    except _Refuse as why:
        raise UnsupportedRouterError(
            f"{ctx.family}: router {ctx.where!r} ({type(router).__name__}) cannot be replayed in {_describe_key(key)}: {why}"
        ) from None
    if verified:  # an unverified registration is probed again at the first forward of the context
        _VERIFIED.setdefault(router, {})[key] = adapter
    return adapter


def _check_output(router: nn.Module, adapter: Any, output: Any, key: PrecisionKey) -> None:
    """The rule, on this forward's own logits at HF's own ids, gives HF's weights bit for bit and selects HF's ids."""
    ctx = _PROBES[router]
    with torch.no_grad():  # inside a checkpointed forward, no tensor may be saved that the recompute (no check) does not save
        logits_TE, weights_TK, ids_TK = adapter.unpack(output)
    spec, bias = adapter.spec(router), adapter.selection_bias(router)
    rule = GATE_RULES.get(spec.rule)
    if router.training and getattr(rule, "random_in_training", False):
        return  # HF's own output is a random draw there; the rule was verified in eval mode (_probe)
    with torch.no_grad():
        ids_TK = ids_TK.long()
        mine_TK = rule.weights(logits_TE.detach(), ids_TK, spec, bias, expert_scale_of(adapter, router))
        mine = adapter.repack(output, logits_TE, mine_TK, ids_TK)
        wrong = int((adapter.unpack(mine)[1] != weights_TK).any(-1).sum())
        item = differs(adapter, output, mine)
        picked = _picked(rule, adapter, logits_TE, spec, bias, expert_scale_of(adapter, router), weights_TK.dtype).sort(-1).values
        moved = int((picked != ids_TK.sort(-1).values).any(-1).sum())
    if wrong or moved or item is not None:
        _VERIFIED.get(router, {}).pop(key, None)
        raise UnsupportedRouterError(
            f"{ctx.family}: router {ctx.where!r} ({type(router).__name__}) cannot be replayed in {_describe_key(key)}: "
            f"its verified rule ({adapter.describe()}) gives other weights than HF in {wrong} and other experts in {moved} "
            f"of this forward's {logits_TE.shape[0]} tokens" + ("" if item is None else f" ({item})")
        )


@contextlib.contextmanager
def _eval_mode(router: nn.Module):
    """The router (and its submodules) in eval mode for a probe, restored after. A rule is arithmetic on the
    router's logits; training mode adds only randomness to routers (DBRX's and Switch's input jitter, Phi-MoE's
    sparsemixer sampling its experts), which a bit-for-bit probe cannot verify and replay never uses (its ids are
    the recorded ones). A deterministic training-mode difference would still show at the first training forward,
    checked against HF's own output (`_check_output`) unless the rule declares that output random."""
    modes = [(m, m.training) for m in router.modules()]
    router.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _probe(router: nn.Module, key: PrecisionKey, parent: nn.Module | None, hidden_size: int, registered: bool = False):
    """(router output on probe hidden states of the key's dtype, logits scaled to O(2), under the ambient autocast;
    its layout: the output convention registered for the router's class, else the plain tuple's, which a
    `registered` RouterAdapter always reads)."""
    param = _weight_of(router)
    if param is None:
        raise _Refuse("has no floating-point parameters")
    if param.device.type == "meta":
        raise _Indistinct("its parameters are on the meta device; load weights before attaching replay")
    extra = _extra_args(router, parent)
    layout = None if registered else layout_for(router, parent)
    run = call_forward if layout is None else layout.call
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    tokens = PROBE_TOKENS
    hidden_TH = torch.randn(tokens, hidden_size, generator=gen).to(param.device, key[0])
    with torch.no_grad(), _eval_mode(router):
        out = run(router, hidden_TH, extra)
        if layout is None:
            layout = locate_triple(out, tokens)
        layout.check(out, tokens)
        spread = layout.unpack(out)[0].float().std()
        if not torch.isfinite(spread) or spread == 0:
            raise _Indistinct(f"probe logits have spread {float(spread)}: router weights look uninitialised, no rule can be told apart")
        out = run(router, hidden_TH * (2.0 / spread).to(hidden_TH.dtype), extra)  # logits O(2): every rule's output differs
        logits_TE, _, ids_TK = layout.unpack(out)
    top = logits_TE.float().topk(min(ids_TK.shape[1] + 1, layout.experts), dim=-1).values  # ties below the top k+1 choose nothing
    distinct = (top.diff(dim=-1) != 0).all(-1).float().mean()
    if distinct < 0.5:
        raise _Indistinct(f"probe logits tie within the top k+1 in {1 - float(distinct):.0%} of rows; cannot verify a rule")
    return out, layout


def expert_scale_of(adapter: Any, router: nn.Module) -> torch.Tensor | None:
    """The per-expert weight scale `adapter` verified on `router` (GateSpec.expert_scale), read live; None for
    adapters that weigh by none (registered ones, and adapter kinds that have no `expert_scale`)."""
    read = getattr(adapter, "expert_scale", None)
    return None if read is None else read(router)


def _matches(spec: GateSpec, bias: Any, layout: Any, out: Any, scale: Any = None) -> str | None:
    """None when `spec`'s weights at the router's own ids, repacked in its output `out` (`layout`: its output
    convention, or a registered adapter), give `out` bit for bit and its selection the id sets; else what differs.
    `scale`: the router's per-expert scale, used where `spec.expert_scale`."""
    rule = GATE_RULES.get(spec.rule)
    logits_TE, weights_TK, ids_TK = layout.unpack(out)
    ids_TK = ids_TK.long()
    mine = layout.repack(out, logits_TE, rule.weights(logits_TE.detach(), ids_TK, spec, bias, scale if spec.expert_scale else None), ids_TK)
    mine_TK = layout.unpack(mine)[1]
    if not torch.equal(mine_TK, weights_TK):
        err = (mine_TK.float() - weights_TK.float()).abs().max().item()
        return f"weights differ in {int((mine_TK != weights_TK).any(-1).sum())}/{len(ids_TK)} probe rows (max abs error {err:.3g})"
    if (item := differs(layout, out, mine)) is not None:
        return f"the weights match but {item}"
    picked = _picked(rule, layout, logits_TE, spec, bias, scale if spec.expert_scale else None, weights_TK.dtype).sort(-1).values
    ids_sorted = ids_TK.sort(-1).values
    if not torch.equal(picked, ids_sorted):
        return f"{spec.rule} reproduces the weights but selects other experts in {int((picked != ids_sorted).any(-1).sum())}/{len(ids_TK)} rows"
    return None


def _picked(rule: Any, layout: Any, logits_TE: torch.Tensor, spec: GateSpec, bias: Any, scale: Any, dtype: torch.dtype) -> torch.Tensor:
    """The rule's free selection [T, K], read as the router's output convention reads HF's ids (outputs.seen_ids)."""
    picked_TK = rule.select(logits_TE.detach(), spec, bias)
    return seen_ids(layout, picked_TK, lambda: rule.weights(logits_TE.detach(), picked_TK, spec, bias, scale).to(dtype))


def _check_registered(router: nn.Module, adapter: Any, key: PrecisionKey, *, parent: nn.Module | None,
                      hidden_size: int) -> tuple[Any, bool]:
    """(the registered adapter, whether the probe verified it). Only weights that cannot tell rules apart
    (meta, uninitialised, tied logits) leave it unverified: it is probed again on the first forward of the
    context, and checked there against that forward's own router output either way. Any other probe
    failure (the router's forward raising on the probe, another output layout) refuses it."""
    try:
        out, _ = _probe(router, key, parent, hidden_size, registered=True)
    except _Indistinct:
        return adapter, False
    with torch.no_grad():
        why = _matches(adapter.spec(router), adapter.selection_bias(router), adapter, out, expert_scale_of(adapter, router))
    if why is not None:
        raise _Refuse(f"its registered rule ({adapter.describe()}) does not reproduce it: {why}")
    return adapter, True


_FP32_FORM: "weakref.WeakKeyDictionary[nn.Module, tuple[GateSpec, bool] | None]" = weakref.WeakKeyDictionary()
"""Router -> (spec, uses the bias) verified on an fp32 copy of it: the rule's form (renormalisation, epsilon,
scale, groups), which bf16 rounding can hide (LFM2's 1e-6 renorm epsilon is below bf16's resolution near 1)."""


def _fp32_form(router: nn.Module, *, family: str, config: Any, parent: nn.Module | None, hidden_size: int,
               key: PrecisionKey) -> tuple[GateSpec, bool] | None:
    """The rule form an fp32 copy of `router` verifies, outside autocast; None in fp32 itself or where none verifies."""
    if key[0] == key[1] == torch.float32 and key[3] is None:
        return None
    fp32 = (torch.float32, torch.float32, key[2], None)
    known = _VERIFIED.get(router, {}).get(fp32)
    if isinstance(known, InferredAdapter):  # verified on the router itself in fp32
        return known.gate_spec, known.bias_at is not None
    if router not in _FP32_FORM:
        try:
            with torch.autocast(key[2], enabled=False):
                a = _infer(copy.deepcopy(router).float(), family=family, config=config, parent=parent, hidden_size=hidden_size, key=fp32)
            _FP32_FORM[router] = (a.gate_spec, a.bias_at is not None)
        except _Refuse:
            _FP32_FORM[router] = None
    return _FP32_FORM[router]


_BIAS_SHIFT = 1.0
"""The selection bias is probed again lowered by this much: every kept expert's sigmoid score + bias then falls
below 0, so a rule that fills masked groups with -inf and one that fills them with 0 (AXK2) select differently
even where the loaded bias is positive (and a bias that drifts negative in training would tell them apart)."""


def _ids_with_bias_shift(router: nn.Module, key: PrecisionKey, parent: nn.Module | None, hidden_size: int,
                         bias: torch.Tensor) -> torch.Tensor:
    """The router's own ids on the probe with its selection bias lowered by _BIAS_SHIFT (restored after)."""
    saved = bias.detach().clone()
    try:
        with torch.no_grad():
            bias.sub_(_BIAS_SHIFT)
        out, layout = _probe(router, key, parent, hidden_size)
        return layout.unpack(out)[2].long()
    finally:
        with torch.no_grad():
            bias.copy_(saved)


def _probe_with_scale_shift(router: nn.Module, key: PrecisionKey, parent: nn.Module | None, hidden_size: int,
                            scale: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """(the router's probe output, the scale it ran with) with its per-expert scale multiplied by 0.5 .. 2 across the
    experts (restored after). Loaded scales are often all ones (Gemma 4 initialises them so), where a rule that
    ignores the scale and one that weighs by it agree; training moves them, so the probe tells the two apart now."""
    saved = scale.detach().clone()
    try:
        with torch.no_grad():
            scale.mul_(torch.linspace(0.5, 2.0, scale.numel()).view(scale.shape).to(scale.device, scale.dtype))
        out, _ = _probe(router, key, parent, hidden_size)
        return out, scale.detach().clone()
    finally:
        with torch.no_grad():
            scale.copy_(saved)


def _infer(router: nn.Module, *, family: str, config: Any, parent: nn.Module | None, hidden_size: int, key: PrecisionKey) -> InferredAdapter:
    out, layout = _probe(router, key, parent, hidden_size)
    experts = layout.experts
    logits_TE, weights_TK, ids_TK = layout.unpack(out)
    ids_TK = ids_TK.long()
    bias_at = _find_bias(router, parent, experts)
    bias = None if bias_at is None else _get_path(*bias_at)
    scale_at = _find_scale(router, experts)
    scale = None if scale_at is None else _get_path(router, scale_at)
    top_k = int(ids_TK.shape[1])
    upcasts = [True] if logits_TE.dtype == torch.float32 else [True, False]  # on fp32 logits both are the same arithmetic
    candidates = _candidates(router, config, top_k, experts, bias, upcasts, scale, layout.hints)
    form = _fp32_form(router, family=family, config=config, parent=parent, hidden_size=hidden_size, key=key)
    if form is not None:  # the fp32 form first: where bf16 cannot tell two forms apart, the one fp32 verified wins
        candidates.sort(key=lambda c: (replace(c[0], upcast=True), c[1]) != form)
    shifted = None if bias is None else _ids_with_bias_shift(router, key, parent, hidden_size, bias)
    rescaled = None if scale is None else _probe_with_scale_shift(router, key, parent, hidden_size, scale)
    near: list[str] = []
    with torch.no_grad():
        for spec, use_bias in candidates:
            b = bias if use_bias else None
            why = _matches(spec, b, layout, out, scale)
            if why is None and rescaled is not None:
                (r_out, r_scale) = rescaled
                why = _matches(spec, b, layout, r_out, r_scale)
                why = None if why is None else f"with its per-expert scale {scale_at!r} changed, {why}"
            if why is None and shifted is not None:
                picked = _picked(GATE_RULES.get(spec.rule), layout, logits_TE, spec, None if b is None else b - _BIAS_SHIFT,
                                 scale if spec.expert_scale else None, weights_TK.dtype)
                moved = int((picked.sort(-1).values != shifted.sort(-1).values).any(-1).sum())
                why = None if moved == 0 else (f"{spec.rule} reproduces the weights but, with the selection bias lowered by "
                                               f"{_BIAS_SHIFT:g}, selects other experts in {moved}/{len(ids_TK)} rows")
            if why is None:
                where = None if b is None else (weakref.ref(bias_at[0]), bias_at[1])
                scaled = (weakref.ref(router), scale_at) if spec.expert_scale else None
                return InferredAdapter(family, type(router).__name__, spec, layout, experts, where,
                                       scale_at=scaled)
            if "selects other experts" in why:
                near.append(why)
    if near:
        raise _Refuse("; ".join(dict.fromkeys(near)))
    best = _closest(logits_TE, ids_TK, weights_TK, router, config, top_k, experts, bias, upcasts, scale)
    raise _Refuse(f"no rule in the table reproduces its weights bit for bit on {len(ids_TK)} probe tokens ({best})")


def _closest(logits_TE, ids_TK, weights_TK, router, config, top_k, experts, bias, upcasts, scale=None) -> str:
    errs = []
    for spec, use_bias in _candidates(router, config, top_k, experts, bias, upcasts, scale):
        w = GATE_RULES.get(spec.rule).weights(logits_TE.detach(), ids_TK, spec, bias if use_bias else None,
                                              scale if spec.expert_scale else None).float()
        errs.append(((w - weights_TK.float()).abs().max().item(), spec.rule))
    err, rule = min(errs)
    return f"closest: {rule}, max abs weight error {err:.3g}"
