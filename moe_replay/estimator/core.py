"""Multi-sample π_old: average n re-scorings of each rollout in probability space.

Why probability space: π_old enters the loss as a ratio π_θ / π_old of probabilities, and the
engine's run-to-run noise is noise on probabilities; the arithmetic mean of n probability samples
is unbiased for their expectation with variance σ²/n, whereas averaging logprobs (the geometric
mean) is biased low by Jensen's gap. Both rules are offered so the difference can be measured.

Legend: R replicas (scorings) of one sequence, G generated (response) tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol, Sequence

import numpy as np

from ..trace import RolloutTrace

Averaging = Literal["prob", "log"]


@dataclass(frozen=True)
class EstimatorConfig:
    """How many times to re-score each rollout and how to combine the scores."""

    n: int = 4
    """Replicas per rollout (the fixed count; in adaptive mode, the count before any stopping)."""
    averaging: Averaging = "prob"
    """'prob': mean of probabilities (default, unbiased); 'log': mean of logprobs (geometric)."""
    adaptive: bool = False
    """Stop early where replicas agree; add replicas (up to max_n) where they do not."""
    min_n: int = 2
    """Adaptive: replicas every rollout gets before the agreement test."""
    max_n: int = 16
    """Adaptive: upper bound on replicas per rollout."""
    rel_tol: float = 1e-3
    """Adaptive: stop once every token's standard error / mean probability is below this."""
    batch_placement: Literal["rotate", "shuffle", "same"] = "rotate"
    """How replicas are spread over batches: on GPUs, batch composition is what makes engine
    noise real, so each replica of a rollout sits beside different neighbours ('same' disables it)."""
    seed: int = 0
    """Seed of the 'shuffle' placement."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"EstimatorConfig.n must be >= 1, got {self.n}")
        if self.averaging not in ("prob", "log"):
            raise ValueError(f"EstimatorConfig.averaging must be 'prob' or 'log', got {self.averaging!r}")
        if self.batch_placement not in ("rotate", "shuffle", "same"):
            raise ValueError(f"EstimatorConfig.batch_placement must be rotate/shuffle/same, got {self.batch_placement!r}")
        if self.adaptive:
            if not 1 <= self.min_n <= self.max_n:
                raise ValueError(f"EstimatorConfig needs 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")
            if not self.min_n <= self.n <= self.max_n:
                raise ValueError(f"EstimatorConfig.n ({self.n}) must lie in [min_n={self.min_n}, max_n={self.max_n}]")
            if not self.rel_tol > 0:
                raise ValueError(f"EstimatorConfig.rel_tol must be > 0, got {self.rel_tol}")


@dataclass
class PiOldEstimate:
    """π_old for one rollout's response tokens, with its uncertainty."""

    key: str
    logprob_G: np.ndarray
    """log of the estimate (float64): log mean prob ('prob') or mean logprob ('log')."""
    prob_G: np.ndarray
    """The estimate in probability space."""
    replica_var_G: np.ndarray
    """Sample variance (ddof=1) of the R replica probabilities; 0 when R == 1."""
    n: int
    """Replicas averaged (R)."""
    replicas_RG: np.ndarray | None = field(default=None, repr=False)
    """The raw replica logprobs, kept when asked for (diagnostics, variance benchmarks)."""

    @property
    def estimate_var_G(self) -> np.ndarray:
        """Variance of the estimate itself: replica variance / n."""
        return self.replica_var_G / self.n

    def summary(self) -> dict[str, float]:
        """Per-sequence numbers for logs and dashboards."""
        g = len(self.logprob_G)
        rel_se = np.sqrt(self.estimate_var_G) / np.maximum(self.prob_G, 1e-30)
        return {
            "n": float(self.n),
            "tokens": float(g),
            "seq_logprob": float(self.logprob_G.sum()),
            "mean_token_logprob": float(self.logprob_G.mean()) if g else 0.0,
            "max_replica_std": float(np.sqrt(self.replica_var_G.max())) if g else 0.0,
            "max_rel_stderr": float(rel_se.max()) if g else 0.0,
        }


