"""The device a torch.distributed process group's collectives take, for every collective the project issues.

A process group serves the device types its backends were set up for: `init_process_group("nccl")`
(Megatron-LM's default) serves "cuda" only, so a collective on CPU tensors over it raises "No
backend type associated with device type cpu"; "gloo" serves "cpu" and "cuda"; "cpu:gloo,cuda:nccl"
serves each through its own backend. `collective_device(group)` answers from the group's backend
configuration (`torch.distributed.get_backend_config`, public), falling back to the group's own
`_device_types` (internal, for a group torch's registry does not hold), and raises
`CollectiveDeviceError` when neither names a device. `on_collective_device(x, group)` copies a
tensor there only when the group does not serve the tensor's own device.

Every collective in moe_replay (the Megatron allgather shape check, vocabulary-parallel scoring)
places its tensors with these two; tests/test_collectives.py checks the choice on a group whose
only backend serves an accelerator ("cuda:gloo", NCCL's shape, on a CPU build).
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import MoeReplayError, Where

__all__ = ["CollectiveDeviceError", "collective_device", "group_device_types", "on_collective_device"]


class CollectiveDeviceError(MoeReplayError, RuntimeError):
    """A process group whose backends name no device type a collective could use."""

    def __init__(self, where: Where, expected: Any, found: Any, detail: str = "") -> None:
        self.where, self.expected, self.found, self.detail = where, expected, found, detail
        msg = f"{where}: expected {expected}, found {found}"
        super().__init__(f"{msg} ({detail})" if detail else msg)

    def __reduce__(self):  # picklable across spawned ranks
        return (type(self), (self.where, self.expected, self.found, self.detail))


def _group_name(group: Any) -> str:
    name = getattr(group, "group_name", None) if group is not None else "default"
    return f"process group {name or type(group).__name__}"


def group_device_types(group: Any = None) -> tuple[str, ...]:
    """Device types ("cpu", "cuda", ...) the group's backends serve, in its configuration's order
    (None: the default group). Empty when neither the public backend configuration nor the
    group's `_device_types` names one."""
    import torch.distributed as dist

    try:  # "cuda:nccl" / "cpu:gloo,cuda:gloo" / "cpu:gloo,cuda:nccl"
        config = str(dist.get_backend_config(group))
        types = tuple(dict.fromkeys(pair.split(":", 1)[0].strip() for pair in config.split(",") if ":" in pair))
        if types:
            return types
    except (ValueError, KeyError, RuntimeError, AttributeError, TypeError):
        pass  # a group outside torch's registry: ask the group itself
    target = group if group is not None else dist.distributed_c10d._get_default_group()
    devices = getattr(target, "_device_types", None) or ()
    return tuple(dict.fromkeys(torch.device(d).type for d in devices))


def collective_device(group: Any = None, prefer: torch.device | str | None = None) -> torch.device:
    """The device to put a collective's tensors on for `group` (None: the default group).

    `prefer` (a tensor's own device) wins when the group serves its type, so a tensor already there
    is not copied; otherwise "cpu" when the group serves it (host integers need no copy), else the
    group's first device type, with the current accelerator's index when that type is the current
    accelerator (NCCL needs each rank's own GPU). Raises `CollectiveDeviceError` when the group
    names no device type.
    """
    types = group_device_types(group)
    if not types:
        raise CollectiveDeviceError(
            Where(field=f"{_group_name(group)} backends"), "a backend serving at least one device type (e.g. 'cuda:nccl')",
            "none in torch.distributed.get_backend_config nor in the group's _device_types",
            "a collective needs a device its group serves; initialise the group with a backend")
    if prefer is not None:
        prefer = torch.device(prefer)
        if prefer.type in types:
            return prefer
    if "cpu" in types:
        return torch.device("cpu")
    kind = types[0]
    index = _current_index(kind)
    return torch.device(kind) if index is None else torch.device(kind, index)


def _current_index(kind: str) -> int | None:
    """This process's current device index of accelerator type `kind`, None when none is usable."""
    accel = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accel is not None:
        current = accel.current_accelerator() if accel.is_available() else None
        return accel.current_device_index() if current is not None and current.type == kind else None
    return torch.cuda.current_device() if kind == "cuda" and torch.cuda.is_available() else None


def on_collective_device(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """`x` itself when `group` serves its device, else a copy on the device the group serves."""
    device = collective_device(group, prefer=x.device)
    return x if device == x.device else x.to(device)
