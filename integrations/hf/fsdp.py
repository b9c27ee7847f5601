"""FSDP2 (`torch.distributed.fsdp.fully_shard`) as the router probes need it: the parameters a forward sees.

Outside its forward an FSDP2 module holds each parameter as a DTensor shard of the stored dtype (fp32 in
verl's default); its pre-forward all-gathers them into plain tensors of the MixedPrecisionPolicy's
`param_dtype` (bf16 in verl's default), and its post-forward shards them again. A router probed outside
that window would multiply plain probe hidden states by a DTensor shard (`aten.mm.default got mixed
torch.Tensor and DTensor`) in the wrong dtype. `unsharded` opens the same window on the router's owning
FSDP2 module with its own `unshard()` / `reshard()` (a collective: every rank attaches the same model in
the same order, so every rank issues the same all-gathers), and `forward_dtype` says which dtype a
parameter takes in the forward, so attach verifies the precision context the forward will run in.
torch.distributed is imported only where a model holds DTensors.

Attach probes are the same on every rank (seeded probe states, the same gathered weights), so every rank
accepts or refuses together. The first-forward check against the forward's own router output reads each
rank's own batch: where a rule fails there on one rank only, that rank raises and the others wait in their
next collective until the process group's timeout.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(tensor: torch.Tensor | None) -> bool:
    """Whether `tensor` is a DTensor (an FSDP2 shard, or another DTensor layout)."""
    dtensor = _dtensor_type()
    return tensor is not None and dtensor is not None and isinstance(tensor, dtensor)


def sharded_params(module: nn.Module) -> list[str]:
    """Names of `module`'s parameters held as DTensors right now (empty inside an FSDP2 forward)."""
    return [n for n, p in module.named_parameters() if is_sharded(p)]


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether `fully_shard` was applied to `module`."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def fsdp_owner(modules: dict[str, nn.Module], name: str) -> nn.Module | None:
    """The FSDP2 module that manages the parameters of the module named `name` in `modules`
    (`model.named_modules()`): the nearest module, itself or an ancestor, that `fully_shard` wrapped."""
    parts = name.split(".") if name else []
    for end in range(len(parts), -1, -1):
        module = modules.get(".".join(parts[:end]))
        if module is not None and is_fsdp_module(module):
            return module
    return None


def forward_dtype(owner: nn.Module | None, param: torch.Tensor) -> torch.dtype:
    """The dtype `param` has inside its owner's forward: the FSDP2 MixedPrecisionPolicy's `param_dtype`
    where one is set (FSDP2 all-gathers floating parameters in it), else the stored dtype."""
    if owner is None or not is_fsdp_module(owner) or not param.is_floating_point():
        return param.dtype
    policy = getattr(owner._get_fsdp_state(), "_mp_policy", None)
    param_dtype = getattr(policy, "param_dtype", None)
    return param_dtype if param_dtype is not None else param.dtype


@contextlib.contextmanager
def unsharded(module: nn.Module, owner: nn.Module | None, where: str) -> Iterator[None]:
    """`module`'s parameters as its FSDP2 owner's forward sees them, for the duration; a no-op where none is
    sharded (an unsharded model, or inside the owner's forward). Raises ValueError (the caller's refusal)
    where DTensor parameters have no FSDP2 owner to gather them (tensor parallel, say)."""
    sharded = sharded_params(module)
    if not sharded:
        yield
        return
    if owner is None or not is_fsdp_module(owner):
        raise ValueError(f"its parameters {sharded[:3]} are DTensors that no FSDP2 module (fully_shard) around {where} "
                         "manages: replay can gather FSDP2 shards only, not other DTensor layouts (tensor parallel)")
    owner.unshard()
    try:
        left = sharded_params(module)
        if left:
            raise ValueError(f"its parameters {left[:3]} are still DTensors after {type(owner).__name__}.unshard(): "
                             "they belong to another FSDP2 module than the nearest fully_shard one around it")
        yield
    finally:
        owner.reshard()


@contextlib.contextmanager
def shards_kept(model: nn.Module) -> Iterator[None]:
    """Leaves `model`'s FSDP2 parameters sharded as it found them, after forwards without a backward.

    FSDP2 does not reshard the root module after its forward (the backward would gather it again at
    once), so a forward under no_grad leaves the root's parameters gathered until the next backward:
    at Qwen3's vocabulary the embedding and LM head, 2 x 151,936 x 4,096 bf16 = 2.5 GB on every rank.
    verl's own eval context reshards the root on exit for the same reason; this does it for a caller
    (the audit) that forwards outside one. Resharding is local to each rank (no collective)."""
    before = set(sharded_params(model))
    try:
        yield
    finally:
        if before and not before <= set(sharded_params(model)):
            for module in model.modules():
                if is_fsdp_module(module):
                    module.reshard()
