"""What an audit says: a typed verdict per sample and for the batch, each with its evidence.

A verdict is a `Cause` and one evidence object whose type goes with it (`Shifted` for SHIFTED, ...), so
a caller matches on types, never on dict keys. `AuditReport` holds the verdicts, the agreement of the
given routes with the model's own routing per layer and per sample, and the thresholds it used
(`Thresholds`, with the measurement each came from). `RouteAlignmentError` is the fail-closed form:
raised by `AuditReport.raise_if_misaligned()` (and by the TRL / verl presets' audit), it carries the
report.

Legend: B samples, L model MoE layers.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Union

import numpy as np

from ..errors import LocatedError, Where
from .thresholds import Thresholds


class Cause(enum.Enum):
    """Why given routes do (or do not) line up with the tokens, as the audit names it."""

    ALIGNED = "aligned"
    """Each row agrees with the model's own routing of its token (up to near-ties)."""
    WRAPPED_IDS = "wrapped_ids"
    """Ids stored through a narrower integer than the model's expert count needs (uint8 / int8 on a model of
    more than 256 experts, prime-rl #3051): every id below 256 (or in [-128, 128)) while the model's own
    routing of the same tokens picks ids above; they line up once the model's ids are wrapped alike."""
    OUT_OF_RANGE = "out_of_range"
    """Rows holding no router's top-k: ids outside [0, num_experts) (physical EPLB ids, a sentinel) or one
    id twice in a row's top-k (a zero-filled row), away from any edge the rows are filled at."""
    SHIFTED = "shifted"
    """The rows are the sample's own, k positions off (a prompt start or last row counted otherwise)."""
    OTHER_SAMPLE = "other_sample"
    """The rows belong to another sample of the batch (a merge reordered samples, a batch-first /
    sequence-first layout mix-up)."""
    LAYERS = "layers"
    """Rows are right but layers are not: columns offset (dense layers counted or not), swapped, missing,
    or holding routes no model layer chose (an MTP layer's under a decoder id)."""
    PROMPT_SHIFT = "prompt_shift"
    """The prompt's rows are the sample's own k positions off and the completion's rows are in place (the
    prompt's prefill rows indexed otherwise than the decode rows); needs the prompt length (a trace's
    `prompt_len`, or `prompt_len=` to the reader)."""
    ROWS = "rows"
    """Rows were dropped or duplicated (packing, truncation): the rows go out of step with the tokens."""
    TAIL_ROWS = "tail_rows"
    """The rows at an edge (the sequence's last rows, the last rows before the completion or a turn) hold
    no route of their positions: dropped with the gap filled by repeating the last kept row, or zeros
    (prime-rl #1807, NeMo-RL #3485); every other row lines up."""
    OTHER_WEIGHTS = "other_weights"
    """Routes a real router chose (token-consistent), but not this model's: another model or weights version."""
    RANDOM = "random"
    """Routes that agree with nothing: no shift, sample, layer map or row edit explains them, and they
    are not even consistent per token (a buffer never filled, garbage)."""


@dataclass(frozen=True)
class Aligned:
    agreement: float
    """Mean agreement of the rows with the model's own routing (1.0: every expert set equal)."""


@dataclass(frozen=True)
class Shifted:
    shift: int
    """Row p holds the route of position start + p + shift."""
    agreement: float
    """Agreement of the rows read `shift` positions on."""
    agreement_unshifted: float
    """Agreement as the rows stand."""


@dataclass(frozen=True)
class OtherSample:
    sample: int
    """The batch index of the sample the rows match best."""
    key: str
    agreement: float
    """Agreement of the rows with that sample's own routing (at the matched positions)."""
    from_others: float
    """Fraction of the rows traced to another sample than their own."""
    agreement_own: float
    """Agreement of the rows with their own sample's routing, as they stand."""
    reading: str = ""
    """A reading of the payload under which the rows line up ("batch-first": a [B, S] list read as
    Megatron's sequence-first [S, B]), "" when none was needed."""


@dataclass(frozen=True)
class LayerMismatch:
    kind: str
    """'offset' (every remapped column off by one distance), 'swapped', 'foreign' (a layer's rows
    match no layer of the model) or 'missing' (no column for a model layer)."""
    remapped: tuple[tuple[int, int, float], ...]
    """(claimed layer, model layer its column matches, agreement there) for columns that hold another layer."""
    foreign: tuple[tuple[int, float], ...]
    """(claimed layer, its agreement) for layers whose rows match no model layer."""
    missing: tuple[int, ...]
    """Model MoE layers no column claims."""
    offset: int | None = None
    """Model layer minus claimed layer when every remapped column shares one distance."""


