"""Multi-sample π_old: average n re-scorings of each rollout in probability space.

Why probability space: π_old enters the loss as a ratio π_θ / π_old of probabilities, and the
engine's run-to-run noise is noise on probabilities; the arithmetic mean of n probability samples
is unbiased for their expectation with variance σ²/n, whereas averaging logprobs (the geometric
mean) is biased low by Jensen's gap. Both rules are offered so the difference can be measured.

The rollout as a replica: the rollout engine already scored every generated token once, under
the routes and kept set the trace recorded (`trace.logprobs_G`: log softmax(logits / T) over the
kept set, as the sampler drew it). Where that is exactly the quantity a replica scores (the scorer
says so per trace: `recorded_logprobs_problem`), `EstimatorConfig(rollout_replica=True)` counts it
as replica 0, so n replicas cost n - 1 re-scorings. A trace whose logprobs are absent, malformed
or mean something else is refused by name (RolloutReplicaError), never mixed in.

Which traces a scorer may score is the one check every consumer runs (moe_replay/identity.py):
`estimate` runs it on what the scorer states (`geometry`, `weights_version`, `off_policy`) before
any scoring, so a trace of another model (family included) is a GeometryMismatchError and one of
other weights a WeightsVersionError unless the scorer was given `off_policy`; each estimate says the
version it was scored under and whether the rollout was off-policy. The rollout's own replica is
never of other weights than the re-scorings (ReplicaVersionError): π_old never mixes two policies.

Legend: R replicas (scorings) of one sequence, G generated (response) tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol, Sequence

import numpy as np

from ..errors import TraceError, WeightsVersionError, Where
from ..identity import check_consumer, consumer_identity, replica_version_problem
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
    rollout_replica: bool = False
    """Count the rollout's own recorded logprobs as replica 0 (n replicas = the rollout + n - 1
    re-scorings; in adaptive mode min_n and max_n count it too). Saves 1 of n scorings (25% at
    n = 4); on a GPU the rollout's decode kernels are one more placement of the engine's noise.
    Off by default because only a scorer that can vouch for the meaning of the recorded values
    (vLLM's, with use_support) may use it; any other scorer or trace is refused by name."""

    def __post_init__(self) -> None:
        if not isinstance(self.rollout_replica, bool):
            raise ValueError(f"EstimatorConfig.rollout_replica must be True or False, got {self.rollout_replica!r}")
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
    from_rollout: bool = False
    """Replica 0 is the rollout's recorded logprobs (EstimatorConfig.rollout_replica)."""
    weights_version: str | int | None = None
    """The weights version the replicas were scored under (the scorer's; None: not tracked)."""
    off_policy: bool = False
    """The rollout was sampled under another weights version than `weights_version` and scored under
    it on purpose (the scorer's off_policy opt-in): π_old of those weights, not of the sampling policy."""

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
            "engine_replicas": float(self.n - int(self.from_rollout)),
        }


def combine(key: str, replicas_RG: np.ndarray, averaging: Averaging = "prob", keep_replicas: bool = False,
            from_rollout: bool = False, *, weights_version: str | int | None = None,
            off_policy: bool = False) -> PiOldEstimate:
    """Average R replica logprob vectors of one sequence into one estimate (`from_rollout`: row 0 is
    the rollout's recorded logprobs; `weights_version`, `off_policy`: what the replicas were scored
    under, PiOldEstimate's fields)."""
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
    return PiOldEstimate(key, logprob, mean_p, var, r, lp if keep_replicas else None, from_rollout, weights_version,
                         off_policy)


class RolloutReplicaError(TraceError, ValueError):
    """A rollout's recorded logprobs cannot count as one of its replicas: absent, malformed, or not
    the quantity the scorer scores (another normaliser, precision, weights or a scorer that cannot say)."""


class ReplicaVersionError(RolloutReplicaError, WeightsVersionError):
    """The rollout's recorded logprobs were sampled under other weights than its replicas are scored
    under: never averaged with them (π_old never mixes weights versions, off_policy or not)."""


