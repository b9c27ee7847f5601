"""Given routes against the model's own routing of their tokens: agreement, then the cause.

1. Agreement as given (every audit): row p of a sample against the model's route of position
   start + p, at each model MoE layer through the column that claims it. A sample is ALIGNED when its
   mean over rows and layers reaches `Thresholds.aligned`, every `window` consecutive rows reach
   `window_aligned`, and it holds the rows its tokens call for (S - 1 - start, or one more: the last
   token's row); the batch when every sample and every layer (pooled over samples) is.
2. Otherwise, in this order, the first explanation that holds:
   * another reading of the payload lines up (a Megatron list written batch-first): OTHER_SAMPLE;
   * some layers line up and others do not, or a column lines up with another layer than it claims:
     LAYERS (offset, swapped, foreign: matching no layer, missing);
   * the rows of each misaligned sample are searched for in the whole batch: a row is traced to a
     model row when at least `match_layers` of the layers hold equal expert sets and `min_run`
     consecutive rows follow the same offset in the batch's flat order. One offset within the sample:
     SHIFTED; rows of another sample: OTHER_SAMPLE; offsets that step (rows dropped or repeated, or
     rows missing or extra with the rest in place): ROWS;
   * nothing traced: OTHER_WEIGHTS when the rows agree above chance by `chance_margin` of what chance leaves
     ((a - c) / (1 - c)) or are
     token-consistent (`token_consistency`: real routers route one token alike), else RANDOM.

Legend: B samples, S a sample's tokens, T its rows, C columns, L model MoE layers, K top-k, W words
per expert set, N flat given rows, M flat model rows.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..errors import TraceFormatError, Where
from .compare import chance_agreement, chance_by_layer, codes, masks, overlap, popcounts, runs_ending, token_consistency
from .free import FreeRoutes
from .routes import RoutesBatch
from .thresholds import THRESHOLDS, Thresholds
from .verdict import (Aligned, AuditReport, BadIds, Cause, LayerMismatch, OtherSample, PromptShift, RowEdits, SampleVerdict,
                      Shifted, TailRows, Unexplained, Verdict, WrappedIds)

PAIR_BUDGET = 16_000_000
"""Most candidate row pairs the row search forms (pairs with equal expert sets at a layer, over the layers
it uses: the most telling first, 128 MiB of keys at most); 8 experts top-2 has 28 sets, so a 4,096-row
batch pairs ~600k rows a layer, while at 128 experts top-8 a row pairs with a handful."""
MAX_LISTED = 64
"""Positions a RowEdits verdict lists at most."""
LAYER_WIDE = 0.9
"""A layer's fault shows in every sample: a failing layer must fail in this share of the samples and a
passing layer pass in it, else the rows of some samples are off (three of six samples one token late
fail every layer and leave the layers' pooled agreement either side of `aligned`)."""


@dataclass(frozen=True)
class _Bars:
    """The agreement each sample, layer, window and filled run must reach: the raw thresholds or their
    chance-corrected ones (`Thresholds.*_above_chance` over `chance_L`), whichever is higher."""

    chance_L: np.ndarray
    """Agreement of unrelated tokens' rows under this routing, per model layer (compare.chance_by_layer)."""
    sample: float
    layer_L: np.ndarray
    window: float
    tail: float

    @classmethod
    def of(cls, chance_L: np.ndarray, t: Thresholds) -> "_Bars":
        c = float(chance_L.mean()) if len(chance_L) else 0.0
        return cls(chance_L, max(t.aligned, c + t.aligned_above_chance * (1 - c)),
                   np.maximum(t.aligned, chance_L + t.aligned_above_chance * (1 - chance_L)),
                   max(t.window_aligned, c + t.window_above_chance * (1 - c)), c + t.tail_above_chance * (1 - c))


@dataclass
class _Side:
    """One reading's masks and identity agreement."""

    given_TLW: list[np.ndarray]
    """Per sample, the rows through the columns claiming each model layer (no column: an empty set)."""
    overlap_BL: np.ndarray
    """Experts shared, summed over each sample's compared rows, per layer."""
    rows_B: np.ndarray
    """Rows compared per sample (those whose position the model has)."""
    rows_ok_B: np.ndarray
    window_B: np.ndarray
    """Per sample, the least mean agreement of `Thresholds.window` consecutive rows (over the model's layers)."""
    neighbour_B: np.ndarray
    """Per sample, the most that `window` consecutive rows agree better read one position off (either way)
    than as they stand: negative for aligned rows, ~ +0.3 over a stretch a dropped or repeated row shifted."""
    tails: list["TailRows | None"]
    """Per sample, its first filled run at an edge that does not line up (None: none)."""
    bad_rows: list[np.ndarray]
    """Per sample, the rows holding no top-k (repeated or out-of-range ids) outside such a run."""
    holes: list[np.ndarray]
    """Per sample, every row holding no top-k."""
    rest_ok_B: np.ndarray
    """Per sample, whether its rows outside filled edge runs and rows holding no top-k line up (agreement,
    windows, neighbours): rows in place but for those."""

    def cells(self, k: int) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.overlap_BL / (k * self.rows_B[:, None])

    def sample_agreement(self, k: int) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.rows_B > 0, self.overlap_BL.sum(1) / (k * self.rows_B * self.overlap_BL.shape[1]), 0.0)

    def layer_agreement(self, k: int) -> np.ndarray:
        total = max(int(self.rows_B.sum()), 1)
        return self.overlap_BL.sum(0) / (k * total)

    def in_place_B(self, k: int, t: Thresholds, bars: _Bars) -> np.ndarray:
        """bool [B]: samples whose rows line up as they stand, on average, in every window and against their
        neighbours (the row count and the edges aside)."""
        return (self.sample_agreement(k) >= bars.sample) & (self.window_B >= bars.window) & (self.neighbour_B < t.window_shift)

    def aligned_B(self, k: int, t: Thresholds, bars: _Bars) -> np.ndarray:
        """bool [B]: samples whose rows line up on average and in every window, number what the tokens call for,
        hold a top-k in every row and no filled run at an edge."""
        clean = np.array([tail is None and not len(bad) for tail, bad in zip(self.tails, self.bad_rows)], dtype=bool)
        return self.in_place_B(k, t, bars) & self.rows_ok_B & clean

    def aligned(self, k: int, t: Thresholds, bars: _Bars) -> bool:
        return bool(self.aligned_B(k, t, bars).all() and (self.layer_agreement(k) >= bars.layer_L).all())