@dataclass(frozen=True)
class RowEdits:
    rows_expected: int
    """Rows the tokens call for (S - 1 - start)."""
    rows_found: int
    dropped: tuple[int, ...]
    """Positions (of token_ids_S) that no row holds the route of, first ones only (`max_listed`)."""
    duplicated: tuple[int, ...]
    """Positions whose route two or more rows hold."""
    agreement: float
    """Agreement of the rows with the positions they were traced to."""
    agreement_unaligned: float
    """Agreement as the rows stand."""


@dataclass(frozen=True)
class Unexplained:
    agreement: float
    """Agreement with the model's own routing, as the rows stand."""
    chance: float
    """Agreement two independent routings with these expert frequencies would have."""
    token_consistency: float | None
    """How much more often rows of one token id agree than chance (None: too few repeated tokens)."""
    token_consistency_model: float | None
    """The same for the model's own routing of these tokens: what real routes show."""
    best_other: float
    """Best agreement any shift, sample or layer map reached."""


@dataclass(frozen=True)
class WrappedIds:
    dtype: str
    """The integer the ids went through: 'uint8' (ids mod 256) or 'int8' (two's complement: 128..255 negative)."""
    num_experts: int
    max_id: int
    """The largest id the routes hold."""
    min_id: int
    model_ids_above: float
    """Share of the model's own ids (these tokens, these layers) that the wrapped integer cannot hold."""
    agreement: float
    """Agreement as the routes stand."""
    agreement_wrapped: float
    """Agreement with the model's own ids wrapped through `dtype` alike."""


@dataclass(frozen=True)
class BadIds:
    out_of_range: int
    """Ids outside [0, num_experts) in the columns of the model's MoE layers."""
    repeated: int
    """Row-layers whose top-k holds one id twice or more."""
    rows: int
    """Rows with either."""
    min_id: int
    max_id: int
    num_experts: int
    first: tuple[int, int]
    """(position, layer id) of the first such row-layer."""
    agreement: float
    """Agreement as the routes stand."""


@dataclass(frozen=True)
class TailRows:
    edge: str
    """'sequence_end', 'prompt_end' or 'turn_end': the boundary the filled rows end at."""
    positions: tuple[int, ...]
    """Positions (of token_ids_S) whose rows hold no route of theirs, first ones only (`max_listed`)."""
    fill: str
    """'repeat' (each the row before it: the last kept row repeated) or 'no_top_k' (repeated or out-of-range
    ids: zeros, a sentinel)."""
    agreement: float
    """Agreement of those rows with the model's routing of their positions."""
    agreement_rest: float
    """Agreement of the sample's other rows."""


@dataclass(frozen=True)
class PromptShift:
    shift: int
    """Prompt row p holds the route of position start + p + shift."""
    prompt_len: int
    rows: int
    """Prompt rows traced `shift` positions on."""
    agreement: float
    """Agreement of the prompt's rows read `shift` positions on."""
    agreement_unshifted: float
    """Agreement of the prompt's rows as they stand."""
    agreement_completion: float
    """Agreement of the completion's rows as they stand (in place)."""


Evidence = Union[Aligned, Shifted, OtherSample, LayerMismatch, RowEdits, Unexplained, WrappedIds, BadIds, TailRows,
                 PromptShift]
EVIDENCE_OF: dict[Cause, type] = {
    Cause.ALIGNED: Aligned, Cause.WRAPPED_IDS: WrappedIds, Cause.OUT_OF_RANGE: BadIds, Cause.SHIFTED: Shifted,
    Cause.OTHER_SAMPLE: OtherSample, Cause.LAYERS: LayerMismatch, Cause.PROMPT_SHIFT: PromptShift, Cause.ROWS: RowEdits,
    Cause.TAIL_ROWS: TailRows, Cause.OTHER_WEIGHTS: Unexplained, Cause.RANDOM: Unexplained,
}
"""The evidence type each cause carries (a Verdict built with another is refused)."""


