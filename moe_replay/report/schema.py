"""The demo report's JSON schema, checked before anything is drawn.

A report (written by `moe-replay demo`, read by `moe-replay report`)::

    {"moe_replay_version": str, "wall_s": float,
     "setup": {free-form: family, engine_dtype, trainer_dtype, steps, ...},
     "arms": {ARM: {"preset": str, "description": str,
                    "mean": {"route_flip_rate": f, "k3_kl": f, "max_abs_logprob_diff": f, "reward": f, ...},
                    "steps": [{"step": int, "route_flip_rate": f, "k3_kl": f, "max_abs_logprob_diff": f,
                               "mean_abs_logprob_diff": f, "reward": f, "wall_s": f,
                               "route_agreement_per_layer": {"<layer id>": f, ...},
                               "abs_logprob_diff_hist": {"edges": [f] * (n + 1), "counts": [int] * n},
                               ...}]}}}

An optional "engine_noise" section (moe_replay/demo/noisy.py; shown by noise_section.py) is checked
by `validate_noise_section` when present. Extra keys anywhere are kept and ignored; a missing or mistyped required key raises
ReportSchemaError naming its full path, e.g. `report["arms"]["none"]["steps"][3]["k3_kl"]`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from ..errors import MoeReplayError

MEAN_KEYS = ("route_flip_rate", "k3_kl", "max_abs_logprob_diff", "reward")
"""Per-arm means every report carries (the arm table's columns)."""
STEP_KEYS = ("route_flip_rate", "k3_kl", "max_abs_logprob_diff", "mean_abs_logprob_diff", "reward", "wall_s")
"""Per-step floats every step record carries."""


NOISE_SECTION = "engine_noise"
"""The optional engine-noise section's key (moe_replay/demo/noisy.py writes it, noise_section.py shows it)."""


class ReportSchemaError(MoeReplayError, ValueError):
    """A report dict lacks a required key or holds a value of the wrong type (the message names the key path)."""


def _path(parts: tuple[Any, ...]) -> str:
    return "report" + "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in parts)


def _get(d: dict, key: str, types: type | tuple[type, ...], what: str, parts: tuple[Any, ...]) -> Any:
    if key not in d:
        have = ", ".join(repr(k) for k in list(d)[:12]) or "none"
        raise ReportSchemaError(f"{_path(parts + (key,))}: missing key {key!r} ({what}); keys present: {have}")
    value = d[key]
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in _as_tuple(types))
    if not ok:
        raise ReportSchemaError(
            f"{_path(parts + (key,))}: expected {what}, found {type(value).__name__} {_short(value)}"
        )
    return value


def _as_tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


NUMBER = numbers.Real
"""Any real number: int, float, and numpy scalars (the demo may pass its dict in-process)."""
INTEGER = numbers.Integral