def _side(batch: RoutesBatch, own: list[np.ndarray], col_of: list[int], num_experts: int, k: int, t: Thresholds,
          bars: _Bars) -> _Side:
    given, ov, rows, ok, win, nb, tails, bad_rows, holes, rest_ok = [], [], [], [], [], [], [], [], [], []
    mapped = [j for j, c in enumerate(col_of) if c >= 0]
    for s, own_SLW in zip(batch.samples, own):
        all_TCW = masks(s.routes_TCK, num_experts)
        g_TLW = np.zeros((len(all_TCW), len(col_of), own_SLW.shape[-1]), dtype=np.uint64)
        for j, c in enumerate(col_of):
            if c >= 0:
                g_TLW[:, j] = all_TCW[:, c]
        n = max(min(len(g_TLW), len(own_SLW) - s.start), 0)
        given.append(g_TLW)
        ov_TL = overlap(g_TLW[:n], own_SLW[s.start: s.start + n])
        ov.append(ov_TL.sum(0))
        rows.append(n)
        ok.append(s.rows_expected <= len(g_TLW) <= s.rows_expected + 1)
        a_T = ov_TL.mean(1) / k
        win.append(_least_window(a_T, t.window))
        nb.append(_neighbour_gain(g_TLW[:n], own_SLW, s.start, a_T, k, t.window))
        sets_TLW = g_TLW if len(mapped) == len(col_of) else g_TLW[:, mapped]
        no_top_k_T = (popcounts(sets_TLW) < k).any(1) if mapped else np.zeros(len(g_TLW), dtype=bool)
        tail, fill_T = _edge_runs(s, g_TLW, a_T, no_top_k_T, n, bars)
        tails.append(tail)
        bad_rows.append(np.flatnonzero(no_top_k_T & ~fill_T))
        holes.append(np.flatnonzero(no_top_k_T))
        skip_T = fill_T | no_top_k_T
        if not skip_T.any():
            rest_ok.append(True)  # judged as a whole (in_place_B)
        else:
            keep = ~skip_T[:n]
            a_rest = a_T[keep]
            rest_ok.append(bool(len(a_rest)) and float(a_rest.mean()) >= bars.sample
                           and _least_window(a_rest, t.window) >= bars.window
                           and _neighbour_gain(g_TLW[:n], own_SLW, s.start, a_T, k, t.window, skip_T[:n]) < t.window_shift)
    return _Side(given, np.array(ov, dtype=np.float64).reshape(len(own), len(col_of)), np.array(rows), np.array(ok),
                 np.array(win), np.array(nb), tails, bad_rows, holes, np.array(rest_ok, dtype=bool))


def _edges(s) -> list[tuple[int, str]]:
    """(position the edge is before, its name): the sequence's end (the last row is position S - 2), then the
    prompt / completion boundary and the turns' boundaries the pipeline said."""
    out = [(len(s.token_ids_S) - 1, "sequence_end")]
    out += [(p, "prompt_end" if p == s.prompt_len else "turn_end") for p in s.boundaries]
    return out