@dataclass(frozen=True)
class Verdict:
    cause: Cause
    evidence: Evidence

    def __post_init__(self) -> None:
        if not isinstance(self.cause, Cause):
            raise ValueError(f"Verdict.cause must be a Cause, got {self.cause!r}")
        want = EVIDENCE_OF[self.cause]
        if not isinstance(self.evidence, want):
            raise ValueError(f"Verdict({self.cause.name}) needs {want.__name__} evidence, got {type(self.evidence).__name__}")

    @property
    def ok(self) -> bool:
        return self.cause is Cause.ALIGNED

    def describe(self) -> str:
        """One line: the cause and its figures."""
        e, c = self.evidence, self.cause
        if isinstance(e, Aligned):
            return f"aligned (agreement {e.agreement:.3f})"
        if isinstance(e, Shifted):
            return f"shifted by {e.shift:+d} tokens (agreement {e.agreement:.3f} shifted, {e.agreement_unshifted:.3f} as given)"
        if isinstance(e, OtherSample):
            how = f" when read {e.reading}" if e.reading else ""
            return (f"rows of another sample{how}: best match sample {e.sample} ({e.key!r}, agreement {e.agreement:.3f}); "
                    f"{e.from_others:.0%} of rows from other samples; agreement with its own {e.agreement_own:.3f}")
        if isinstance(e, LayerMismatch):
            parts = [f"layers {e.kind}" + (f" by {e.offset:+d}" if e.offset else "")]
            if e.remapped:
                parts.append("columns holding other layers " + ", ".join(f"{a}->{b} ({x:.3f})" for a, b, x in e.remapped[:6]))
            if e.foreign:
                parts.append("layers matching no model layer " + ", ".join(f"{a} ({x:.3f})" for a, x in e.foreign[:6]))
            if e.missing:
                parts.append(f"model layers with no column {list(e.missing[:8])}")
            return "; ".join(parts)
        if isinstance(e, WrappedIds):
            return (f"ids wrapped through {e.dtype}: ids in [{e.min_id}, {e.max_id}] on a model of {e.num_experts} experts, "
                    f"whose own routing puts {e.model_ids_above:.0%} of ids beyond {e.dtype} (agreement {e.agreement:.3f} as "
                    f"given, {e.agreement_wrapped:.3f} with the model's ids wrapped alike)")
        if isinstance(e, BadIds):
            return (f"rows holding no top-k of {e.num_experts} experts: {e.out_of_range} ids out of range (ids in "
                    f"[{e.min_id}, {e.max_id}]), {e.repeated} row-layers repeating an id, {e.rows} rows; first at position "
                    f"{e.first[0]}, layer {e.first[1]} (agreement {e.agreement:.3f})")
        if isinstance(e, TailRows):
            what = "the row before them repeated" if e.fill == "repeat" else "no top-k (repeated or out-of-range ids)"
            return (f"rows at the {e.edge.replace('_', ' ')} filled: positions {list(e.positions[:8])} hold {what} "
                    f"(agreement {e.agreement:.3f} there, {e.agreement_rest:.3f} elsewhere)")
        if isinstance(e, PromptShift):
            return (f"prompt rows shifted by {e.shift:+d} tokens ({e.rows} of the prompt's {e.prompt_len} positions; agreement "
                    f"{e.agreement:.3f} shifted, {e.agreement_unshifted:.3f} as given), completion rows in place "
                    f"({e.agreement_completion:.3f})")
        if isinstance(e, RowEdits):
            return (f"rows dropped or duplicated: {e.rows_found} rows for {e.rows_expected} positions, dropped "
                    f"{list(e.dropped[:8])}, duplicated {list(e.duplicated[:8])} (agreement {e.agreement:.3f} traced, "
                    f"{e.agreement_unaligned:.3f} as given)")
        tc = "n/a" if e.token_consistency is None else f"{e.token_consistency:.3f}"
        tcm = "n/a" if e.token_consistency_model is None else f"{e.token_consistency_model:.3f}"
        what = "another model or weights version" if c is Cause.OTHER_WEIGHTS else "random: agree with nothing"
        return (f"{what} (agreement {e.agreement:.3f}, chance {e.chance:.3f}, token consistency {tc} vs the model's "
                f"{tcm}, best alternative {e.best_other:.3f})")


@dataclass(frozen=True)
class SampleVerdict:
    index: int
    key: str
    agreement: float
    """Mean agreement over the sample's rows and the model's MoE layers, as given."""
    rows_expected: int
    rows_found: int
    verdict: Verdict
    window: float = 1.0
    """The least mean agreement of `Thresholds.window` consecutive rows (the sample's mean when shorter)."""
    neighbour: float = -1.0
    """The most a window of rows agrees better read one position off than as it stands."""


