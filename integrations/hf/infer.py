"""Gate rules for HF routers nobody registered: inferred from the router and config, verified bit for bit.

A registered RouterAdapter (routers.py) is the explicit path. For any other module that looks like
an MoE router, `infer_adapter` reads hints from the router's attributes and the model config
(scoring function, a selection-only bias, expert groups, norm_topk_prob, a scaling factor), lists
the rule table's candidates those hints allow, and verifies them on the router itself before any
forward: the router is run on probe hidden states, and a candidate is accepted only if, given the
router's own ids, it reproduces the router's own weights bit for bit (`torch.equal`, in the
router's output dtype) and its free selection reproduces the router's id sets. A router that no
candidate reproduces, whose output is not (logits [T, E], weights [T, K], ids [T, K]) in some order,
or whose logits are degenerate on the probe (uninitialised weights cannot tell rules apart) is
refused by name with what did not match.

Legend: T probe tokens, E experts, K top-k.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moe_replay.replay.errors import UnsupportedRouterError
from moe_replay.replay.gates import GATE_RULES, GateSpec

PROBE_TOKENS = 64
"""Probe rows: enough that a wrong renormalisation, scale or epsilon shows in some bit of some row."""
_PROBE_SEED = 1234
_BIAS_NAMES = ("e_score_correction_bias", "expert_bias", "balancing_biases")
"""Tensors (on the router, its submodules or its parent block) that take part in selection only."""
_SCALE_NAMES = ("routed_scaling_factor", "route_scale", "router_scaling_factor")


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
    logits_at: int
    weights_at: int
    ids_at: int
    n_outputs: int
    experts: int
    weights_dtype_from: str
    """"logits": weights come back in the logits dtype; "float32": always fp32."""
    bias_at: tuple[Any, str] | None = None
    """(weakref to the module holding it, attribute path) of the selection-only bias the verified
    selection used; read at each call, so a later .to(device) or checkpoint load is seen."""

    @property
    def rule(self) -> str:
        return self.gate_spec.rule

    @property
    def weights_in_logits_dtype(self) -> bool:
        return self.weights_dtype_from == "logits"

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

    def unpack(self, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return output[self.logits_at], output[self.weights_at], output[self.ids_at]

    def repack(self, output, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """The router's output with replayed weights (cast as verified on the probe) and ids."""
        weights = weights.to(logits.dtype if self.weights_in_logits_dtype else torch.float32)
        items = list(output)
        items[self.logits_at], items[self.weights_at], items[self.ids_at] = logits, weights, ids
        return type(output)(items) if isinstance(output, tuple) else items

    def describe(self) -> str:
        s = self.gate_spec
        parts = [s.rule]
        if s.rule != "topk_softmax":
            parts.append("renorm" if s.renormalize else "no-renorm")
        if s.renorm_eps is not None:
            parts.append(f"eps={s.renorm_eps:g}")
        if s.routed_scaling_factor != 1.0:
            parts.append(f"scale={s.routed_scaling_factor:g}")
        if s.rule == "sigmoid_bias_group" and s.scoring != "sigmoid":
            parts.append(s.scoring)
        if self.bias_at is not None:
            parts.append("bias")
        if s.num_groups > 1:
            parts.append(f"groups={s.num_groups}/{s.topk_group}({s.group_score})")
        return " ".join(parts)


class _Refuse(Exception):
    pass


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


def _call(router: nn.Module, hidden_TH: torch.Tensor, extra: list[Any]):
    try:
        return router(hidden_TH, *extra)
    except Exception as first:  # some routers take [B, S, H] only
        try:
            return router(hidden_TH.unsqueeze(0), *extra)
        except Exception:
            raise _Refuse(f"forward on probe hidden states [{hidden_TH.shape[0]}, {hidden_TH.shape[1]}] raised {type(first).__name__}: {first}") from None


