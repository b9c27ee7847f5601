"""Counting the host's reads of tensor values: how launch-bound a call will be on a GPU, measured
on any device.

Why: on a GPU each read (`bool(t)`, `int(t)`, `.item()`, `.tolist()`, `.cpu()`, a boolean-mask index,
whose result size the host must know, `nonzero`) is a device-to-host copy that waits for every
launch queued before it, so a call with many reads runs at the host's pace, not the device's: support
scoring measured 4.8-8.8x a plain logprob's time on an H200 (docs/benchmarks.md) while moving 0.001x
the logits' bytes. The reads can be counted on the CPU the same way: aten's `_local_scalar_dense`
(item / bool / int), `nonzero`, `masked_select` and masked `index` / `index_put` through a dispatch
mode, `Tensor.tolist` and `Tensor.numpy` (a CPU tensor's `.cpu()` dispatches nothing; its `.numpy()`
is where a device tensor's copy lands) by wrapping them while the counter is active.
tests/test_scoring.py holds `score_logits` to a fixed number of reads a call; benchmarks/scoring.py
prints the count beside the times.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR_READS = ("_local_scalar_dense", "nonzero", "masked_select")
_MASKABLE = ("index", "index_put", "index_put_")


class HostReads:
    """`with HostReads() as reads: ...` then `reads.reads` (kind -> count), `reads.total`, and
    `reads.ops`: the aten ops dispatched (on a GPU about the kernels launched, views aside).
    Not reentrant; not for compiled code (a dispatch mode changes what torch.compile traces)."""

    def __init__(self) -> None:
        self.reads: dict[str, int] = {}
        self.ops = 0
        self._saved: tuple[Any, Any] | None = None
        self._mode: TorchDispatchMode | None = None

    def count(self, kind: str) -> None:
        self.reads[kind] = self.reads.get(kind, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.reads.values())

    def __enter__(self) -> "HostReads":
        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                counter.ops += 1
                if name in _SCALAR_READS:
                    counter.count(name)
                elif name in _MASKABLE and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()):
                    counter.count(f"{name}[bool mask]")
                return func(*args, **(kwargs or {}))

        def counted(kind: str, method: Any) -> Any:
            def wrapper(t: torch.Tensor, *a: Any, **k: Any) -> Any:
                counter.count(kind)
                return method(t, *a, **k)
            return wrapper

        self._saved = (torch.Tensor.tolist, torch.Tensor.numpy)
        torch.Tensor.tolist, torch.Tensor.numpy = counted("tolist", self._saved[0]), counted("numpy", self._saved[1])
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._mode.__exit__(*exc)
        finally:
            torch.Tensor.tolist, torch.Tensor.numpy = self._saved
