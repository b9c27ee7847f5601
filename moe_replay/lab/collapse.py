"""The long runs' collapse rule and collapse boundary, pre-registered: written here before any
run was made (the tuning pilots included), in docs/lab.md ("Long runs") before the grid ran, and
not changed after.

A run (one arm, one noise level, one seed) **collapses** when any of these holds:

  * **reward**: the reward, smoothed by a trailing mean over `window` = 10 steps (one step's reward
    is the mean of 32 samples, sd up to ~0.09: raw steps would trip the rule on noise), stays below
    `drop` = 1/2 of its peak for `patience` = 20 consecutive steps after the peak's step;
  * **kl**: the vllm-kl (token-mean k3 of the trainer's logprobs against the engine's, at the
    rollout's weights) stays above max(`kl_line` = 0.1, `kl_growth` = 5 x the median of its first
    `kl_baseline_steps` = 20 steps) for `kl_patience` = 10 consecutive steps. 0.1 is the batch-skip
    line (configs/r3_support_batch_skip.yaml); the 5x-own-baseline clause makes the rule fire on a
    mismatch that *grows* during training, not on the static mismatch a high noise level has from
    step 0 (at 8x the noise alone may sit above 0.1: that is the instrument's level, not a collapse);
  * **nonfinite**: any step's vllm-kl, grad norm or loss is NaN or infinite.

A run shorter than `window + patience` steps cannot show the reward clause: its verdict says
`judgeable: false` (a `collapsed: false` there means "not seen", not "stable").

The **boundary** of an arm is the smallest noise level at which at least half of its seeds collapse
(1 of 1, 1 of 2, 2 of 3); none at any level is reported as `level: null` with the largest level tried.

Pure numpy: no engine, no model (tests/test_lab_runs.py checks the rule on synthetic curves).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class CollapseRule:
    """The pre-registered collapse rule (module docstring); COLLAPSE_RULE is the one the runs use."""

    window: int = 10
    drop: float = 0.5
    patience: int = 20
    kl_line: float = 0.1
    kl_growth: float = 5.0
    kl_baseline_steps: int = 20
    kl_patience: int = 10

    def __post_init__(self) -> None:
        for name in ("window", "patience", "kl_baseline_steps", "kl_patience"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"CollapseRule.{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not 0.0 < self.drop < 1.0:
            raise ValueError(f"CollapseRule.drop must be in (0, 1), got {self.drop!r}")
        if not (self.kl_line > 0 and self.kl_growth >= 1.0):
            raise ValueError(f"CollapseRule needs kl_line > 0 and kl_growth >= 1, got {self.kl_line!r}, {self.kl_growth!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


COLLAPSE_RULE = CollapseRule()


@dataclass(frozen=True)
class Verdict:
    """What the rule says about one run's curves."""

    collapsed: bool
    reason: str | None
    """'reward', 'kl' or 'nonfinite' (the first clause to fire, by step); None when not collapsed."""
    step: int | None
    """The first step of the failing stretch (the nonfinite step itself)."""
    judgeable: bool
    """False when the run is too short for the reward clause (< window + patience steps)."""
    peak: float | None
    """Peak of the smoothed reward and its step (the step ending the window)."""
    peak_step: int | None
    kl_threshold: float | None
    """The kl clause's line for this run: max(kl_line, kl_growth x early median)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def smoothed(x: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over `window` steps, defined from step window - 1 on ([len - window + 1])."""
    a = np.asarray(x, dtype=np.float64)
    if len(a) < window:
        return np.empty(0)
    c = np.concatenate([[0.0], np.cumsum(a)])
    return (c[window:] - c[:-window]) / window


def _first_run(mask: np.ndarray, length: int) -> int | None:
    """Index of the first stretch of `length` consecutive True in `mask`, or None."""
    count = 0
    for i, m in enumerate(mask):
        count = count + 1 if m else 0
        if count == length:
            return i - length + 1
    return None