def _layout(output, t: int) -> tuple[int, int, int, int]:
    """Positions of (logits, weights, ids) in the router's output and E."""
    if not isinstance(output, (tuple, list)) or not all(isinstance(o, torch.Tensor) for o in output):
        kind = type(output).__name__ if not isinstance(output, (tuple, list)) else f"{len(output)} items incl. non-tensors"
        raise _Refuse(f"returns {kind}; replay needs (router logits [T, E], weights [T, K], ids [T, K])")
    shapes = [tuple(o.shape) for o in output]
    if len(output) != 3:
        raise _Refuse(f"returns {len(output)} tensors {shapes}; replay needs exactly (logits [T, E], weights [T, K], ids [T, K])")
    ids = [i for i, o in enumerate(output) if not o.is_floating_point() and o.dim() == 2 and o.shape[0] == t]
    floats = [i for i, o in enumerate(output) if o.is_floating_point() and o.dim() == 2 and o.shape[0] == t]
    if len(ids) != 1 or len(floats) != 2:
        raise _Refuse(f"returns shapes {shapes} dtypes {[str(o.dtype) for o in output]}; expected one integer [T={t}, K] and two float [T, *] tensors")
    k = output[ids[0]].shape[1]
    w = [i for i in floats if output[i].shape[1] == k]
    lg = [i for i in floats if output[i].shape[1] != k]
    if len(w) != 1 or len(lg) != 1:
        raise _Refuse(f"returns shapes {shapes}; cannot tell logits [T, E] from weights [T, K={k}] (E == K?)")
    return lg[0], w[0], ids[0], int(output[lg[0]].shape[1])


def _ordered(hint: Any, options: list) -> list:
    """`options` with the hinted value first: hints order the candidates, verification decides."""
    return [hint] + [o for o in options if o != hint] if hint in options else options


def _candidates(router: nn.Module, config: Any, top_k: int, experts: int, bias: Any) -> list[tuple[GateSpec, bool]]:
    """Rule-table candidates, the ones the hints name first: (spec, use the bias in selection)."""
    objs = [router, config]
    norm = _first_attr(objs, ("norm_topk_prob",))
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
        group_opts = [dict(num_groups=groups, topk_group=min(topk_group, groups), group_score=score), {}]
    rules = [("softmax_topk", {}), ("topk_softmax", {}), ("sigmoid_bias_group", {"scoring": "sigmoid"})]
    if scoring_hint == "sqrtsoftplus":
        rules = [("sigmoid_bias_group", {"scoring": "sqrtsoftplus"})]
    elif scoring_hint == "sigmoid":
        rules = rules[2:] + rules[:2]
    out: list[tuple[GateSpec, bool]] = []
    for rule, extra in rules:
        for renorm in renorms if rule != "topk_softmax" else [False]:
            for eps in [None, 1e-6] if renorm else [None]:
                for scale_ in scales:
                    for g in group_opts:
                        for use_bias in [True, False] if bias is not None else [False]:
                            spec = GateSpec(rule, top_k=top_k, renormalize=renorm, routed_scaling_factor=scale_, renorm_eps=eps, **extra, **g)
                            out.append((spec, use_bias))
    return out


_VERIFIED: "weakref.WeakKeyDictionary[nn.Module, tuple[Any, InferredAdapter]]" = weakref.WeakKeyDictionary()
"""Router -> (dtype, device, adapter) verified on it: the rule depends on the router's code, config and
dtype, not on its weight values, so one probe per router (per dtype and device) is enough."""


def infer_adapter(router: nn.Module, *, family: str, where: str, config: Any, parent: nn.Module | None, hidden_size: int) -> InferredAdapter:
    """The verified adapter for `router`, or UnsupportedRouterError naming family, layer and reason."""
    param = next((p for p in router.parameters() if p.is_floating_point()), None)
    key = None if param is None else (param.dtype, param.device)
    hit = _VERIFIED.get(router)
    if hit is not None and hit[0] == key:
        return hit[1]
    try:
        adapter = _infer(router, family=family, config=config, parent=parent, hidden_size=hidden_size)
    except _Refuse as why:
        raise UnsupportedRouterError(f"{family}: router {where!r} ({type(router).__name__}) cannot be replayed: {why}") from None
    _VERIFIED[router] = (key, adapter)
    return adapter


