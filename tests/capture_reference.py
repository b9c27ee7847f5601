"""The per-token reference of capture's record assembly, for tests: what a record's arrays must be,
written row by row from the rows the flushes handed the row log, in arrival order.

integrations/vllm/capture/row_log.py lays records out with array ops over all taken records at
once; this walks every row in Python (a dict per position and per generated index, the newest
write wins), so a wrong vectorised step (a sort, an offset, a group cut) shows up as a difference.
`RowLogSpy` records what a real engine's flushes hand over.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class RowLogSpy:
    """Wraps a RowLog's add_routes / add_samples and keeps a copy of every row, in arrival order."""

    def __init__(self, log: Any) -> None:
        self.log, self.history = log, []
        self._add_routes, self._add_samples = log.add_routes, log.add_samples
        log.add_routes, log.add_samples = self.add_routes, self.add_samples

    def add_routes(self, uid_A, pos_A, rows_ALK, valid_A=None, step_A=None):
        valid = np.ones(len(uid_A), dtype=bool) if valid_A is None else np.asarray(valid_A, dtype=bool)
        self.history.append(("routes", {"uid": np.array(uid_A), "pos": np.array(pos_A), "rows": np.array(rows_ALK),
                                        "valid": valid.copy()}))
        self._add_routes(uid_A, pos_A, rows_ALK, valid_A, step_A)

    def add_samples(self, uid_A, g_A, staged, step_A=None):
        rows = [staged.ids_N[staged.offsets_R1[r]:staged.offsets_R1[r + 1]].copy() for r in range(len(uid_A))]
        outside = np.zeros(len(uid_A), bool) if staged.outside_R is None else staged.outside_R.copy()
        self.history.append(("samples", {"uid": np.array(uid_A), "g": np.array(g_A), "tokens": staged.tokens_R.copy(),
                                         "logprobs": staged.logprobs_R.copy(), "sizes": staged.sizes_R.copy(),
                                         "ids": rows, "outside": outside}))
        self._add_samples(uid_A, g_A, staged, step_A)

    def undo(self) -> None:
        del self.log.add_routes, self.log.add_samples


def reference_record(history: list, uid: int, route_start: int, L: int, K: int, route_dtype: Any) -> dict[str, Any]:
    """Record `uid`'s arrays and assembly problems from `history`, one row at a time."""
    routes: dict[int, tuple[np.ndarray, bool]] = {}
    samples: dict[int, tuple] = {}
    for kind, cols in history:
        for a in range(len(cols["uid"])):
            if int(cols["uid"][a]) != uid:
                continue
            if kind == "routes":
                rel = int(cols["pos"][a]) - route_start
                if rel >= 0:
                    routes[rel] = (cols["rows"][a], bool(cols["valid"][a]))
            else:
                samples[int(cols["g"][a])] = (int(cols["tokens"][a]), float(cols["logprobs"][a]), int(cols["sizes"][a]),
                                              cols["ids"][a], bool(cols["outside"][a]))
    n = max((r for r, (_, valid) in routes.items() if valid), default=-1) + 1
    routes_TLK = np.zeros((n, L, K), dtype=route_dtype)
    filled_T = np.zeros(n, dtype=bool)
    for r, (row, valid) in routes.items():
        if r < n:
            routes_TLK[r], filled_T[r] = row, valid
    problems = []
    G = max(samples, default=-1) + 1
    have = next((g for g in range(G) if g not in samples), G)
    if have < G:
        problems.append(f"sample for generated token {have} never arrived ({len(samples)} of {G})")
    rows = [samples[g] for g in range(have)]
    outside = [g for g, r in enumerate(rows) if r[4]]
    if outside:
        g = outside[0]
        problems.append(f"sampled token {rows[g][0]} of generated token {g} is outside its recorded sampling support "
                        f"({rows[g][2]} tokens; {len(outside)} such rows): the sampler drew from another set than "
                        "the one recorded (see sampler_hook.py: exactness)")
    ids = [r[3] for r in rows]
    return {
        "routes_TLK": routes_TLK, "routes_filled_T": filled_T,
        "tokens_G": np.array([r[0] for r in rows], dtype=np.int64),
        "logprobs_G": np.array([r[1] for r in rows], dtype=np.float32),
        "support_sizes_G": np.array([r[2] for r in rows], dtype=np.int64),
        "support_offsets_G1": np.concatenate([[0], np.cumsum([len(i) for i in ids])]).astype(np.int64),
        "support_ids_N": (np.concatenate(ids) if ids else np.zeros(0)).astype(np.int32),
        "problems": problems,
    }


ARRAYS = ("routes_TLK", "routes_filled_T", "tokens_G", "logprobs_G", "support_sizes_G", "support_offsets_G1",
          "support_ids_N")


def assert_record_equals(got: Any, want: dict[str, Any], where: str = "") -> None:
    """A CaptureRecord (or its dict) equals the reference: every array bit for bit, dtype included."""
    get = got.get if isinstance(got, dict) else lambda k: getattr(got, k)
    for name in ARRAYS:
        a, b = np.asarray(get(name)), want[name]
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where} {name}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert np.array_equal(a.view(np.uint8) if a.dtype.kind == "f" else a,
                              b.view(np.uint8) if b.dtype.kind == "f" else b), f"{where} {name} differs"
    problems = list(get("problems"))  # the flush's own problems (engine steps) come first
    assert problems[len(problems) - len(want["problems"]):] == want["problems"], f"{where} {problems}"
