"""Route plan: a list of traces plus the trainer's padded batch, turned into per-layer expert ids.

Everything that can be wrong with a batch is checked here, before any forward runs: geometry,
route shapes, expert range, batch order, sequence lengths, padding, the sampled token being in its
kept set. The forward then only looks tensors up by layer id.

Alignment (invariant 1): row b holds trace b's S_b tokens at columns off_b .. off_b + S_b - 1
(off_b = 0 with right padding, S - S_b with left padding). Route row p of the trace is the forward
of token route_start + p, i.e. flat position b * S + off_b + route_start + p. Positions without a
route are explicit in `routed_N`:
  * the final token of each sequence (the engine never forwarded it; nothing attends to it and its
    logits predict no scored token),
  * pad positions (masked out of attention, never scored),
  * tokens before `route_start` (only with PlanConfig.unrouted_prefix="free").
The trainer routes those positions freely; under causal attention the first two cannot reach any
scored logit.

Legend: B batch rows, S padded length, N = B * S flat positions, L MoE layers, K top-k,
G generated (scored) tokens over the whole batch, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np
import torch

from ..errors import PartialTraceError, TraceFormatError, Where
from ..geometry import ModelGeometry
from ..identity import check_traces
from ..trace import RolloutTrace, Sampling, SamplingSupport
from .errors import BatchLayoutError, ScoringInputError


@dataclass(frozen=True)
class PlanConfig:
    """How a batch is laid out and what to do with tokens the trace has no route for."""

    padding_side: Literal["left", "right"] = "right"
    """Where pads go when the plan builds the batch itself (ignored when a batch is given)."""
    pad_token_id: int = 0
    """Token id written into pad positions when the plan builds the batch."""
    pad_to_multiple_of: int = 1
    """Round the padded length S up to a multiple of this when the plan builds the batch."""
    unrouted_prefix: Literal["error", "free"] = "error"
    """Tokens before a trace's route_start have no recorded route: refuse ("error") or let the
    trainer route them itself ("free", a known mismatch on those tokens)."""
    allow_adjusted_sampling: bool = False
    """Accept traces whose sampler's logits were shifted by options the trainer cannot see
    (`Sampling.adjusted`: penalties, logit_bias, logits processors). Scores are then log p of the
    model's own, unshifted logits over the recorded kept set: NOT the engine's logprobs. In a
    preset: `replay: {allow_adjusted_sampling: true}`."""

    def __post_init__(self) -> None:
        if self.padding_side not in ("left", "right"):
            raise ValueError(f"PlanConfig.padding_side must be 'left' or 'right', got {self.padding_side!r}")
        if self.unrouted_prefix not in ("error", "free"):
            raise ValueError(f"PlanConfig.unrouted_prefix must be 'error' or 'free', got {self.unrouted_prefix!r}")
        if self.pad_to_multiple_of < 1:
            raise ValueError(f"PlanConfig.pad_to_multiple_of must be >= 1, got {self.pad_to_multiple_of}")
        if self.pad_token_id < 0:
            raise ValueError(f"PlanConfig.pad_token_id must be >= 0, got {self.pad_token_id}")


@dataclass
class RoutePlan:
    """Per-layer replay ids for one padded micro-batch, and where its scored tokens sit."""

    keys: tuple[str, ...]
    """Trace key of each batch row."""
    geometry: ModelGeometry
    input_ids_BS: torch.Tensor
    attention_mask_BS: torch.Tensor
    position_ids_BS: torch.Tensor
    """Positions counted over real tokens only (left padding starts each row at 0)."""
    offsets_B: np.ndarray
    """Column of each row's first real token."""
    lengths_B: np.ndarray
    """Real tokens per row (S_b)."""
    ids_LNK: torch.Tensor
    """int64 expert ids per MoE layer (geometry order) and flat position; -1 where unrouted."""
    routed_N: torch.Tensor
    """bool, True where ids_LNK holds a recorded route."""
    score_pos_G: torch.Tensor
    """Flat position of the logits that predict each generated token (row-major over the batch)."""
    target_G: torch.Tensor
    """The generated token ids scored at score_pos_G."""
    gen_offsets_B1: np.ndarray
    """Row b's generated tokens are [gen_offsets_B1[b], gen_offsets_B1[b + 1]) of the G axis."""
    supports: tuple[SamplingSupport | None, ...]
    """Kept sets per row (None where a trace recorded none)."""
    engine_logprobs_G: torch.Tensor | None = None
    """The engine's logprobs of the scored tokens, when every trace has them."""
    layer_index: dict[int, int] = field(default_factory=dict)
    """Global layer id -> index on the L axis."""
    sampling_B: tuple[Sampling, ...] = ()
    """Each row's recorded sampling parameters (temperature for scoring)."""
    weights_version: str | int | None = None
    """The trainer's weights version the traces were checked against (None: not checked)."""
    off_policy_B: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    """Rows whose trace was sampled with another weights version (only with off_policy=True)."""
    stale_G: torch.Tensor | None = None
    """bool [G]: scored tokens their trace names stale (`trace.Rerouted`: sampled before a route
    they depended on was changed by a later forward, so their engine logprob and kept set came from
    routes the plan does not replay); None when no trace names any. The rule: mask them from the
    loss (`loss_mask_G`), as verl's response_mask and TRL's completion mask do here."""

    @property
    def loss_mask_G(self) -> torch.Tensor:
        """bool [G]: the scored tokens a loss may use (all but `stale_G`)."""
        keep = torch.ones(len(self.target_G), dtype=torch.bool, device=self.target_G.device)
        return keep if self.stale_G is None else keep & ~self.stale_G.to(keep.device)

    @property
    def stale_fraction(self) -> float:
        """Fraction of scored tokens masked as stale (0 without any)."""
        return 0.0 if self.stale_G is None or not len(self.stale_G) else float(self.stale_G.float().mean())

    @property
    def temperature_G(self) -> torch.Tensor:
        """Each scored token's recorded sampling temperature (0 = greedy), float32 [G]."""
        return self.per_token([s.temperature for s in self.sampling_B])

    @property
    def off_policy_fraction(self) -> float:
        """Fraction of rows sampled with another weights version than `weights_version`."""
        return float(self.off_policy_B.mean()) if len(self.off_policy_B) else 0.0

    @property
    def batch_size(self) -> int:
        return self.input_ids_BS.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids_BS.shape[1]

    @property
    def num_positions(self) -> int:
        return self.input_ids_BS.numel()

    @property
    def all_routed(self) -> bool:
        return bool(self.routed_N.all())

    def layer_ids(self, layer_id: int) -> torch.Tensor:
        """Replay ids [N, K] of one global layer id (a plan built with layers=... holds those only)."""
        j = self.layer_index.get(layer_id)
        if j is None:
            raise PartialTraceError(Where(record=self.keys[0], field="layer_ids"), f"one of the plan's layers {list(self.layer_index)}",
                                    layer_id, "the plan was built for some layers only (build_plan(..., layers=...))")
        return self.ids_LNK[j]

    def per_token(self, values_B: Sequence[float]) -> torch.Tensor:
        """Broadcast one value per row (e.g. each request's temperature) to the G scored tokens."""
        if len(values_B) != self.batch_size:
            raise ValueError(f"per_token needs {self.batch_size} values (one per row), got {len(values_B)}")
        counts_B = torch.from_numpy(np.diff(self.gen_offsets_B1))
        return torch.repeat_interleave(torch.as_tensor(values_B, dtype=torch.float32), counts_B)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments for an HF causal LM forward over this batch."""
        return {"input_ids": self.input_ids_BS, "attention_mask": self.attention_mask_BS, "position_ids": self.position_ids_BS}

    def to(self, device: torch.device | str) -> "RoutePlan":
        moved = {
            name: getattr(self, name).to(device)
            for name in ("input_ids_BS", "attention_mask_BS", "position_ids_BS", "ids_LNK", "routed_N", "score_pos_G", "target_G")
        }
        for name in ("engine_logprobs_G", "stale_G"):
            if getattr(self, name) is not None:
                moved[name] = getattr(self, name).to(device)
        return RoutePlan(**{**self.__dict__, **moved})


def build_plan(
    traces: Sequence[RolloutTrace],
    geometry: ModelGeometry,
    *,
    input_ids_BS: torch.Tensor | None = None,
    attention_mask_BS: torch.Tensor | None = None,
    config: PlanConfig = PlanConfig(),
    routes: bool = True,
    weights_version: str | int | None = None,
    off_policy: bool = False,
    layers: Sequence[int] | None = None,
) -> RoutePlan:
    """Validate `traces` against the model's `geometry` and the batch, and lay their routes out.

    Every field of each trace's geometry must equal `geometry`'s, `family` included
    (ModelGeometry.check_matches; an empty family on either side is unknown). The plan's geometry
    names the family its traces name when `geometry` names none, so replay can compare it with the
    model's, and a batch of traces of two families is refused.

    A trace whose sampler's logits were shifted by options the trainer cannot see
    (`sampling.adjusted`: penalties, logit_bias, logits processors; see `adjusted_sampling_problem`)
    is refused (ScoringInputError) unless `config.allow_adjusted_sampling`. With it the plan is built
    and scoring gives log p of the model's own (unshifted) logits over the recorded kept set: NOT
    the engine's logprobs, and not the distribution that sampled.

    `weights_version`: the version of the weights being trained; a trace sampled with another one
    (or with none recorded) is refused (WeightsVersionError) unless `off_policy=True` says the
    batch is off-policy on purpose; then `plan.off_policy_B` marks those rows (and the metrics
    report `off_policy_fraction`). None skips the check.

    With `routes=False` the plan only lays out the batch and the scored tokens (every position
    unrouted, traces need not carry routes): scoring under the trainer's own free routing.

    Without `input_ids_BS` the plan builds the padded batch (config.padding_side). With it, row b
    must hold exactly trace b's tokens (left or right padded, as `attention_mask_BS` says).

    `layers`: the MoE layer ids the plan holds routes for (a pipeline stage's own, which it reads
    from the store alone: `store.get_many(keys, layers=...)`); its traces may hold those only
    (`route_layer_ids`), and `plan.layer_ids` of another layer is refused by name. Without it
    every trace must hold every layer (a partial one is refused: PartialTraceError).
    """
    if not traces:
        raise ValueError("build_plan needs at least one trace, got 0")
    keys = tuple(t.key for t in traces)
    seen: dict[str, int] = {}
    for b, key in enumerate(keys):
        if key in seen:
            raise BatchLayoutError(Where(record=key), "distinct trace keys in one batch", f"rows {seen[key]} and {b}")
        seen[key] = b
    geometry, off_policy_B = check_traces(  # identity.py: the one check every consumer of a trace runs
        traces, geometry, weights_version=weights_version, off_policy=off_policy, what="model vs trace",
        what_later="model (family named by the batch's earlier traces) vs trace",
        opt_in="pass off_policy=True to train on them on purpose")
    for trace in traces:
        _check_trace(trace, geometry, config, routes)
        if not config.allow_adjusted_sampling:
            _check_sampling(trace)
    plan_layers = _plan_layers(traces, geometry, layers, routes)

    lengths_B = np.array([t.num_tokens for t in traces], dtype=np.int64)
    if input_ids_BS is None:
        input_ids_BS, attention_mask_BS, offsets_B = _pad(traces, config)
    else:
        input_ids_BS, attention_mask_BS, offsets_B = _check_batch(traces, input_ids_BS, attention_mask_BS)
    b_count, s_len = input_ids_BS.shape
    position_ids_BS = (attention_mask_BS.long().cumsum(-1) - 1).clamp(min=0)

    n, l_count, k = b_count * s_len, len(plan_layers), geometry.top_k
    ids_LNK = np.full((l_count, n, k), -1, dtype=np.int64)
    score_pos, targets, gen_offsets = [], [], [0]
    for b, trace in enumerate(traces):
        base = b * s_len + int(offsets_B[b])
        if routes:
            rows_T = base + trace.route_start + np.arange(trace.num_route_rows)
            cols = [trace.route_layers.index(lid) for lid in plan_layers]
            routes_TLK = trace.routes_TLK if len(cols) == len(trace.route_layers) else trace.routes_TLK[:, cols]
            ids_LNK[:, rows_T, :] = np.transpose(routes_TLK, (1, 0, 2))
        gen_J = trace.generated_positions()  # every generated span of a stitched conversation
        score_pos.append(base + gen_J - 1)
        targets.append(trace.token_ids_S[gen_J])
        gen_offsets.append(gen_offsets[-1] + len(gen_J))
    routed_N = torch.from_numpy(ids_LNK[0, :, 0] >= 0)

    logprobs = [t.logprobs_G for t in traces]
    engine_logprobs_G = (
        torch.from_numpy(np.concatenate(logprobs).astype(np.float32)) if all(lp is not None for lp in logprobs) else None
    )
    stale_G = None
    if any(t.rerouted is not None and t.rerouted.stale for t in traces):
        stale_G = torch.from_numpy(np.concatenate([t.stale_G for t in traces]))
    return RoutePlan(
        keys=keys,
        geometry=geometry,
        input_ids_BS=input_ids_BS,
        attention_mask_BS=attention_mask_BS,
        position_ids_BS=position_ids_BS,
        offsets_B=offsets_B,
        lengths_B=lengths_B,
        ids_LNK=torch.from_numpy(ids_LNK),
        routed_N=routed_N,
        score_pos_G=torch.from_numpy(np.concatenate(score_pos).astype(np.int64)),
        target_G=torch.from_numpy(np.concatenate(targets).astype(np.int64)),
        gen_offsets_B1=np.array(gen_offsets, dtype=np.int64),
        supports=tuple(t.support for t in traces),
        engine_logprobs_G=engine_logprobs_G,
        layer_index={lid: j for j, lid in enumerate(plan_layers)},
        sampling_B=tuple(t.sampling for t in traces),
        weights_version=weights_version,
        off_policy_B=off_policy_B,
        stale_G=stale_G,
    )


LOGIT_MASKS: frozenset[str] = frozenset({"allowed_token_ids", "bad_words", "min_tokens", "structured_outputs"})
"""`Sampling.adjusted` names that only remove tokens (their logits become -inf). Capture records the
kept set as the finite logits the sampler drew from, so what a mask left is in the trace's support,
and scoring over it is exact. Every other name (repetition / presence / frequency penalties,
logit_bias, logits processors, any name not listed here) shifts finite logits."""

ADJUSTED_SAMPLING_WHY = (
    "the engine applied them to the logits before the kept-set cut and before the sampled logprob; the "
    "trainer's forward knows nothing of them, so its log p is of another distribution than the one that "
    "sampled (a repetition_penalty of 1.3 divides a repeated token's positive logit of 10 by 1.3: 2.3 nats "
    "lower before the softmax), and the kept set alone does not carry the shifted values"
)
"""Why a logit-shifting sampling option cannot be scored: the one wording the plan, the TRL option
check and the scorers' replica checks can share."""


