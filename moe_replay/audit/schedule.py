"""A trainer preset's audit: which batches, and stopping with the verdict (fail closed).

`AuditSchedule(preset.audit)` counts the batches a trainer adapter shows it (`next_batch()`) and audits
(`run(model, traces)`) those the preset's `audit` section names (`AuditSettings.due`: the first batch, every N-th); a
batch whose routes do not line up stops training with RouteAlignmentError carrying the report. Under
torch.distributed the ranks agree before anyone raises (a MAX all-reduce of "misaligned" over the
given group), so a rank whose own shard lined up stops too (PeerAuditError) instead of waiting in the
next collective for a rank that left.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch

from ..errors import MoeReplayError
from .verdict import AuditReport


class PeerAuditError(MoeReplayError, RuntimeError):
    """Another rank's audit of its shard of the batch found misaligned routes (that rank raised
    RouteAlignmentError with the verdict); this rank stops with it."""


class AuditSchedule:
    """Audits the batches `settings` (presets.AuditSettings) names; `reports` keeps the audited ones'."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.batches = 0
        self.reports: list[AuditReport] = []

    def next_batch(self) -> bool:
        """Count one batch; whether it is due for an audit (the caller then calls `run`)."""
        batch, self.batches = self.batches, self.batches + 1
        return self.settings.due(batch)

    def run(self, model: Any, traces: Sequence[Any], *,
            context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
            group: Any = None, device: torch.device | str | None = None) -> AuditReport:
        """Audit the batch's traces on `model` inside `context()`; its report, or RouteAlignmentError
        (PeerAuditError where another rank of `group` found its shard misaligned)."""
        from .api import audit

        report = audit(model, list(traces), context=context)
        self.reports.append(report)
        peers_bad = _any_rank(not report.ok, group, device)
        report.raise_if_misaligned()
        if peers_bad:
            raise PeerAuditError(f"moe_replay audit of batch {self.batches - 1}: another rank's routes do not line up "
                                 f"with their tokens (its RouteAlignmentError names the cause); this rank's "
                                 f"{len(report.samples)} samples did")
        return report


def audit_metrics(report: AuditReport) -> dict[str, float]:
    """The report as trainer metrics: the least layer and sample agreement, misaligned samples."""
    return {"moe_replay/audit_min_layer_agreement": float(min(report.layer_agreement)),
            "moe_replay/audit_min_sample_agreement": float(min(s.agreement for s in report.samples)),
            "moe_replay/audit_misaligned_samples": float(len(report.misaligned))}


def _any_rank(bad: bool, group: Any, device: torch.device | str | None) -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return bad
    flag = torch.tensor([1.0 if bad else 0.0], device=device or "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
