"""Routes from any pipeline, checked against the trainer's model before they train.

    import moe_replay
    report = moe_replay.audit(model, routed_experts, token_ids, format="vllm", prompt_start=0)
    report.raise_if_misaligned()   # RouteAlignmentError naming the cause, else the report

One forward without gradients and with free routing records the model's own top-k per layer and
token; the given routes are compared with it per layer and per sample, and where they do not line up
the audit names the likely cause with its evidence (`Cause`: shifted, another sample's rows, layers
offset or swapped, rows dropped or duplicated, a shifted prompt span, filled tail rows, ids wrapped or out of
range, another model or weights version, random). Readers
for each pipeline's format are in `formats`; the thresholds and their measurements in `thresholds`;
docs/audit.md is the page. Importing this package needs torch, numpy and msgpack only.
"""

import sys
import types

from .api import audit
from .formats import ROUTE_FORMATS, from_megatron, from_sglang, from_traces, from_verl, from_vllm, read_routes
from .free import FreeRoutes
from .routes import LayerAxis, RoutesBatch, SampleRoutes
from .thresholds import THRESHOLDS, Thresholds
from .verdict import (Aligned, AuditReport, BadIds, Cause, LayerMismatch, OtherSample, PromptShift, RouteAlignmentError, RowEdits,
                      SampleVerdict, Shifted, TailRows, Unexplained, Verdict, WrappedIds)

__all__ = [
    "Aligned",
    "AuditReport",
    "BadIds",
    "Cause",
    "FreeRoutes",
    "LayerAxis",
    "LayerMismatch",
    "OtherSample",
    "PromptShift",
    "ROUTE_FORMATS",
    "RouteAlignmentError",
    "RoutesBatch",
    "RowEdits",
    "SampleRoutes",
    "SampleVerdict",
    "Shifted",
    "THRESHOLDS",
    "TailRows",
    "Thresholds",
    "Unexplained",
    "Verdict",
    "WrappedIds",
    "audit",
    "from_megatron",
    "from_sglang",
    "from_traces",
    "from_verl",
    "from_vllm",
    "read_routes",
]


class _CallableModule(types.ModuleType):
    """`moe_replay.audit` is this package and the function at once: importing the package sets the
    attribute `audit` of `moe_replay` to the module, so the module answers calls with `audit(...)`."""

    def __call__(self, *args, **kwargs):
        return audit(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