def _plan_layers(traces: Sequence[RolloutTrace], geometry: ModelGeometry, layers: Sequence[int] | None,
                 routes: bool) -> tuple[int, ...]:
    """The layer ids the plan lays out: `layers` (checked against the geometry and held by every
    trace), or every MoE layer (and then no trace may hold some only)."""
    if layers is None:
        if routes:
            for t in traces:
                t.require_all_layers("build_plan without layers= (pass the layers a pipeline stage holds)")
        return geometry.moe_layer_ids
    wanted = tuple(sorted(set(int(i) for i in layers)))
    unknown = [i for i in wanted if i not in geometry.moe_layer_ids]
    if not wanted or unknown:
        raise BatchLayoutError(Where(field="layers"), f"MoE layer ids of {list(geometry.moe_layer_ids)}", unknown or "none")
    for t in traces if routes else ():
        lacking = [i for i in wanted if i not in t.route_layers]
        if lacking:
            raise PartialTraceError(Where(record=t.key, field="route_layer_ids"), f"routes of layers {list(wanted)}",
                                    f"routes of layers {list(t.route_layers)} (none for {lacking})",
                                    "read the traces with layers= covering the plan's")
    return wanted


def logit_shifts(sampling: Sampling) -> tuple[str, ...]:
    """The options in `sampling.adjusted` that shifted the sampler's finite logits (all but LOGIT_MASKS)."""
    return tuple(name for name in sampling.adjusted if name not in LOGIT_MASKS)


