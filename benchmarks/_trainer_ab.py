"""The with/without summary both trainer benchmarks print (trl_grpo.py, verl_fsdp.py): the
keys `route_flip_rate_*`, `k3_kl_*` and the step time ratios against the stock trainer and against
the `none` preset, from per-arm step times and per-step metric logs of one interleaved run.
(Leading underscore: `moe-replay bench` runs every other script of this folder as a benchmark.)
"""

from __future__ import annotations

import os
import statistics
from typing import Any


def ab_summary(preset: str, stock: str, logs: dict[str, list[dict[str, float]]], wall: dict[str, list[float]],
               cpu: dict[str, list[float]], skip_first: int = 0) -> dict[str, Any]:
    """`logs[arm]`: one dict of metric means per step; `wall` / `cpu`: seconds per step per arm;
    `stock`: the arm of the trainer without moe_replay; the first `skip_first` steps (warm-up) are
    left out of the step times."""

    def mean(arm: str, key: str) -> float:
        return statistics.fmean(h[key] for h in logs[arm])

    med = {arm: statistics.median(ts[skip_first:]) for arm, ts in wall.items()}
    med_cpu = {arm: statistics.median(ts[skip_first:]) for arm, ts in cpu.items()}
    return {
        "route_flip_rate_none": mean("none", "moe_replay/route_flip_rate"),
        f"route_flip_rate_{preset}": mean(preset, "moe_replay/route_flip_rate"),
        "k3_kl_none": mean("none", "rollout_corr/k3_kl"),
        f"k3_kl_{preset}": mean(preset, "rollout_corr/k3_kl"),
        **{f"step_time_s_{arm}": m for arm, m in med.items()},
        "step_time_ratio": med[preset] / med[stock],
        "step_time_ratio_vs_none": med[preset] / med["none"],
        **{f"step_cpu_s_{arm}": m for arm, m in med_cpu.items()},
        "step_cpu_ratio": med_cpu[preset] / med_cpu[stock],
        "step_cpu_ratio_vs_none": med_cpu[preset] / med_cpu["none"],
        "load_average_1min": os.getloadavg()[0],
    }