def validate_report(report: Any) -> dict:
    """Check `report` against the schema above; return it unchanged, or raise ReportSchemaError."""
    if not isinstance(report, dict):
        raise ReportSchemaError(f"report: expected a JSON object, found {type(report).__name__}")
    _get(report, "moe_replay_version", str, "the moe_replay version string", ())
    _get(report, "wall_s", NUMBER, "total wall time in seconds (a number)", ())
    _get(report, "setup", dict, "a dict describing the run", ())
    arms = _get(report, "arms", dict, "a dict of arm name -> arm", ())
    if not arms:
        raise ReportSchemaError("report['arms']: expected at least one arm, found an empty dict")
    for name, arm in arms.items():
        at = ("arms", name)
        if not isinstance(arm, dict):
            raise ReportSchemaError(f"{_path(at)}: expected a dict, found {type(arm).__name__}")
        _get(arm, "preset", str, "the preset name", at)
        _get(arm, "description", str, "a one-line description", at)
        mean = _get(arm, "mean", dict, "a dict of per-arm mean metrics", at)
        for key in MEAN_KEYS:
            _get(mean, key, NUMBER, "a number", at + ("mean",))
        steps = _get(arm, "steps", list, "a list of per-step records", at)
        if not steps:
            raise ReportSchemaError(f"{_path(at + ('steps',))}: expected at least one step, found an empty list")
        edges0 = None
        for i, step in enumerate(steps):
            sp = at + ("steps", i)
            if not isinstance(step, dict):
                raise ReportSchemaError(f"{_path(sp)}: expected a dict, found {type(step).__name__}")
            _get(step, "step", INTEGER, "the step number (an int)", sp)
            for key in STEP_KEYS:
                _get(step, key, NUMBER, "a number", sp)
            per_layer = _get(step, "route_agreement_per_layer", dict, "a dict of MoE layer id -> agreement", sp)
            for layer, value in per_layer.items():
                lp = sp + ("route_agreement_per_layer",)
                try:
                    int(layer)
                except (TypeError, ValueError):
                    raise ReportSchemaError(f"{_path(lp)}: keys must be layer ids like '3', found {layer!r}") from None
                _get(per_layer, layer, NUMBER, "a number in [0, 1]", lp)
            hist = _get(step, "abs_logprob_diff_hist", dict, "a histogram {'edges': [...], 'counts': [...]}", sp)
            hp = sp + ("abs_logprob_diff_hist",)
            edges = _get(hist, "edges", list, "a list of n + 1 bin edges", hp)
            counts = _get(hist, "counts", list, "a list of n counts", hp)
            if len(edges) != len(counts) + 1 or not counts:
                raise ReportSchemaError(
                    f"{_path(hp)}: expected len(edges) == len(counts) + 1 with >= 1 bin, "
                    f"found {len(edges)} edges and {len(counts)} counts"
                )
            if not all(isinstance(e, NUMBER) and not isinstance(e, bool) for e in edges) or any(
                not b > a for a, b in zip(edges, edges[1:]) if math.isfinite(a) and math.isfinite(b)
            ):
                raise ReportSchemaError(f"{_path(hp + ('edges',))}: expected increasing numbers, found {_short(edges)}")
            if not all(isinstance(c, INTEGER) and not isinstance(c, bool) and c >= 0 for c in counts):
                raise ReportSchemaError(f"{_path(hp + ('counts',))}: expected non-negative ints, found {_short(counts)}")
            if edges0 is None:
                edges0 = edges
            elif edges != edges0:
                raise ReportSchemaError(
                    f"{_path(hp + ('edges',))}: every step of an arm must use the same bin edges; "
                    f"step 0 has {_short(edges0)}, this step {_short(edges)}"
                )
    validate_noise_section(report)
    return report


def validate_noise_section(report: dict) -> None:
    """Check report["engine_noise"] when present (ReportSchemaError naming the key path)."""
    if NOISE_SECTION not in report:
        return
    at = (NOISE_SECTION,)
    sec = _get(report, NOISE_SECTION, dict, "the engine-noise section (a dict)", ())
    _get(sec, "label", str, "the instrument's label", at)
    est = _get(sec, "estimator", dict, "the estimator's statistics per n", at)
    var = _get(est, "var", dict, "a dict of n -> variance of π_old", at + ("estimator",))
    if "1" not in var:
        raise ReportSchemaError(f"{_path(at + ('estimator', 'var'))}: expected n = '1' (the ratio's base), found {sorted(var)}")
    for key in ("var", "pi_old_abs_diff"):
        d = _get(est, key, dict, f"a dict of n -> {key}", at + ("estimator",))
        for n in d:
            if not str(n).isdigit():
                raise ReportSchemaError(f"{_path(at + ('estimator', key))}: keys must be replica counts like '4', found {n!r}")
            _get(d, n, NUMBER, "a number", at + ("estimator", key))
    ratio = _get(est, "variance_ratio", dict, "a dict of n -> variance ratio to n = 1 (None where n = 1's is 0)", at + ("estimator",))
    for n, v in ratio.items():
        if v is not None:
            _get(ratio, n, NUMBER, "a number or null", at + ("estimator", "variance_ratio"))
    clip = sec.get("phantom_clip")
    if clip is not None:
        _get(sec, "phantom_clip", dict, "the phantom-clip comparison (a dict)", at)
        for key in ("rollout_logprobs", "estimate", "clip_eps"):
            _get(clip, key, NUMBER, "a number", at + ("phantom_clip",))
        _get(clip, "n", INTEGER, "the n of the estimate (an int)", at + ("phantom_clip",))