def _infer(router: nn.Module, *, family: str, config: Any, parent: nn.Module | None, hidden_size: int) -> InferredAdapter:
    param = next((p for p in router.parameters() if p.is_floating_point()), None)
    if param is None:
        raise _Refuse("has no floating-point parameters")
    if param.device.type == "meta":
        raise _Refuse("its parameters are on the meta device; load weights before attaching replay")
    extra = _extra_args(router, parent)
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    hidden_TH = torch.randn(PROBE_TOKENS, hidden_size, generator=gen).to(param.device, param.dtype)
    with torch.no_grad():
        out = _call(router, hidden_TH, extra)
        logits_at, weights_at, ids_at, experts = _layout(out, PROBE_TOKENS)
        spread = out[logits_at].float().std()
        if not torch.isfinite(spread) or spread == 0:
            raise _Refuse(f"probe logits have spread {float(spread)}: router weights look uninitialised, no rule can be told apart")
        out = _call(router, hidden_TH * (2.0 / spread).to(hidden_TH.dtype), extra)  # logits O(2): every rule's output differs
    logits_TE, weights_TK, ids_TK = out[logits_at], out[weights_at], out[ids_at].long()
    distinct = (logits_TE.sort(-1).values.diff(dim=-1) != 0).all(-1).float().mean()
    if distinct < 0.5:
        raise _Refuse(f"probe logits tie in {1 - float(distinct):.0%} of rows; cannot verify a rule")
    if weights_TK.dtype == logits_TE.dtype:
        dtype_from = "logits"
    elif weights_TK.dtype == torch.float32:
        dtype_from = "float32"
    else:
        raise _Refuse(f"returns weights in {weights_TK.dtype}, neither its logits dtype ({logits_TE.dtype}) nor float32")
    bias_at = _find_bias(router, parent, experts)
    bias = None if bias_at is None else _get_path(*bias_at)
    top_k = int(ids_TK.shape[1])
    ids_sorted = ids_TK.sort(-1).values
    near: list[str] = []
    for spec, use_bias in _candidates(router, config, top_k, experts, bias):
        rule, b = GATE_RULES.get(spec.rule), (bias if use_bias else None)
        mine_TK = rule.weights(logits_TE.detach(), ids_TK, spec, b).to(weights_TK.dtype)
        if not torch.equal(mine_TK, weights_TK):
            continue
        picked = rule.select(logits_TE.detach(), spec, b).sort(-1).values
        if not torch.equal(picked, ids_sorted):
            near.append(f"{spec.rule} reproduces the weights but selects other experts in {int((picked != ids_sorted).any(-1).sum())}/{PROBE_TOKENS} rows")
            continue
        where = None if b is None else (weakref.ref(bias_at[0]), bias_at[1])
        return InferredAdapter(family, type(router).__name__, spec, logits_at, weights_at, ids_at, len(out), experts, dtype_from, where)
    if near:
        raise _Refuse("; ".join(dict.fromkeys(near)))
    best = _closest(logits_TE, ids_TK, weights_TK, router, config, top_k, experts, bias)
    raise _Refuse(f"no rule in the table reproduces its weights bit for bit on {PROBE_TOKENS} probe tokens ({best})")


def _closest(logits_TE, ids_TK, weights_TK, router, config, top_k, experts, bias) -> str:
    errs = []
    for spec, use_bias in _candidates(router, config, top_k, experts, bias):
        w = GATE_RULES.get(spec.rule).weights(logits_TE.detach(), ids_TK, spec, bias if use_bias else None).float()
        errs.append(((w - weights_TK.float()).abs().max().item(), spec.rule))
    err, rule = min(errs)
    return f"closest: {rule}, max abs weight error {err:.3g}"