@dataclass(frozen=True)
class AuditReport:
    """The audit of one batch of routes against the model's own routing of its tokens."""

    format: str
    """How the routes were held (trace, vllm, sglang, verl, megatron)."""
    verdict: Verdict
    """The batch's: ALIGNED only when every sample and layer is."""
    samples: tuple[SampleVerdict, ...]
    layer_ids: tuple[int, ...]
    """The model's MoE layers (global route-layer ids), the order of `layer_agreement` and `cells_BL`."""
    layer_agreement: tuple[float, ...]
    """Per model layer, over every sample's rows (as given, through the columns' claimed layers)."""
    cells_BL: np.ndarray = field(repr=False, compare=False)
    """float [B, L]: agreement per sample and layer (NaN where a sample has no row to compare)."""
    thresholds: Thresholds = field(default_factory=Thresholds)
    forward_s: float = 0.0
    """Seconds of the free-routing forward."""
    analysis_s: float = 0.0
    """Seconds of the comparison and diagnosis."""
    chance: tuple[float, ...] = ()
    """Per model layer, the agreement unrelated tokens' rows have under this model's routing (from its expert
    frequencies over the batch): the chance-corrected thresholds (`Thresholds.*_above_chance`) stand on it."""

    @property
    def ok(self) -> bool:
        return self.verdict.ok

    @property
    def misaligned(self) -> tuple[SampleVerdict, ...]:
        return tuple(s for s in self.samples if not s.verdict.ok)

    def summary(self) -> str:
        """Lines for a person: the verdict, the layers and samples that fail, the thresholds used."""
        lines = [f"routes ({self.format}, {len(self.samples)} samples, {len(self.layer_ids)} MoE layers): "
                 f"{self.verdict.describe()}"]
        t = self.thresholds
        bad_layers = [(lid, a) for lid, a in zip(self.layer_ids, self.layer_agreement) if a < t.aligned]
        if bad_layers:
            lines.append("  layers below " + f"{t.aligned}: " + ", ".join(f"{lid} ({a:.3f})" for lid, a in bad_layers[:12]))
        for s in self.misaligned[:8]:
            lines.append(f"  sample {s.index} ({s.key!r}, {s.rows_found} rows for {s.rows_expected}): {s.verdict.describe()}")
        if len(self.misaligned) > 8:
            lines.append(f"  ... {len(self.misaligned) - 8} more misaligned samples")
        if self.chance:
            lines.append("  chance agreement per layer: " + ", ".join(f"{c:.3f}" for c in self.chance[:12]))
        lines.append("  thresholds: " + t.describe())
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON): verdicts as cause names plus evidence fields."""

        def verdict(v: Verdict) -> dict[str, Any]:
            return {"cause": v.cause.value, "evidence": _plain(asdict(v.evidence)), "describe": v.describe()}

        return {
            "format": self.format, "ok": self.ok, "verdict": verdict(self.verdict),
            "layer_ids": list(self.layer_ids), "layer_agreement": [round(a, 6) for a in self.layer_agreement],
            "samples": [{"index": s.index, "key": s.key, "agreement": round(s.agreement, 6), "window": round(s.window, 6),
                         "neighbour": round(s.neighbour, 6),
                         "rows_expected": s.rows_expected,
                         "rows_found": s.rows_found, "verdict": verdict(s.verdict)} for s in self.samples],
            "thresholds": self.thresholds.to_dict(), "chance": list(self.chance), "forward_s": self.forward_s, "analysis_s": self.analysis_s,
        }

    def raise_if_misaligned(self) -> "AuditReport":
        """This report when the routes line up; else RouteAlignmentError carrying it."""
        if not self.ok:
            raise RouteAlignmentError(self)
        return self


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class RouteAlignmentError(LocatedError, ValueError):
    """Routes that do not line up with their tokens, as an audit found: the verdict names the cause
    and its figures; `.report` is the whole AuditReport."""

    def __init__(self, report: AuditReport, where: Where | None = None) -> None:
        self.report = report
        first = report.misaligned[0] if report.misaligned else None
        where = where or Where(record=first.key if first else None, field=f"routes ({report.format})")
        super().__init__(where, f"routes that line up with their tokens (agreement >= {report.thresholds.aligned} "
                                "per layer and per sample with the model's own routing)",
                         report.verdict.describe(), report.summary())

    def __reduce__(self):
        return (type(self), (self.report, self.where))