def rollout_replica_G(trace: RolloutTrace, scorer: object) -> np.ndarray:
    """The rollout's recorded logprobs [G] as replica 0 (float64), after checking they are exactly
    what one replica of `scorer` returns; RolloutReplicaError naming the rollout otherwise.

    The scorer vouches per trace through `recorded_logprobs_problem(trace) -> str | None` (None:
    same quantity; else why not). A scorer without it cannot vouch and is refused: the core
    cannot know what a scorer's numbers mean.
    """
    w = Where(record=trace.key, field="logprobs_G")
    lp = trace.logprobs_G
    if lp is None:
        raise RolloutReplicaError(w, "the rollout's recorded logprobs (EstimatorConfig.rollout_replica=True)",
                                  "none (captured with CaptureConfig(logprobs=False)?)")
    lp = np.asarray(lp, dtype=np.float64)
    if lp.shape != (trace.num_generated,):
        raise RolloutReplicaError(w, f"shape [{trace.num_generated}]", list(lp.shape))
    bad = np.flatnonzero(~np.isfinite(lp) | (lp > 1e-6))
    if len(bad):
        raise RolloutReplicaError(w, "finite logprobs <= 0 (the sampled token lies in its kept set)",
                                  f"{lp[bad[0]]} at generated token {int(bad[0])}")
    check = getattr(scorer, "recorded_logprobs_problem", None)
    if check is None:
        raise RolloutReplicaError(w, "a scorer that says whether recorded logprobs are what it scores "
                                     "(recorded_logprobs_problem)", f"{type(scorer).__name__}, which cannot")
    version = consumer_identity(scorer)[1]
    mixed = replica_version_problem(trace, version)
    if mixed is not None:
        raise ReplicaVersionError(w.with_(field="weights_version"), f"the replicas' weights version {version!r}",
                                  repr(trace.weights_version), mixed)
    why = check(trace)
    if why is not None:
        raise RolloutReplicaError(w, "logprobs of the quantity one replica of the scorer returns", why)
    return lp


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

    A scorer that also has `score_batches(batches) -> results per batch` gets every round's
    batches in one call, so an engine can run all replicas at once (VllmScorer: 3.7x faster than
    batch by batch at n = 4 on an H200); otherwise batches are scored one after another.
    A scorer that returns the wrong number of results or a vector of the wrong length is an
    error naming the rollout, never a silently misaligned estimate. With `config.rollout_replica`
    every trace's recorded logprobs are checked before any scoring runs and count as replica 0.

    Before any scoring, every trace is checked against what the scorer states (identity.check_consumer:
    geometry with family, weights version; GeometryMismatchError, WeightsVersionError unless the scorer
    has off_policy); the estimates carry the scorer's weights_version and which rollouts were off-policy.
    """
    off_policy_B = check_consumer(traces, scorer)
    version = consumer_identity(scorer)[1]
    score = getattr(scorer, "score_batch", scorer)
    many = getattr(scorer, "score_batches", None)
    keys = [t.key for t in traces]
    if len(set(keys)) != len(keys):
        raise ValueError(f"estimate: rollout keys must be unique, found duplicates {sorted({k for k in keys if keys.count(k) > 1})[:5]}")
    if config.rollout_replica:
        replicas: list[list[np.ndarray]] = [[rollout_replica_G(t, scorer)] for t in traces]
    else:
        replicas = [[] for _ in traces]
    active = list(range(len(traces)))
    target = config.min_n if config.adaptive else config.n
    limit = config.max_n if config.adaptive else config.n
    done_rounds = int(config.rollout_replica)
    while active and done_rounds < limit:
        rounds = placements(len(active), target - done_rounds, batch_size, config.batch_placement, config.seed + done_rounds)
        batches_idx = [[active[i] for i in batch] for batches in rounds for batch in batches]
        if many is not None:  # every round's batches in flight together
            outs = many([[traces[i] for i in idx] for idx in batches_idx])
            if len(outs) != len(batches_idx):
                raise ValueError(f"scorer returned {len(outs)} batch results for {len(batches_idx)} batches")
        else:
            outs = (score([traces[i] for i in idx]) for idx in batches_idx)
        for idx, out in zip(batches_idx, outs):
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
    return [combine(t.key, np.stack(reps), config.averaging, keep_replicas, config.rollout_replica,
                    weights_version=version, off_policy=bool(stale))
            for t, reps, stale in zip(traces, replicas, off_policy_B)]