def judge(curves: Mapping[str, Sequence[float]], rule: CollapseRule = COLLAPSE_RULE) -> Verdict:
    """The rule on one run's per-step curves: `reward` and `vllm_kl` (required), `grad_norm` and
    `loss` (optional, read for the nonfinite clause). A key's absence is a KeyError naming it."""
    for key in ("reward", "vllm_kl"):
        if key not in curves:
            raise KeyError(f"judge: curves need {key!r}; got {sorted(curves)}")
    reward = np.asarray(curves["reward"], dtype=np.float64)
    kl = np.asarray(curves["vllm_kl"], dtype=np.float64)
    if len(kl) != len(reward):
        raise ValueError(f"judge: reward has {len(reward)} steps, vllm_kl {len(kl)}")
    found: list[tuple[int, str]] = []

    bad = ~np.isfinite(kl)
    for key in ("grad_norm", "loss"):
        if key in curves:
            bad |= ~np.isfinite(np.asarray(curves[key], dtype=np.float64))
    if bad.any():
        found.append((int(np.argmax(bad)), "nonfinite"))

    judgeable = len(reward) >= rule.window + rule.patience
    peak = peak_step = None
    sm = smoothed(reward, rule.window)
    if len(sm):
        i_peak = int(np.argmax(sm))
        peak, peak_step = float(sm[i_peak]), i_peak + rule.window - 1
        if peak > 0:
            start = _first_run(sm[i_peak + 1:] < rule.drop * peak, rule.patience)
            if start is not None:
                found.append((i_peak + 1 + start + rule.window - 1, "reward"))

    kl_threshold = None
    if len(kl) >= rule.kl_baseline_steps:
        base = kl[: rule.kl_baseline_steps]
        base = base[np.isfinite(base)]
        kl_threshold = max(rule.kl_line, rule.kl_growth * float(np.median(base))) if len(base) else rule.kl_line
        start = _first_run(np.where(np.isfinite(kl), kl, 0.0) > kl_threshold, rule.kl_patience)
        if start is not None:
            found.append((start, "kl"))

    if not found:
        return Verdict(False, None, None, judgeable, peak, peak_step, kl_threshold)
    step, reason = min(found)
    return Verdict(True, reason, step, judgeable, peak, peak_step, kl_threshold)


def level_key(scale: float) -> str:
    """The JSON key of a noise level: 'off' for 0, else the scale ('1', '2', '0.5')."""
    return "off" if scale == 0 else f"{scale:g}"


def parse_level(text: str) -> float:
    """A noise level from the command line: 'off', a NOISE_LEVELS name ('calibrated', '2x') or a
    number >= 0 (the EngineNoise scale). ValueError naming the accepted forms otherwise."""
    from ..noise import NOISE_LEVELS

    t = text.strip()
    if t in NOISE_LEVELS:
        return NOISE_LEVELS[t]
    try:
        v = float(t[:-1] if t.endswith("x") else t)
    except ValueError:
        v = float("nan")
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"noise level {text!r}: expected 'off', one of {sorted(NOISE_LEVELS)} or a number >= 0 (the EngineNoise scale)")
    return v


def boundary(verdicts: Mapping[str, Mapping[str, Verdict]]) -> dict[str, Any]:
    """One arm's boundary from its verdicts {level key: {seed: Verdict}}: the smallest level (by
    scale) at which at least half of the seeds collapsed; `level` None when no level did."""
    if not verdicts:
        raise ValueError("boundary: no levels were run for this arm")
    order = sorted(verdicts, key=parse_level)
    counts = {lv: [sum(v.collapsed for v in verdicts[lv].values()), len(verdicts[lv])] for lv in order}
    hit = [lv for lv in order if counts[lv][1] and 2 * counts[lv][0] >= counts[lv][1]]
    judgeable = all(v.judgeable for lv in order for v in verdicts[lv].values())
    return {
        "level": hit[0] if hit else None,
        "largest_level_tried": order[-1],
        "levels_tried": order,
        "collapsed_seeds": {lv: f"{k}/{n}" for lv, (k, n) in counts.items()},
        "all_runs_judgeable": judgeable,
        "rule": "smallest level at which at least half of the seeds collapse (moe_replay/lab/collapse.py)",
    }