def _edge_runs(s, g_TLW: np.ndarray, a_T: np.ndarray, no_top_k_T: np.ndarray, n: int, bars: _Bars):
    """(the first filled run at an edge that does not line up, bool [T] of the rows of every such run).

    A run is the consecutive rows ending just before an edge that each repeat the row before them (the same
    expert sets at every layer) or hold no top-k. It is a finding when a row holds no top-k, or when its rows
    agree with the model's routing of their positions below `bars.tail` (a correct run of repeated rows routes
    repeated tokens alike and agrees at ~1.0)."""
    fill_T = np.zeros(len(g_TLW), dtype=bool)
    m = min(n, s.rows_expected)  # rows of positions start .. S - 2 (the last token's own row, if given, aside)
    if m < 1:
        return None, fill_T
    same_T = np.zeros(m, dtype=bool)
    same_T[1:] = (g_TLW[1:m, 0] == g_TLW[: m - 1, 0]).all(-1)  # the first layer first: few rows repeat it
    at = np.flatnonzero(same_T)
    same_T[at] = (g_TLW[at] == g_TLW[at - 1]).all((1, 2))
    run_T = runs_ending(same_T | no_top_k_T[:m])
    first = None
    for edge, name in _edges(s):
        i = edge - 1 - s.start
        if not 0 <= i < m or not run_T[i]:
            continue
        rows = np.arange(i - run_T[i] + 1, i + 1)
        if rows[0] == 0:
            continue  # a run from the first row on: no kept row before it, nothing an edge filled
        holes = bool(no_top_k_T[rows].any())
        agreement = float(a_T[rows].mean())
        if not holes and agreement >= bars.tail:
            continue
        fill_T[rows] = True
        if first is None:
            first = (name, rows, "no_top_k" if holes else "repeat", agreement)
    if first is None:
        return None, fill_T
    name, rows, fill, agreement = first
    rest = a_T[~fill_T[:n]]
    return TailRows(name, tuple(int(s.start + r) for r in rows[:MAX_LISTED]), fill, agreement,
                    float(rest.mean()) if len(rest) else 0.0), fill_T


def _neighbour_gain(g_TLW: np.ndarray, own_SLW: np.ndarray, start: int, a_T: np.ndarray, k: int, window: int,
                    skip_T: np.ndarray | None = None) -> float:
    """The largest gain, over windows of rows 1 .. T-2, of reading the rows one position later or earlier
    instead of as they stand (rows too few for a window: the whole of them; `skip_T` rows count as no gain);
    -1 without such rows."""
    t_count = len(g_TLW)
    if t_count < 3 or start + t_count >= len(own_SLW):
        return -1.0
    later = overlap(g_TLW[1:-1], own_SLW[start + 2: start + t_count]).mean(1) / k
    earlier = overlap(g_TLW[1:-1], own_SLW[start: start + t_count - 2]).mean(1) / k
    here = a_T[1:-1]
    d_later, d_earlier = here - later, here - earlier
    if skip_T is not None:
        d_later, d_earlier = np.where(skip_T[1:-1], 0.0, d_later), np.where(skip_T[1:-1], 0.0, d_earlier)
    return max(-_least_window(d_later, window), -_least_window(d_earlier, window))


def _least_window(row_T: np.ndarray, window: int) -> float:
    """The least mean of `window` consecutive values (of all of them when fewer; 0 when none)."""
    if not len(row_T):
        return 0.0
    if len(row_T) <= window:
        return float(row_T.mean())
    c = np.concatenate([[0.0], np.cumsum(row_T)])
    return float((c[window:] - c[:-window]).min() / window)


