"""Router output conventions: where an HF router hands its experts the logits, weights and ids.

Replay hooks a router, unpacks (logits [T, E], weights [T, K], ids [T, K]) from what the MoE block
receives, and repacks the plan's ids with weights the verified gate rule computes from those logits.
Most HF routers return the three as one tuple in some order (`Triple`, located from the shapes). The
others keep their own convention, registered here by router class (config is data, behaviour
registered against it), each with its own unpack and repack:

- `DenseScores` (Llama 4): (scores [T, E], logits [T, E]); the scores are the K weights scattered at
  the ids and 0 elsewhere (HF: sigmoid of -inf), and the block weighs every expert's input by them.
- `SortedGates` (JetMoE): (index_sorted [T*K], batch_index [T*K], batch_gates [T*K], expert_size
  list[E] of ints, logits [T, E]): the top-k slots sorted by expert, as its parallel experts take them.
- `SkipClass` (ZAYA1): (logits [T, E+1], weights [T, K], ids [T, K], router state): class E is a skip
  expert (no compute), which HF hands its experts as expert 0 weighted 0; the state passes through
  (EDA hidden states for the next layer's router, computed before any selection).
- Inkling (v1) is refused by name: its weights and shared-expert gammas depend on shared logits it
  does not return.
- `ParentRouted` (DBRX): the router returns logits [T, E] only; its parent block's method
  `route_tokens_to_experts(logits) -> (weights, ids)` selects. Its hook patches that method on the
  parent instance (an instance attribute over the class's method), undone when the last hook goes.

A convention is verified as a whole: repacking HF's own ids with the rule's weights must give HF's
own output bit for bit, item by item (infer.py: at attach and on the first forward of each
precision context). A router whose output fits no convention is refused with what was found.

Legend: T tokens, E experts (router classes), K top-k, H hidden size.
"""

from __future__ import annotations

import importlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from moe_replay.registry import Registry


class Refusal(Exception):
    """Why a router cannot be replayed, in words (infer.py turns it into UnsupportedRouterError with the router's name)."""


Hook = Callable[[nn.Module, tuple, Any], Any]
"""(router, router args, output in the convention's form) -> the output to use instead, or None to keep it."""

_CLASSES: dict[tuple[str, str], type | None] = {}
"""(module, class name) -> class, or None where the installed transformers lacks it; looked up once per process."""


def lookup_class(module: str, class_name: str) -> type | None:
    """The class `class_name` of `module`, or None where that module or class does not exist (imported lazily, once)."""
    key = (module, class_name)
    if key not in _CLASSES:
        try:
            _CLASSES[key] = getattr(importlib.import_module(module), class_name, None)
        except ImportError:
            _CLASSES[key] = None
    return _CLASSES[key]


def call_forward(router: nn.Module, hidden_TH: torch.Tensor, extra: list[Any]):
    """The router's own forward, bypassing hooks (a replay or capture hook on it never sees a probe)."""
    try:
        return router.forward(hidden_TH, *extra)
    except Exception as first:  # some routers take [B, S, H] only
        try:
            return router.forward(hidden_TH.unsqueeze(0), *extra)
        except Exception:
            raise Refusal(f"forward on probe hidden states [{hidden_TH.shape[0]}, {hidden_TH.shape[1]}] raised "
                          f"{type(first).__name__}: {first}") from None


def _shapes(output) -> str:
    items = output if isinstance(output, (tuple, list)) else [output]
    return str([tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__ for o in items])


