"""Host seconds per named part of moe_replay's work around an engine (worker and client side).

Capture's cost is host work around each engine step, not the in-graph route write (an H100 with
CUDA graphs measured the write as free and per-step host copies at 21-35% of throughput,
../shared/notes/gpu.md), so every part of it is timed by name: per-step parts (`step.*`, run
inside the engine's step), per-flush parts (`flush.*`, once per many steps), per-take parts
(`take.*`, when the client collects) and the client's own (`client.*`). A benchmark reads them
with `VllmCapture.timings()` and divides by its own wall time to get each part's share.

Cost of the accounting itself: one perf_counter pair and one dict update per part, ~0.3 us
warm; a per-step part is summed in a `Tally` instead (inside an engine step, after a 30 ms
forward, the dict updates of PartTimes.add cost ~3 us a part a step).
"""

from __future__ import annotations

from typing import Any


class PartTimes:
    """Seconds and call counts per part name, cumulative until `reset()`."""

    __slots__ = ("seconds", "calls")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def add(self, part: str, seconds: float, calls: int = 1) -> None:
        self.seconds[part] = self.seconds.get(part, 0.0) + seconds
        self.calls[part] = self.calls.get(part, 0) + calls

    def total(self, prefix: str = "") -> float:
        """Seconds of every part whose name starts with `prefix`."""
        return sum(s for k, s in self.seconds.items() if k.startswith(prefix))

    def to_dict(self) -> dict[str, dict[str, float]]:
        """{part: {"s": seconds, "calls": count}} (msgpack- and JSON-able)."""
        return {k: {"s": s, "calls": self.calls[k]} for k, s in self.seconds.items()}

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class Tally:
    """Seconds and calls of one per-step part, summed in two numbers until `into` adds them to a
    PartTimes (before the times are read): two attribute updates on one small object per step
    instead of two dict updates."""

    __slots__ = ("part", "s", "calls")

    def __init__(self, part: str) -> None:
        self.part, self.s, self.calls = part, 0.0, 0

    def into(self, times: PartTimes) -> None:
        if self.calls:
            times.add(self.part, self.s, self.calls)
            self.s, self.calls = 0.0, 0


def merge_part_dicts(dicts: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Several `to_dict()`s summed per part."""
    out: dict[str, dict[str, Any]] = {}
    for d in dicts:
        for part, v in d.items():
            got = out.setdefault(part, {"s": 0.0, "calls": 0})
            got["s"] += float(v["s"])
            got["calls"] += int(v["calls"])
    return out


def merge_worker_timings(per_engine: list[dict[str, Any]]) -> dict[str, Any]:
    """The `capture.timings` replies of several data-parallel engines, summed (link.MERGES)."""
    return {"parts": merge_part_dicts([e["parts"] for e in per_engine]),
            "take_s": sum(float(e["take_s"]) for e in per_engine)}


def client_view(worker: dict[str, Any], client: PartTimes) -> dict[str, dict[str, float]]:
    """Disjoint parts, worker and client: the worker's parts, the client's own, and `client.rpc`,
    the take call as the client timed it minus the worker's time inside take() (transport, the
    reply's encoding and decoding, the wait for the engine to reach a step boundary)."""
    out = merge_part_dicts([worker["parts"]])
    mine = client.to_dict()
    call = mine.pop("client.take_call", None)
    if call is not None:
        out["client.rpc"] = {"s": max(0.0, call["s"] - float(worker["take_s"])), "calls": call["calls"]}
    out.update(mine)
    return out


def shares(parts: dict[str, dict[str, float]], wall_s: float) -> dict[str, Any]:
    """Each part's seconds as a fraction of `wall_s` (a benchmark's own wall time), largest first,
    with their sum under "total"."""
    out = {k: v["s"] / wall_s for k, v in sorted(parts.items(), key=lambda kv: -kv[1]["s"])}
    return {"total": sum(out.values()), **out}