def diagnose(batch: RoutesBatch, free: FreeRoutes, thresholds: Thresholds = THRESHOLDS) -> AuditReport:
    """The AuditReport of `batch` against the model's own routing `free` of the same samples."""
    t0 = time.perf_counter()
    g, t = free.geometry, thresholds
    k, e = g.top_k, g.num_experts
    batch.check_top_k(k)
    if len(free.ids_SLK) != len(batch.samples):
        raise TraceFormatError(Where(field="free routes"), f"{len(batch.samples)} samples", len(free.ids_SLK))
    for s, ids in zip(batch.samples, free.ids_SLK):
        if len(ids) != len(s.token_ids_S):
            raise TraceFormatError(Where(record=s.key, field="free routes"), f"{len(s.token_ids_S)} positions", len(ids))
    claims = batch.claimed_layers(g.num_layers, g.moe_layer_ids)
    col_of = [claims.index(lid) if lid in claims else -1 for lid in g.moe_layer_ids]
    own = [masks(ids, e) for ids in free.ids_SLK]
    bars = _Bars.of(chance_by_layer(_first_rows(free.ids_SLK, CHANCE_ROWS), e, k), t)
    side = _side(batch, own, col_of, e, k, t, bars)
    agree_B, layer_L = side.sample_agreement(k), side.layer_agreement(k)
    ok_B = side.aligned_B(k, t, bars)

    verdicts: list[Verdict] = [Verdict(Cause.ALIGNED, Aligned(float(a))) for a in agree_B]
    batch_verdict = _wrapped(batch, free, col_of, e, k, t, agree_B, verdicts)
    if batch_verdict is None and not side.aligned(k, t, bars):
        batch_verdict = _reading(batch, own, col_of, e, k, t, bars, agree_B, ok_B, verdicts)
        if batch_verdict is None:  # (a reading that lines up explains the rows its payload slots held, zeros included)
            batch_verdict = _layers(batch, own, claims, col_of, g.moe_layer_ids, side, k, e, t, bars, ok_B, verdicts)
            if batch_verdict is None:
                _rows(batch, own, side, k, e, t, bars, ok_B, verdicts)
            if _bad_ids(batch, side, col_of, g.moe_layer_ids, e, agree_B, verdicts) or batch_verdict is None:
                batch_verdict = _batch_of(verdicts)
    if batch_verdict is None:
        batch_verdict = Verdict(Cause.ALIGNED, Aligned(float(layer_L.mean())))
    samples = tuple(SampleVerdict(b, s.key, float(agree_B[b]), s.rows_expected, len(s.routes_TCK), verdicts[b],
                                  float(side.window_B[b]), float(side.neighbour_B[b])) for b, s in enumerate(batch.samples))
    return AuditReport(batch.format, batch_verdict, samples, g.moe_layer_ids, tuple(float(a) for a in layer_L),
                       side.cells(k), t, free.forward_s, time.perf_counter() - t0,
                       chance=tuple(round(float(c), 6) for c in bars.chance_L))


CHANCE_ROWS = 4096
"""Rows of the model's own routing the chance agreement is counted over (frequencies of 128 experts: ample)."""


def _first_rows(ids: tuple[np.ndarray, ...], n: int) -> np.ndarray:
    """The first `n` rows of the samples' ids, concatenated (only the samples needed are copied)."""
    parts, have = [], 0
    for x in ids:
        if have >= n:
            break
        parts.append(x[: n - have])
        have += len(parts[-1])
    return np.concatenate(parts)


WRAPS = (("uint8", 0, 256), ("int8", -128, 128))
"""Integers expert ids are seen wrapped through: (name, least value, past the largest). Either keeps an id's low
byte, so ids taken mod 256 compare the routes with the model's ids wrapped alike (int8's negatives as their bytes)."""


def _wrapped(batch, free, col_of, e, k, t, agree_B, verdicts) -> Verdict | None:
    """WRAPPED_IDS: a model of more experts than a uint8 (256) / int8 (128) holds, routes whose every id such an
    integer holds (int8: some negative), and the model's own routing of the same tokens holding at least
    `wrapped_min_ids` ids it cannot (a correct routing holds those ids too)."""
    mapped = [c for c in col_of if c >= 0]
    if e <= 128 or not mapped:
        return None
    parts = [s.routes_TCK[:, mapped] for s in batch.samples if len(s.routes_TCK)]
    if not parts:
        return None
    lo, hi = min(int(p.min()) for p in parts), max(int(p.max()) for p in parts)
    wrap = next(((name, b) for name, a, b in WRAPS if e > b and a <= lo and hi < b and (a == 0 or lo < 0)), None)
    if wrap is None:
        return None
    dtype, past = wrap
    own_ids = np.concatenate(free.ids_SLK)
    above = int((own_ids >= past).sum())
    if above < t.wrapped_min_ids:
        return None
    j_of = [j for j, c in enumerate(col_of) if c >= 0]
    shared = total = 0
    for s, own_SLK in zip(batch.samples, free.ids_SLK):
        n = max(min(len(s.routes_TCK), len(own_SLK) - s.start), 0)
        g_NLW = masks(s.routes_TCK[:n][:, mapped] % 256, 256)
        o_NLW = masks(own_SLK[s.start: s.start + n][:, j_of] % 256, 256)
        shared += int(overlap(g_NLW, o_NLW).sum())
        total += n * len(mapped) * k
    ev = WrappedIds(dtype, e, hi, lo, above / max(own_ids.size, 1), float(agree_B.mean()), shared / max(total, 1))
    verdict = Verdict(Cause.WRAPPED_IDS, ev)
    for b in range(len(verdicts)):
        verdicts[b] = verdict
    return verdict