def combine(key: str, replicas_RG: np.ndarray, averaging: Averaging = "prob", keep_replicas: bool = False) -> PiOldEstimate:
    """Average R replica logprob vectors of one sequence into one estimate."""
    lp = np.asarray(replicas_RG, dtype=np.float64)
    if lp.ndim != 2 or lp.shape[0] < 1:
        raise ValueError(f"combine({key!r}): expected replica logprobs [R >= 1, G], found shape {list(lp.shape)}")
    if not np.all(np.isfinite(lp) | (lp == -np.inf)) or np.any(lp > 1e-6):
        raise ValueError(f"combine({key!r}): replica logprobs must be finite or -inf and <= 0, found range "
                         f"[{np.nanmin(lp)}, {np.nanmax(lp)}], nan={bool(np.isnan(lp).any())}")
    r = lp.shape[0]
    p = np.exp(lp)
    var = p.var(axis=0, ddof=1) if r > 1 else np.zeros(lp.shape[1])
    if averaging == "prob":
        mean_p = p.mean(axis=0)
        with np.errstate(divide="ignore"):
            logprob = np.log(mean_p)
    else:
        logprob = lp.mean(axis=0)
        mean_p = np.exp(logprob)
    return PiOldEstimate(key, logprob, mean_p, var, r, lp if keep_replicas else None)


class BatchScorer(Protocol):
    """Anything that scores a batch of rollouts' response tokens (one forward pass, one batch)."""

    def score_batch(self, traces: Sequence[RolloutTrace]) -> list[np.ndarray]:
        """Logprob of each trace's generated tokens [G], in the order given."""
        ...


def placements(num: int, replicas: int, batch_size: int, mode: str, seed: int = 0) -> list[list[list[int]]]:
    """Per replica round, the batches (lists of rollout indices) to score.

    'rotate' shifts the order by a different offset each round, so a rollout's neighbours and its
    slot in the batch change between its replicas; 'shuffle' permutes at random; 'same' repeats.
    """
    rng = np.random.default_rng(seed)
    rounds = []
    for r in range(replicas):
        if mode == "rotate":
            shift = (r * max(1, batch_size // 2 + 1)) % max(num, 1)
            order = np.roll(np.arange(num), -shift)
        elif mode == "shuffle":
            order = rng.permutation(num)
        else:
            order = np.arange(num)
        rounds.append([order[i : i + batch_size].tolist() for i in range(0, num, batch_size)])
    return rounds


def _rel_stderr_max(replicas: list[np.ndarray]) -> float:
    lp = np.stack(replicas)
    p = np.exp(lp.astype(np.float64))
    if len(replicas) < 2 or p.shape[1] == 0:
        return 0.0 if p.shape[1] == 0 else np.inf
    se = p.std(axis=0, ddof=1) / np.sqrt(len(replicas))
    return float((se / np.maximum(p.mean(axis=0), 1e-30)).max())


def estimate(
    traces: Sequence[RolloutTrace],
    scorer: BatchScorer | Callable[[Sequence[RolloutTrace]], list[np.ndarray]],
    config: EstimatorConfig = EstimatorConfig(),
    *,
    batch_size: int = 8,
    keep_replicas: bool = False,
) -> list[PiOldEstimate]:
    """Score every trace n times (or adaptively) and combine; results in the order of `traces`.

    A scorer that returns the wrong number of results or a vector of the wrong length is an
    error naming the rollout, never a silently misaligned estimate.
    """
    score = getattr(scorer, "score_batch", scorer)
    keys = [t.key for t in traces]
    if len(set(keys)) != len(keys):
        raise ValueError(f"estimate: rollout keys must be unique, found duplicates {sorted({k for k in keys if keys.count(k) > 1})[:5]}")
    replicas: list[list[np.ndarray]] = [[] for _ in traces]
    active = list(range(len(traces)))
    target = config.min_n if config.adaptive else config.n
    limit = config.max_n if config.adaptive else config.n
    done_rounds = 0
    while active and done_rounds < limit:
        rounds = placements(len(active), target - done_rounds, batch_size, config.batch_placement, config.seed + done_rounds)
        for batches in rounds:
            for batch in batches:
                idx = [active[i] for i in batch]
                out = score([traces[i] for i in idx])
                if len(out) != len(idx):
                    raise ValueError(f"scorer returned {len(out)} results for a batch of {len(idx)} rollouts")
                for i, lp in zip(idx, out):
                    lp = np.asarray(lp, dtype=np.float64)
                    if lp.shape != (traces[i].num_generated,):
                        raise ValueError(
                            f"scorer result for rollout {traces[i].key!r}: expected [{traces[i].num_generated}] "
                            f"generated-token logprobs, found shape {list(lp.shape)}"
                        )
                    replicas[i].append(lp)
        done_rounds = target
        if not config.adaptive:
            break
        active = [i for i in active if _rel_stderr_max(replicas[i]) > config.rel_tol]
        target = min(limit, done_rounds * 2)  # double the replicas of rollouts that still disagree
    return [combine(t.key, np.stack(reps), config.averaging, keep_replicas) for t, reps in zip(traces, replicas)]