def adjusted_sampling_problem(trace: RolloutTrace) -> str | None:
    """None when scoring `trace` over its kept set reproduces the distribution that sampled it in
    spite of `trace.sampling.adjusted`, else why not: an option shifted finite logits, or a mask
    removed tokens and the trace holds no kept set to say which."""
    shifts = logit_shifts(trace.sampling)
    if shifts:
        return f"the sampler's logits were shifted by {', '.join(shifts)}: {ADJUSTED_SAMPLING_WHY}"
    if trace.sampling.adjusted and trace.support is None:
        return (f"the sampler's logits were masked by {', '.join(trace.sampling.adjusted)} and the trace holds no "
                "kept set recording what the masks left; scoring over the vocabulary gives masked tokens mass")
    return None


def _check_sampling(trace: RolloutTrace) -> None:
    problem = adjusted_sampling_problem(trace)
    if problem is not None:
        raise ScoringInputError(
            Where(record=trace.key, field="sampling.adjusted"),
            "sampling the trainer can reproduce (or PlanConfig(allow_adjusted_sampling=True), in a preset "
            "replay.allow_adjusted_sampling, to score the unadjusted logits over the kept set, which are not the "
            "engine's logprobs)",
            list(trace.sampling.adjusted), problem,
        )


def _check_trace(trace: RolloutTrace, geometry: ModelGeometry, config: PlanConfig, routes: bool = True) -> None:
    """Everything of one trace but its identity (geometry, family, weights version: identity.check_traces)."""
    where = Where(record=trace.key)
    if routes and trace.routes_TLK is None:
        raise TraceFormatError(where.with_(field="routes_TLK"), "recorded routes", None, "nothing to replay")
    trace.validate(where)
    if trace.prompt_len < 1:
        raise TraceFormatError(where.with_(field="prompt_len"), ">= 1 (token 0 has no logits to score it)", trace.prompt_len)
    if routes and trace.route_start > 0 and config.unrouted_prefix == "error":
        raise BatchLayoutError(
            where.with_(field="route_start"),
            "routes from token 0 (or PlanConfig.unrouted_prefix='free')",
            trace.route_start,
            f"tokens 0..{trace.route_start - 1} would be routed by the trainer, not the engine",
        )
    if trace.support is not None:
        sup, gen_G = trace.support, trace.token_ids_S[trace.generated_positions()]
        vocab = geometry.vocab_size
        kept_N = np.repeat(np.arange(sup.num_rows, dtype=np.int64), sup.sizes_G()) * vocab + sup.ids_N
        missing = np.flatnonzero(~np.isin(np.arange(len(gen_G), dtype=np.int64) * vocab + gen_G, kept_N)
                                 & ~sup.whole_flags())  # a row kept whole holds every token
        if len(missing):
            g = int(missing[0])
            raise TraceFormatError(
                where.with_(field=f"support[row {g}, position {int(trace.generated_positions()[g])}]"),
                f"the sampled token {int(gen_G[g])} in its kept set",
                f"a kept set of {len(sup.row(g))} ids without it ({len(missing)} such rows)",
            )