def _bad_ids(batch, side, col_of, layer_ids, e, agree_B, verdicts) -> bool:
    """OUT_OF_RANGE for each sample with rows holding no top-k outside a filled edge run, where nothing else
    explains its rows (ALIGNED but for them, filled at an edge besides, or another model's / random); whether any
    sample got it."""
    mapped = [c for c in col_of if c >= 0]
    j_of = [j for j, c in enumerate(col_of) if c >= 0]
    found = False
    for b, rows in enumerate(side.bad_rows):
        cause = verdicts[b].cause
        if cause in (Cause.OTHER_WEIGHTS, Cause.RANDOM):
            rows = side.holes[b]  # garbage: every row holding no top-k counts, an edge's too
        if not len(rows) or cause not in (Cause.ALIGNED, Cause.TAIL_ROWS, Cause.OTHER_WEIGHTS, Cause.RANDOM):
            continue
        s = batch.samples[b]
        ids = s.routes_TCK[rows][:, mapped]
        oor_RLK = (ids < 0) | (ids >= e)
        rep_RL = (np.diff(np.sort(ids, -1), axis=-1) == 0).any(-1) if ids.shape[-1] > 1 else np.zeros(ids.shape[:2], bool)
        r0, j0 = np.argwhere(oor_RLK.any(-1) | rep_RL)[0]
        all_ids = s.routes_TCK[:, mapped]
        verdicts[b] = Verdict(Cause.OUT_OF_RANGE, BadIds(int(oor_RLK.sum()), int(rep_RL.sum()), len(rows), int(all_ids.min()),
                                                         int(all_ids.max()), e, (int(s.start + rows[r0]), int(layer_ids[j_of[j0]])),
                                                         float(agree_B[b])))
        found = True
    return found


def _reading(batch, own, col_of, e, k, t, bars, agree_B, ok_B, verdicts) -> Verdict | None:
    """OTHER_SAMPLE when another reading of the payload lines up (rows traced through the payload's order)."""
    for name, other in batch.readings:
        alt = _side(other, own, col_of, e, k, t, bars)
        if not alt.aligned(k, t, bars):
            continue
        alt_agree = alt.sample_agreement(k)
        first = None
        for b in np.flatnonzero(~ok_B):
            src = _reading_sources(batch, other, b)
            counts = Counter(src.tolist())
            best = max(counts, key=lambda j: (counts[j], j != b)) if counts else int(b)
            ev = OtherSample(int(best), batch.samples[best].key, float(alt_agree[best]), float(np.mean(src != b)) if len(src) else 0.0,
                             float(agree_B[b]), name)
            verdicts[b] = Verdict(Cause.OTHER_SAMPLE, ev)
            first = first or verdicts[b]
        return first or Verdict(Cause.OTHER_SAMPLE, OtherSample(0, batch.samples[0].key, float(alt_agree.mean()), 0.0,
                                                                 float(agree_B.mean()), name))
    return None


def _reading_sources(batch: RoutesBatch, other: RoutesBatch, b: int) -> np.ndarray:
    """int64 [T]: which sample of the other reading each row of sample b belongs to, by the rows' payload
    slots (a row no slot names: its own sample)."""
    owner = {int(slot): j for j, s in enumerate(other.samples) if s.slots_T is not None for slot in s.slots_T}
    slots = batch.samples[b].slots_T
    if slots is None:
        return np.full(len(batch.samples[b].routes_TCK), b, dtype=np.int64)
    return np.array([owner.get(int(x), b) for x in slots], dtype=np.int64)


def _layers(batch, own, claims, col_of, layer_ids, side, k, e, t, bars, ok_B, verdicts) -> Verdict | None:
    """LAYERS when the rows line up at some layers (or through another column) and not at others.

    Judged per column: a column whose claimed layer does not line up holds another model layer's routes
    (remapped: its best match reaches `aligned`) or no model layer's (foreign); a column claiming a dense
    layer or nothing that lines up with a model layer whose own column does not is remapped too."""
    layer_L = side.layer_agreement(k)
    claimed_ok = layer_L >= bars.layer_L
    if claimed_ok.all() and all(c >= 0 for c in col_of):
        return None
    with np.errstate(invalid="ignore"):
        fails_L = np.nanmean(side.cells(k) < bars.layer_L[None], axis=0)  # share of samples failing at each layer
    if claimed_ok.any() and ((fails_L[~claimed_ok] < LAYER_WIDE).any() or (fails_L[claimed_ok] > 1 - LAYER_WIDE).any()):
        return None  # some samples fail at every layer, not every sample at some layers: the rows are off
    a_CL = _column_matrix(batch, own, side, k, e)
    index = {lid: j for j, lid in enumerate(layer_ids)}
    remapped, foreign, covered = [], [], {j for j in range(len(layer_ids)) if claimed_ok[j]}
    for c, claim in enumerate(claims):
        j_claim = index.get(claim)
        if j_claim is not None and claimed_ok[j_claim] and col_of[j_claim] == c:
            continue
        j_best = int(a_CL[c].argmax())
        if a_CL[c, j_best] >= bars.layer_L[j_best] and not claimed_ok[j_best] and claim is not None:
            remapped.append((int(claim), int(layer_ids[j_best]), float(a_CL[c, j_best])))
            covered.add(j_best)
        elif j_claim is not None and col_of[j_claim] == c:
            foreign.append((int(claim), float(layer_L[j_claim])))
    missing = [int(lid) for j, lid in enumerate(layer_ids) if col_of[j] < 0 and j not in covered]
    if not claimed_ok.any() and not remapped:
        return None  # no layer lines up anywhere: the rows are off, not the layers
    offsets = {model - claimed for claimed, model, _ in remapped}
    kind = ("offset" if len(offsets) == 1 else "swapped") if remapped else ("foreign" if foreign else "missing")
    ev = LayerMismatch(kind, tuple(sorted(remapped)), tuple(foreign), tuple(missing),
                       next(iter(offsets)) if kind == "offset" else None)
    verdict = Verdict(Cause.LAYERS, ev)
    for b in np.flatnonzero(~ok_B):
        verdicts[b] = verdict
    return verdict