@dataclass(frozen=True)
class Triple:
    """(logits [T, E], weights [T, K], ids [T, K]) at the given positions of a tuple; other items pass through
    (only where a registered convention says they do not depend on the selection)."""

    logits_at: int
    weights_at: int
    ids_at: int
    n_outputs: int
    experts: int
    hints: dict = field(default_factory=dict)
    """GateSpec hints for the rule candidates (infer.py `_candidates`): ordering only, verification decides."""
    name: str = ""

    def call(self, router: nn.Module, hidden_TH: torch.Tensor, extra: list[Any]):
        return call_forward(router, hidden_TH, extra)

    def check(self, output, t: int) -> None:
        """Refusal unless `output` has this layout's items with T = `t` rows."""
        ok = isinstance(output, (tuple, list)) and len(output) == self.n_outputs and all(
            isinstance(output[i], torch.Tensor) and output[i].dim() == 2 and output[i].shape[0] == t
            for i in (self.logits_at, self.weights_at, self.ids_at))
        if not ok or output[self.logits_at].shape[1] != self.experts or output[self.ids_at].is_floating_point():
            raise Refusal(f"returns {_shapes(output)}; its convention ({self.describe()}) expects {self.n_outputs} items with "
                          f"logits [T={t}, E={self.experts}] at {self.logits_at}, weights [T, K] at {self.weights_at}, "
                          f"integer ids [T, K] at {self.ids_at}")

    def unpack(self, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return output[self.logits_at], output[self.weights_at], output[self.ids_at]

    def repack(self, output, logits_TE: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor):
        """The router's output with replayed weights, in the dtype of HF's own weights in this call, and ids in HF's dtype."""
        items = list(output)
        items[self.logits_at] = logits_TE
        items[self.weights_at] = weights_TK.to(output[self.weights_at].dtype)
        items[self.ids_at] = ids_TK.to(output[self.ids_at].dtype)
        return type(output)(items) if isinstance(output, tuple) else items

    def register_hook(self, router: nn.Module, hook: Hook):
        return router.register_forward_hook(hook)

    def describe(self) -> str:
        return self.name or "(logits, weights, ids)"


def locate_triple(output, t: int) -> Triple:
    """The positions of (logits, weights, ids) in a router's output of exactly those three, from their shapes."""
    if not isinstance(output, (tuple, list)) or not all(isinstance(o, torch.Tensor) for o in output):
        kind = type(output).__name__ if not isinstance(output, (tuple, list)) else f"{len(output)} items incl. non-tensors"
        raise Refusal(f"returns {kind}; replay needs (router logits [T, E], weights [T, K], ids [T, K]), or an output "
                      f"convention registered for its class (integrations.hf.outputs.register_output)")
    shapes = [tuple(o.shape) for o in output]
    if len(output) != 3:
        raise Refusal(f"returns {len(output)} tensors {shapes}; replay needs exactly (logits [T, E], weights [T, K], ids [T, K]), "
                      f"or an output convention registered for its class (integrations.hf.outputs.register_output)")
    ids = [i for i, o in enumerate(output) if not o.is_floating_point() and o.dim() == 2 and o.shape[0] == t]
    floats = [i for i, o in enumerate(output) if o.is_floating_point() and o.dim() == 2 and o.shape[0] == t]
    if len(ids) != 1 or len(floats) != 2:
        raise Refusal(f"returns shapes {shapes} dtypes {[str(o.dtype) for o in output]}; expected one integer [T={t}, K] and two float [T, *] tensors")
    k = output[ids[0]].shape[1]
    w = [i for i in floats if output[i].shape[1] == k]
    lg = [i for i in floats if output[i].shape[1] != k]
    if len(w) != 1 or len(lg) != 1:
        raise Refusal(f"returns shapes {shapes}; cannot tell logits [T, E] from weights [T, K={k}] (E == K?)")
    return Triple(lg[0], w[0], ids[0], 3, int(output[lg[0]].shape[1]))


@dataclass(frozen=True)
class SkipClass(Triple):
    """A Triple whose last router class `skip` is a no-compute expert, handed to the experts as id 0 weighted 0.

    Unpacked ids say `skip` where HF's say 0 with weight exactly 0. A chosen expert 0 whose softmax weight
    underflows to 0 reads as a skip too (both reach the experts as id 0 weighted 0: the same MoE output and
    gradient); a rule's own selection is read the same way before it is compared (`seen_ids`)."""

    skip: int = -1

    def canonical_ids(self, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """`ids_TK` with every id-0 slot weighted exactly 0 read as the skip class: the experts receive the two alike."""
        return ids_TK.masked_fill((ids_TK == 0) & (weights_TK == 0), self.skip)

    def unpack(self, output):
        logits_TE, weights_TK, ids_TK = super().unpack(output)
        return logits_TE, weights_TK, self.canonical_ids(ids_TK, weights_TK)

    def repack(self, output, logits_TE, weights_TK, ids_TK):
        skip_TK = ids_TK == self.skip
        return super().repack(output, logits_TE, weights_TK.masked_fill(skip_TK, 0), ids_TK.masked_fill(skip_TK, 0))

    def describe(self) -> str:
        return f"(logits, weights, ids, ...) with skip class {self.skip}"


@dataclass(frozen=True)
class DenseScores:
    """(scores [T, E] at `scores_at`, logits [T, E] at `logits_at`): the weights scattered at the ids, 0 elsewhere.

    The ids are the top-k of the logits, the same `torch.topk` call on the same tensor as HF's router makes
    (exact, where reading the nonzero scores would lose a weight that underflows to 0)."""

    scores_at: int
    logits_at: int
    top_k: int
    experts: int
    hints: dict = field(default_factory=dict)

    def call(self, router, hidden_TH, extra):
        return call_forward(router, hidden_TH, extra)

    def check(self, output, t: int) -> None:
        ok = isinstance(output, (tuple, list)) and len(output) == 2 and all(
            isinstance(o, torch.Tensor) and o.is_floating_point() and tuple(o.shape) == (t, self.experts) for o in output)
        if not ok:
            raise Refusal(f"returns {_shapes(output)}; its convention ({self.describe()}) expects two float tensors [T={t}, E={self.experts}]")

    def unpack(self, output):
        logits_TE, scores_TE = output[self.logits_at], output[self.scores_at]
        ids_TK = torch.topk(logits_TE.detach(), self.top_k, dim=1).indices
        return logits_TE, scores_TE.gather(1, ids_TK), ids_TK

    def repack(self, output, logits_TE, weights_TK, ids_TK):
        scores_TE = output[self.scores_at]
        items = list(output)
        items[self.scores_at] = torch.zeros_like(scores_TE).scatter(1, ids_TK.long(), weights_TK.to(scores_TE.dtype))
        items[self.logits_at] = logits_TE
        return type(output)(items) if isinstance(output, tuple) else items

    def register_hook(self, router, hook):
        return router.register_forward_hook(hook)

    def describe(self) -> str:
        return "dense scores [T, E]"


@dataclass(frozen=True)
class SortedGates:
    """JetMoE's (index_sorted [T*K], batch_index [T*K], batch_gates [T*K], expert_size list[E], logits [T, E]).

    index_sorted orders the flattened [T*K] top-k slots by expert (`ids.flatten().sort(0)`, int64 as HF's
    topk ids are: an unstable sort orders equal keys by dtype-specific code), batch_index is each slot's
    token, batch_gates its weight, expert_size the slots per expert."""

    top_k: int
    experts: int
    hints: dict = field(default_factory=dict)

    def call(self, router, hidden_TH, extra):
        return call_forward(router, hidden_TH, extra)

    def check(self, output, t: int) -> None:
        n = t * self.top_k
        ok = (isinstance(output, (tuple, list)) and len(output) == 5
              and all(isinstance(output[i], torch.Tensor) and tuple(output[i].shape) == (n,) for i in range(3))
              and isinstance(output[3], list) and len(output[3]) == self.experts
              and isinstance(output[4], torch.Tensor) and tuple(output[4].shape) == (t, self.experts))
        if not ok:
            raise Refusal(f"returns {_shapes(output)}; its convention ({self.describe()}) expects 3 tensors [T*K={n}], a list of "
                          f"E={self.experts} ints and logits [T={t}, E]")

    def unpack(self, output):
        index_sorted, _, gates, sizes, logits_TE = output
        t = logits_TE.shape[0]
        expert_of_slot = torch.repeat_interleave(torch.arange(self.experts, device=index_sorted.device),
                                                 torch.tensor(sizes, device=index_sorted.device))
        ids = torch.empty_like(index_sorted).scatter(0, index_sorted, expert_of_slot)
        weights = torch.zeros_like(gates).scatter(0, index_sorted, gates)
        return logits_TE, weights.view(t, -1), ids.view(t, -1)

    def repack(self, output, logits_TE, weights_TK, ids_TK):
        t, k = ids_TK.shape
        gates_TK = weights_TK.to(output[2].dtype)
        ids_TK = ids_TK.long()
        chosen_TE = torch.zeros(t, self.experts, dtype=gates_TK.dtype, device=ids_TK.device).scatter(1, ids_TK, 1)
        sizes = chosen_TE.long().sum(0).tolist()
        index_sorted = ids_TK.flatten().sort(0)[1]
        batch_index = index_sorted.div(k, rounding_mode="trunc")
        return index_sorted, batch_index, gates_TK.flatten()[index_sorted], sizes, logits_TE

    def register_hook(self, router, hook):
        return router.register_forward_hook(hook)

    def describe(self) -> str:
        return "expert-sorted slots"


class _MethodHooks:
    """Hooks on one parent block's routing method: the method patched on the instance while any hook is on it.

    The router's forward pre-hook keeps its arguments for the hooks (they see them as a forward hook would);
    the patch calls the method as it was (the class's, or an earlier instance attribute), hands each hook
    (router, router args, (logits, weights, ids)) and returns (weights, ids) of the last hook's answer."""

    def __init__(self, parent: nn.Module, method: str, router: nn.Module) -> None:
        self.parent, self.method, self.router = weakref.ref(parent), method, weakref.ref(router)
        self.had = method in parent.__dict__
        self.saved = parent.__dict__.get(method)
        self.original = getattr(parent, method)
        self.hooks: dict[int, Hook] = {}
        self.args: tuple = ()
        self.pre = router.register_forward_pre_hook(self._keep_args)
        parent.__dict__[method] = self._routed

    def _keep_args(self, module, args):
        self.args = args

    def _routed(self, logits_TE, *rest, **kwargs):
        weights_TK, ids_TK = self.original(logits_TE, *rest, **kwargs)
        output, args, self.args = (logits_TE, weights_TK, ids_TK), self.args, ()
        router = self.router()
        for hook in list(self.hooks.values()):
            new = hook(router, args, output)
            output = output if new is None else new
        return output[1], output[2]

    def remove(self, key: int) -> None:
        self.hooks.pop(key, None)
        parent = self.parent()
        if self.hooks or parent is None:
            return
        self.pre.remove()
        if self.had:
            parent.__dict__[self.method] = self.saved
        else:
            parent.__dict__.pop(self.method, None)
        _PATCHED.pop(parent, None)


_PATCHED: "weakref.WeakKeyDictionary[nn.Module, _MethodHooks]" = weakref.WeakKeyDictionary()
"""Parent block -> the hooks on its patched routing method."""


class _Handle:
    def __init__(self, hooks: _MethodHooks, key: int) -> None:
        self._hooks, self._key = hooks, key

    def remove(self) -> None:
        self._hooks.remove(self._key)


@dataclass(frozen=True)
class ParentRouted:
    """The router returns logits [T, E]; `parent.<method>(logits)` returns (weights [T, K], ids [T, K]) (DBRX).

    In the hook's view the output is (logits, weights, ids); `call` runs the router's forward and then the
    method as the parent's class defines it (never an instance patch, so a probe inside a hooked forward
    does not re-enter the hooks)."""

    parent: Any
    """weakref to the parent block."""
    method: str
    experts: int
    hints: dict = field(default_factory=dict)

    def _parent(self) -> nn.Module:
        parent = self.parent()
        if parent is None:
            raise Refusal(f"its parent block (which routes its logits with {self.method}) no longer exists")
        return parent

    def call(self, router, hidden_TH, extra):
        logits_TE = call_forward(router, hidden_TH, extra)
        if not isinstance(logits_TE, torch.Tensor):
            raise Refusal(f"returns {_shapes(logits_TE)}; its convention ({self.describe()}) expects logits [T, E]")
        parent = self._parent()
        weights_TK, ids_TK = getattr(type(parent), self.method)(parent, logits_TE)
        return logits_TE, weights_TK, ids_TK

    def check(self, output, t: int) -> None:
        Triple(0, 1, 2, 3, self.experts).check(output, t)

    def unpack(self, output):
        return output[0], output[1], output[2]

    def repack(self, output, logits_TE, weights_TK, ids_TK):
        return logits_TE, weights_TK.to(output[1].dtype), ids_TK.to(output[2].dtype)

    def register_hook(self, router, hook):
        parent = self._parent()
        hooks = _PATCHED.get(parent)
        if hooks is None:
            hooks = _PATCHED[parent] = _MethodHooks(parent, self.method, router)
        key = max(hooks.hooks, default=-1) + 1
        hooks.hooks[key] = hook
        return _Handle(hooks, key)

    def describe(self) -> str:
        return f"logits, routed by the parent's {self.method}"


@dataclass(frozen=True)
class OutputConvention:
    """An HF router class whose output is not a plain (logits, weights, ids) tuple, and how to read it."""

    family: str
    module: str
    class_name: str
    layout: Callable[[nn.Module, "nn.Module | None"], Any]
    """(router, its parent block) -> the layout of this router instance's output."""


OUTPUT_CONVENTIONS: Registry[OutputConvention] = Registry("HF router output convention")


def register_output(convention: OutputConvention) -> OutputConvention:
    OUTPUT_CONVENTIONS.add(convention.family, convention)
    return convention


def layout_for(router: nn.Module, parent: nn.Module | None) -> Any:
    """The registered layout of `router`'s output, or None (a plain tuple, located from the probe's shapes)."""
    for name in OUTPUT_CONVENTIONS:
        conv = OUTPUT_CONVENTIONS.get(name)
        cls = lookup_class(conv.module, conv.class_name)
        if cls is not None and isinstance(router, cls):
            return conv.layout(router, parent)
    return None


def _dbrx(router: nn.Module, parent: nn.Module | None) -> ParentRouted:
    if parent is None or not callable(getattr(type(parent), "route_tokens_to_experts", None)):
        raise Refusal(f"its parent block ({type(parent).__name__}) has no route_tokens_to_experts(logits) -> (weights, ids)")
    p = getattr(parent, "moe_normalize_expert_weights", None)
    return ParentRouted(weakref.ref(parent), "route_tokens_to_experts", int(router.layer.out_features),
                        {} if p is None else {"renorm_p": float(p)})


_M = "transformers.models"
register_output(OutputConvention(
    "llama4", f"{_M}.llama4.modeling_llama4", "Llama4Router",
    lambda r, p: DenseScores(0, 1, int(r.top_k), int(r.num_experts), {"rule": "topk_sigmoid"})))
register_output(OutputConvention("dbrx", f"{_M}.dbrx.modeling_dbrx", "DbrxRouter", _dbrx))
register_output(OutputConvention(
    "jetmoe", f"{_M}.jetmoe.modeling_jetmoe", "JetMoeTopKGating", lambda r, p: SortedGates(int(r.top_k), int(r.num_experts))))
register_output(OutputConvention(
    "zaya", f"{_M}.zaya.modeling_zaya", "ZayaRouter",
    lambda r, p: SkipClass(0, 1, 2, 4, int(r.num_experts) + 1, {"renormalize": False}, skip=int(r.num_experts))))
"""ZAYA1 weighs by the softmax over its E+1 classes, never renormalised: its router MLP normalises its input (RMSNorm),
so probe hidden states cannot be scaled to bring its logits to O(2), and on saturated probabilities a renormalising
rule matches too; the hint orders them, the first forward's own output decides (infer.py `_check_output`)."""


def seen_ids(layout: Any, ids_TK: torch.Tensor, weights_TK: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`ids_TK` as the layout reports ids its router hands its experts with `weights_TK()` (called only where the
    convention reads ids by their weights: ZAYA1's skip class)."""
    canonical = getattr(layout, "canonical_ids", None)
    return ids_TK if canonical is None else canonical(ids_TK, weights_TK())


def _inkling(router: nn.Module, parent: nn.Module | None) -> Any:
    raise Refusal(
        "it weighs its K routed experts jointly with its shared experts, by a softmax over the log-sigmoids of the chosen "
        "routed logits and of the shared experts' logits, times a learned global_scale, and returns its shared experts' "
        "gammas from that same softmax: both change with the chosen ids, and both depend on shared logits [T, S] it "
        "does not return (its output is routed logits [T, E], weights [T, K], ids [T, K], gammas [T, S]); no gate rule "
        "computes weights from the returned logits alone")


register_output(OutputConvention("inkling", f"{_M}.inkling.modeling_inkling", "InklingTopkRouter", _inkling))


def differs(layout: Any, output, mine) -> str | None:
    """None where `mine` (a repack of `output`) equals it bit for bit, item by item; else which item differs."""
    items = list(output) if isinstance(output, (tuple, list)) else [output]
    others = list(mine) if isinstance(mine, (tuple, list)) else [mine]
    for i, (a, b) in enumerate(zip(items, others)):
        if isinstance(a, torch.Tensor):
            same = isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b.to(a.dtype))
        else:
            same = a == b
        if not same:
            return f"item {i} of its output ({_shapes([a])[1:-1]}) differs from HF's"
    return None