def _pad(traces: Sequence[RolloutTrace], config: PlanConfig) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    m = config.pad_to_multiple_of
    s_len = -(-max(t.num_tokens for t in traces) // m) * m
    input_ids_BS = torch.full((len(traces), s_len), config.pad_token_id, dtype=torch.long)
    mask_BS = torch.zeros((len(traces), s_len), dtype=torch.long)
    offsets_B = np.zeros(len(traces), dtype=np.int64)
    for b, t in enumerate(traces):
        off = s_len - t.num_tokens if config.padding_side == "left" else 0
        offsets_B[b] = off
        input_ids_BS[b, off : off + t.num_tokens] = torch.from_numpy(t.token_ids_S)
        mask_BS[b, off : off + t.num_tokens] = 1
    return input_ids_BS, mask_BS, offsets_B


def _check_batch(
    traces: Sequence[RolloutTrace], input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Find each row's real tokens from the mask and require them to be trace b's tokens."""
    if input_ids_BS.ndim != 2:
        raise BatchLayoutError(Where(field="input_ids"), "shape [B, S]", list(input_ids_BS.shape))
    if input_ids_BS.shape[0] != len(traces):
        raise BatchLayoutError(Where(field="input_ids"), f"{len(traces)} rows, one per trace", input_ids_BS.shape[0])
    if attention_mask_BS is None:
        attention_mask_BS = torch.ones_like(input_ids_BS)
    if attention_mask_BS.shape != input_ids_BS.shape:
        raise BatchLayoutError(Where(field="attention_mask"), f"shape {list(input_ids_BS.shape)}", list(attention_mask_BS.shape))
    ids_np = input_ids_BS.detach().cpu().numpy()
    mask_np = attention_mask_BS.detach().cpu().numpy() != 0
    by_tokens = {t.token_ids_S.tobytes(): j for j, t in enumerate(traces)}
    offsets_B = np.zeros(len(traces), dtype=np.int64)
    for b, trace in enumerate(traces):
        where = Where(record=trace.key, field=f"input_ids[row {b}]")
        cols = np.flatnonzero(mask_np[b])
        if len(cols) == 0 or cols[-1] - cols[0] + 1 != len(cols):
            raise BatchLayoutError(where, "one contiguous run of real tokens (left or right padding)", f"mask columns {cols[:8].tolist()}...")
        row = ids_np[b, cols].astype(np.int64)
        offsets_B[b] = cols[0]
        if np.array_equal(row, trace.token_ids_S):
            continue  # row b is trace b (GRPO groups can hold identical sequences: never look rows up by tokens first)
        other = by_tokens.get(row.tobytes())
        if other is not None:
            raise BatchLayoutError(where, f"tokens of trace {trace.key!r} (trace {b})", f"tokens of trace {traces[other].key!r} (trace {other})", "batch order differs from trace order")
        if len(row) != trace.num_tokens:
            raise BatchLayoutError(where, f"{trace.num_tokens} real tokens", len(row), "sequence length differs from the trace")
        if not np.array_equal(row, trace.token_ids_S):
            j = int(np.flatnonzero(row != trace.token_ids_S)[0])
            raise BatchLayoutError(where, f"token {int(trace.token_ids_S[j])} at position {j}", int(row[j]))
    return input_ids_BS.long(), attention_mask_BS.long(), offsets_B