def _column_matrix(batch, own, side, k, num_experts: int, max_rows: int = 8192) -> np.ndarray:
    """float [C, L]: agreement of each given column with each model layer over the rows as they stand
    (the first `max_rows` compared rows: enough to tell a layer's routes from another's)."""
    g_parts, o_parts = [], []
    for s, own_SLW, n in zip(batch.samples, own, side.rows_B):
        if n:
            g_parts.append(s.routes_TCK[:n])
            o_parts.append(own_SLW[s.start: s.start + n])
    if not g_parts:
        return np.zeros((batch.num_columns, own[0].shape[1]))
    g_NCW = masks(np.concatenate(g_parts)[:max_rows], num_experts)
    o_NLW = np.concatenate(o_parts)[:max_rows]
    return np.stack([overlap(g_NCW[:, c: c + 1], o_NLW).sum(0) for c in range(g_NCW.shape[1])]) / (k * len(g_NCW))


def _rows(batch, own, side, k, e, t, bars, ok_B, verdicts) -> None:
    """Trace each misaligned sample's rows through the batch and name the pattern (module docstring)."""
    agree_B = side.sample_agreement(k)
    own_base = np.concatenate([[0], np.cumsum([len(o) for o in own])])
    flawed = np.array([x is not None or len(r) > 0 for x, r in zip(side.tails, side.bad_rows)], dtype=bool)
    in_place = side.in_place_B(k, t, bars) | (flawed & side.rest_ok_B)
    for b in np.flatnonzero(~ok_B & in_place):  # rows in place: too few or many, filled at an edge, or no top-k (_bad_ids)
        s = batch.samples[b]
        if not side.rows_ok_B[b]:
            verdicts[b] = _row_edits(s, side.given_TLW[b], s.start + np.arange(len(side.given_TLW[b])), own[b], k, float(agree_B[b]))
        elif side.tails[b] is not None:
            verdicts[b] = Verdict(Cause.TAIL_ROWS, side.tails[b])
    bad = [int(b) for b in np.flatnonzero(~ok_B) if not in_place[b]]
    if not bad:
        return
    given = [side.given_TLW[b] for b in bad]
    expected = np.concatenate([own_base[b] + batch.samples[b].start + np.arange(len(side.given_TLW[b])) for b in bad])
    src_N = _row_sources(given, own, expected, t)
    unexplained, at = [], 0
    for b, g_TLW in zip(bad, given):
        src = src_N[at: at + len(g_TLW)]
        at += len(g_TLW)
        v = _classify(b, batch, g_TLW, src, own, own_base, k, t, bars, float(agree_B[b]))
        if v is None:
            unexplained.append(b)
        else:
            verdicts[b] = v
    if unexplained:
        _unexplained(batch, own, side, unexplained, k, e, t, verdicts)


