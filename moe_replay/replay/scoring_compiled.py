"""`torch_compiled`: the `torch_chunked` scoring backend with its per-chunk full-vocabulary math
compiled by torch.compile (inductor), and the `"auto"` choice between the two.

Why: eager torch runs each chunk as 5 passes each way over fp32 [C, V] buffers, and each op is a
parallel region (on a loaded 2-core CPU, up to a scheduler time slice each: ~30 ms per op measured
with 4-row chunks). Compiled, the forward is one kernel with two reductions over each row and the
backward one elementwise kernel, both reading the logits in their own dtype in place and writing
no fp32 chunk; benchmarks/scoring.py measures both (`new` vs `new_eager`).

Legend: as scoring.py (C rows of a chunk, V vocabulary, X rows of the logits tensor, Y of the output).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .scoring import AUTO_BACKEND, SCORING_BACKENDS, TorchChunked
from .scoring_job import _Job


def _stats_kernel(logits_XV: torch.Tensor, src_C: torch.Tensor, scale_C1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp, entropy) of rows src_C of logits / scale, upcast inside: compiled, two reductions
    over each row (max, then sum e^y and sum e^y y fused) read the logits' own bytes in place (the
    row index is folded into the loads) and write no [C, V] tensor."""
    x = logits_XV[src_C].to(scale_C1.dtype) / scale_C1
    m = x.amax(1, keepdim=True)
    y = x - m
    e = torch.exp(y)
    s = e.sum(1)
    log_s = torch.log(s)
    return m.squeeze(1) + log_s, log_s - (e * y).sum(1) / s


def _grad_kernel(out_YV: torch.Tensor, dst_C: torch.Tensor, logits_XV: torch.Tensor, src_C: torch.Tensor, scale_C1: torch.Tensor,
                 lse_C1: torch.Tensor, mean_C1: torch.Tensor, a_C1: torch.Tensor, b_C1: torch.Tensor, t_C1: torch.Tensor) -> None:
    """out[dst] = (onehot_t a - p (a + b (x - E[x]))) / scale, x = logits[src]: compiled, one pass
    reading the logits rows and storing into the gradient's rows (both indices folded in)."""
    x = logits_XV[src_C].to(scale_C1.dtype) / scale_C1
    p = torch.exp(x - lse_C1)
    col = torch.arange(x.shape[1], device=x.device)[None, :]
    dx = torch.where(col == t_C1, a_C1, torch.zeros_like(a_C1)) - p * (a_C1 + b_C1 * (x - mean_C1))
    out_YV[dst_C] = (dx / scale_C1).to(out_YV.dtype)


class TorchCompiled(TorchChunked):
    """Compiled `dense_stats` / `dense_grad` (one launch each per call); support, shards and row
    bookkeeping are `TorchChunked`'s. Shapes are dynamic: one compile per logits dtype (`compile_s`
    in benchmarks/scoring.py, cold cache); inductor's on-disk cache serves later processes."""

    def __init__(self) -> None:
        self._stats: Any = None
        self._grad: Any = None

    def kernels(self) -> tuple[Any, Any]:
        if self._stats is None:  # built on first use: torch.compile imports dynamo
            self._stats = torch.compile(_stats_kernel, dynamic=True, fullgraph=True)
            self._grad = torch.compile(_grad_kernel, dynamic=True, fullgraph=True)
        return self._stats, self._grad

    def chunks(self, job: _Job, buffered: bool) -> list[tuple[int, int]]:
        """One range for all rows unless the backward needs a [C, V] buffer (support terms added to
        dense rows): the kernels allocate nothing per row, and each extra launch costs a parallel
        region (on a loaded 2-core CPU, up to a scheduler time slice: ~30 ms measured with 4-row chunks)."""
        return job.chunks() if buffered else [(0, job.num_rows)]

    def dense_stats(self, job: _Job, idx_C: torch.Tensor, col_C: torch.Tensor,
                    host_C: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        src_C = job.source_index(idx_C)  # folded into the kernel's loads: no slice needed
        return self.kernels()[0](job.logits_XV, src_C, job.scale_G.index_select(0, idx_C)[:, None])

    def dense_grad(self, job: _Job, idx_C: torch.Tensor, lse_C1: torch.Tensor, mean_C1: torch.Tensor, a_C1: torch.Tensor,
                   b_C1: torch.Tensor, t_C1: torch.Tensor, out: torch.Tensor, dst_C: torch.Tensor | None,
                   host_C: np.ndarray, entropy_grad: bool) -> None:
        src_C = job.source_index(idx_C)  # folded into the kernel's loads
        dst_C = torch.arange(idx_C.numel(), device=idx_C.device) if dst_C is None else dst_C
        self.kernels()[1](out, dst_C, job.logits_XV, src_C, job.scale_G.index_select(0, idx_C)[:, None], lse_C1, mean_C1,
                          a_C1, b_C1, t_C1)


SCORING_BACKENDS.add("torch_compiled", TorchCompiled())

COMPILE_MIN_ELEMENTS = 1 << 22
"""`backend="auto"` takes `torch_compiled` on CPU where a call reads at least this many logits over the
full vocabulary (4.2M: 28 rows at V = 151,936, i.e. any real micro-batch), so a trainer compiles once
(seconds) and saves it on every step, while tiny vocabularies (tests, toy models: V <= 512, a few
hundred rows) stay eager and never pay a compile."""
_COMPILE_PROBE: dict[str, Any] = {}


def auto_backend(job: _Job) -> str:
    """`torch_compiled` where it pays and compiles here, else `torch_chunked`. On other devices eager
    until a fused kernel is measured there (inductor emits Triton on a GPU: untested in this project)."""
    if job.logits_XV.device.type != "cpu" or int(job.dense_G.sum()) * job.logits_XV.shape[1] < COMPILE_MIN_ELEMENTS:
        return "torch_chunked"
    if "error" not in _COMPILE_PROBE:  # once per process: a machine without a C++ toolchain stays eager, and says so
        try:
            stats, grad = SCORING_BACKENDS.get("torch_compiled").kernels()
            # the job's dtypes and dynamic sizes: the graphs compiled here are the ones its call reuses
            x, rows, one = torch.zeros(3, 8, dtype=job.logits_XV.dtype), torch.tensor([2, 0]), torch.ones(2, 1, dtype=job.cdt)
            stats(x, rows, one)
            grad(torch.empty_like(x), rows, x, rows, one, one, one, one, one, torch.zeros(2, 1, dtype=torch.long))
            _COMPILE_PROBE["error"] = None
        except Exception as e:  # noqa: BLE001 - any compiler failure means: stay eager
            import warnings

            _COMPILE_PROBE["error"] = e
            warnings.warn(f"score_logits: torch.compile unusable here ({type(e).__name__}: {e}); scoring eagerly "
                          "(same values, slower on the full vocabulary)", RuntimeWarning, stacklevel=3)
    return "torch_chunked" if _COMPILE_PROBE["error"] is not None else "torch_compiled"


AUTO_BACKEND.append(auto_backend)