def _row_sources(given: list[np.ndarray], own: list[np.ndarray], expected_N: np.ndarray, t: Thresholds) -> np.ndarray:
    """int64 [N]: for each given row (samples concatenated), the flat model row it was traced to, or -1.

    Candidate pairs share the expert set at a layer; a pair holding equal sets at >= `match_layers` of
    the layers is a match; matches on one offset (model row - the row's own position, flat) that follow
    each other (a gap of one row allowed) form runs, and a row keeps the match of its longest run of at
    least `min_run` rows (ties: the offset nearest 0)."""
    if not given or not sum(len(x) for x in given):
        return np.full(0, -1, dtype=np.int64)
    g_NLW, o_MLW = np.concatenate(given), np.concatenate(own)
    n, m, l_count = len(g_NLW), len(o_MLW), g_NLW.shape[1]
    cg_NL, co_ML = codes(g_NLW), codes(o_MLW)
    spans = []
    for layer in range(l_count):
        order = np.argsort(co_ML[:, layer], kind="stable")
        sorted_codes = co_ML[order, layer]
        lo = np.searchsorted(sorted_codes, cg_NL[:, layer], "left")
        counts = np.searchsorted(sorted_codes, cg_NL[:, layer], "right") - lo
        spans.append((int(counts.sum()), order, lo, counts))
    keys, used, total_pairs = [], 0, 0
    for total, order, lo, counts in sorted(spans, key=lambda x: x[0]):  # the most telling layers first
        if total_pairs + total > PAIR_BUDGET:
            break
        used, total_pairs = used + 1, total_pairs + total
        g_idx = np.repeat(np.arange(n, dtype=np.int64), counts)
        starts = np.repeat(lo - (np.cumsum(counts) - counts), counts)
        keys.append(g_idx * m + order[starts + np.arange(total)])
    src = np.full(n, -1, dtype=np.int64)
    if not keys:
        return src
    pair, hits = np.unique(np.concatenate(keys), return_counts=True)
    pair = pair[hits >= _layers_needed(t, used)]
    if not len(pair):
        return src
    g_P, o_P = np.divmod(pair, m)
    d_P = o_P - expected_N[g_P]
    order = np.lexsort((g_P, d_P))
    g_s, d_s = g_P[order], d_P[order]
    brk = np.ones(len(g_s), dtype=bool)
    brk[1:] = (d_s[1:] != d_s[:-1]) | (g_s[1:] - g_s[:-1] > 2)
    run_id = np.cumsum(brk) - 1
    run_len = np.bincount(run_id)[run_id]
    keep = run_len >= t.min_run
    g_k, d_k, len_k, o_k = g_s[keep], d_s[keep], run_len[keep], o_P[order][keep]
    pick = np.lexsort((np.abs(d_k), -len_k, g_k))
    g_k, o_k = g_k[pick], o_k[pick]
    first = np.ones(len(g_k), dtype=bool)
    first[1:] = g_k[1:] != g_k[:-1]
    src[g_k[first]] = o_k[first]
    return src


def _layers_needed(t: Thresholds, layers: int) -> int:
    """Layers of equal sets a pair needs: `match_layers` of them, and every layer up to 3 (two layers of 8
    experts top-2 have 784 joint sets: one equal layer of two pairs random rows ~1 time in 10)."""
    return max(math.ceil(t.match_layers * layers), min(layers, 3))


def _classify(b, batch, g_TLW, src_T, own, own_base, k, t, bars, agree) -> Verdict | None:
    """A misaligned sample's verdict from where its rows were traced (None: too few rows traced)."""
    s, t_count = batch.samples[b], len(g_TLW)
    found = src_T >= 0
    if t_count == 0 or found.mean() < t.pattern:
        return None
    j_T = np.searchsorted(own_base, np.maximum(src_T, 0), side="right") - 1
    mine, others = found & (j_T == b), found & (j_T != b)
    d_T = src_T - own_base[b] - (s.start + np.arange(t_count))
    v = _prompt_shift(s, g_TLW, d_T, mine, own[b], k, t, bars)
    if v is not None:
        return v
    counts = Counter(d_T[mine].tolist())
    steps = [d for d, n in counts.items() if n >= max(t.min_run, t.pattern * 0.2 * t_count)]
    if len(steps) == 1 and steps[0] != 0 and counts[steps[0]] >= t.pattern * t_count:
        shifted = _dense(g_TLW, own[b], s.start + int(steps[0]), k)
        if shifted >= bars.sample:
            return Verdict(Cause.SHIFTED, Shifted(int(steps[0]), shifted, agree))
    off = found & ~(mine & (d_T == 0))  # rows traced anywhere but to their own position
    if others.any() and others.sum() >= t.pattern * off.sum():
        j_best = Counter(j_T[others].tolist()).most_common(1)[0][0]
        traced = _traced(g_TLW, own, src_T, found, k)
        ev = OtherSample(int(j_best), batch.samples[j_best].key, _traced(g_TLW, own, src_T, others & (j_T == j_best), k),
                         float(others.mean()), agree)
        return Verdict(Cause.OTHER_SAMPLE, ev) if traced >= bars.sample else None
    v = _row_edits(s, g_TLW, np.where(mine, src_T - own_base[b], -1), own[b], k, agree)
    return v if v.evidence.agreement >= bars.sample else None


def _prompt_shift(s, g_TLW, d_T, mine, own_S, k, t, bars) -> Verdict | None:
    """PROMPT_SHIFT: the prompt's rows traced to their own sample `shift` positions on (one offset, most of
    them), the completion's rows in place (no run of them traced elsewhere), both lining up so read."""
    if s.prompt_len is None:
        return None
    q_T = s.start + np.arange(len(g_TLW))
    pre, post = q_T < s.prompt_len, (q_T >= s.prompt_len) & (q_T < len(own_S))
    if pre.sum() < t.min_run or post.sum() < t.min_run:
        return None
    counts = Counter(d_T[mine & pre].tolist())
    counts.pop(0, None)
    if not counts:
        return None
    shift, n_shift = max(counts.items(), key=lambda x: (x[1], -abs(x[0])))
    if n_shift < max(t.min_run, t.pattern * pre.sum()) or (mine & post & (d_T != 0)).sum() >= t.min_run:
        return None
    span = pre & (q_T + shift >= 0) & (q_T + shift < len(own_S))
    shifted = float(overlap(g_TLW[span], own_S[q_T[span] + shift]).mean() / k)
    completion = float(overlap(g_TLW[post], own_S[q_T[post]]).mean() / k)
    if shifted < bars.sample or completion < bars.sample:
        return None
    as_given = float(overlap(g_TLW[pre], own_S[q_T[pre]]).mean() / k)
    return Verdict(Cause.PROMPT_SHIFT, PromptShift(int(shift), int(s.prompt_len), int(n_shift), shifted, as_given, completion))


def _row_edits(s, g_TLW, q_T, own_S, k, agree) -> Verdict:
    """ROWS: positions no row holds (dropped) and positions two rows hold (duplicated), from `q_T`, the
    position each row holds the route of (-1: a row traced nowhere, covering nothing)."""
    held = (q_T >= 0) & (q_T < len(own_S))
    q_in = q_T[held]
    positions = np.arange(s.start, s.start + s.rows_expected)
    covered = np.bincount(q_in, minlength=len(own_S))
    dropped = tuple(int(p) for p in positions[covered[positions] == 0][:MAX_LISTED])
    duplicated = tuple(int(p) for p in np.flatnonzero(covered >= 2)[:MAX_LISTED])
    traced = float(overlap(g_TLW[held], own_S[q_in]).mean() / k) if held.any() else 0.0
    return Verdict(Cause.ROWS, RowEdits(s.rows_expected, len(g_TLW), dropped, duplicated, traced, agree))


def _dense(g_TLW: np.ndarray, own_SLW: np.ndarray, first: int, k: int) -> float:
    """Agreement of the rows read from position `first` on (rows outside the sample left out)."""
    lo = max(0, -first)
    hi = min(len(g_TLW), len(own_SLW) - first)
    if hi <= lo:
        return 0.0
    return float(overlap(g_TLW[lo:hi], own_SLW[first + lo: first + hi]).mean() / k)


def _traced(g_TLW, own, src_T, sel, k) -> float:
    o = np.concatenate(own)
    return float(overlap(g_TLW[sel], o[src_T[sel]]).mean() / k) if sel.any() else 0.0


def _unexplained(batch, own, side, bad, k, e, t, verdicts) -> None:
    """OTHER_WEIGHTS or RANDOM for samples whose rows were traced nowhere (module docstring)."""
    g_parts, o_parts, tok_parts = [], [], []
    for b in bad:
        s, n = batch.samples[b], int(side.rows_B[b])
        g_parts.append(side.given_TLW[b][:n])
        o_parts.append(own[b][s.start: s.start + n])
        tok_parts.append(s.token_ids_S[s.start: s.start + n])
    g_NLW, o_NLW, tok_N = np.concatenate(g_parts), np.concatenate(o_parts), np.concatenate(tok_parts)
    cap = 16384  # token consistency counts pairs per token id: a sample of rows is enough
    tc = token_consistency(g_NLW[:cap], tok_N[:cap], e, k)
    tc_model = token_consistency(o_NLW[:cap], tok_N[:cap], e, k)
    agree_B = side.sample_agreement(k)
    for b, g_TLW, o_TLW in zip(bad, g_parts, o_parts):
        chance = chance_agreement(g_TLW, o_TLW, e, k)
        s = batch.samples[b]
        best = max(_dense(side.given_TLW[b], own[b], s.start + d, k) for d in (-2, -1, 1, 2))
        a = float(agree_B[b])
        real = a - chance >= t.chance_margin * (1 - chance) or (tc is not None and tc >= t.token_consistency)
        verdicts[b] = Verdict(Cause.OTHER_WEIGHTS if real else Cause.RANDOM, Unexplained(a, chance, tc, tc_model, best))


_ORDER = {c: i for i, c in enumerate(Cause)}


def _batch_of(verdicts: list[Verdict]) -> Verdict:
    """The batch's verdict: the most common cause among the misaligned samples (ties: Cause order),
    with the evidence of its first sample."""
    bad = [v for v in verdicts if not v.ok]
    if not bad:
        return verdicts[0]
    counts = Counter(v.cause for v in bad)
    cause = min(counts, key=lambda c: (-counts[c], _ORDER[c]))
    return next(v for v in bad if v.cause is cause)
