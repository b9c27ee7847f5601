"""Which traces a consumer may take: the one check of model identity and weights version.

Every consumer of a trace runs it before it forwards a token: the trainer's replay plan
(replay/plan.py `build_plan`), the π_old scorers (vLLM's, on either model runner; SGLang's; the HF
scorer), the estimator over any of them (`estimate`, `EstimatorService`, the Ray pool's actors and
the pool itself) and the rollout's own replica (`EstimatorConfig.rollout_replica`). So π_old refuses
exactly what the trainer refuses:

  * the geometry, field by field, `family` included (`ModelGeometry.check_matches`): a trace of
    another family of the same shape (qwen2_moe traces on a qwen3_moe or glm4_moe engine: 16
    experts, top-4 each) names other experts for most tokens and is refused with
    GeometryMismatchError naming `geometry.family`, the identity the HF trainer compares (the
    model's `config.model_type`, which vLLM's and SGLang's served geometries name too);
  * the weights version: a consumer that says which weights it holds (`weights_version`, None = not
    tracked) refuses a trace sampled under another version, or under none recorded, with
    WeightsVersionError unless `off_policy` says so on purpose; the consumer then reports which of
    its traces were off-policy and under which version it scored them (`PiOldEstimate`);
  * π_old never averages two policies: the rollout's recorded logprobs count as a replica only when
    they were sampled under the version the replicas are scored under (`replica_version_problem`),
    `off_policy` or not.

A consumer object (a scorer, a scoring backend) states its side as attributes: `geometry`
(ModelGeometry, or None where it cannot say), `weights_version` and `off_policy`
(`consumer_identity`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .errors import WeightsVersionError, Where
from .geometry import ModelGeometry
from .trace import RolloutTrace

Version = str | int | None


def check_traces(traces: Sequence[RolloutTrace], geometry: ModelGeometry | None, *, weights_version: Version = None,
                 off_policy: bool = False, what: str = "model vs trace", what_later: str | None = None,
                 opt_in: str = "pass off_policy=True to use them on purpose") -> tuple[ModelGeometry | None, np.ndarray]:
    """Check that a consumer of `geometry` holding `weights_version` may take every trace; return
    (the geometry, naming the family the traces name where it names none; off_policy_B: bool per
    trace, sampled under another version and taken because `off_policy`).

    Geometry: `geometry.check_matches` per trace, in order, the family taken from the first trace that
    names one where `geometry` names none, so one batch cannot mix families (None: not checked, a
    consumer that cannot say). Version: `check_versions`. `what` names the two sides (`what_later`, once
    the family is the earlier traces'), `opt_in` how to accept other versions on purpose (both in the errors).
    """
    given = geometry
    if geometry is not None:
        for t in traces:
            side = what if geometry is given else what_later or f"{what} (family named by the batch's earlier traces)"
            geometry.check_matches(t.geometry, Where(record=t.key), side)
            geometry = geometry.with_family_of(t.geometry)
    return geometry, check_versions(traces, weights_version, off_policy, opt_in)


def is_stale(trace: RolloutTrace, weights_version: Version) -> bool:
    """Whether `trace` was sampled under other weights than `weights_version` (None: not tracked, never
    stale); a trace with no version recorded is stale against any tracked one. Versions compare as
    given: 1 and "1" differ."""
    return weights_version is not None and trace.weights_version != weights_version


def check_versions(traces: Sequence[RolloutTrace], weights_version: Version, off_policy: bool = False,
                   opt_in: str = "pass off_policy=True to use them on purpose") -> np.ndarray:
    """off_policy_B: bool per trace sampled under another version than `weights_version`; without
    `off_policy` the first such trace is refused (WeightsVersionError naming it, and how many)."""
    stale = np.array([is_stale(t, weights_version) for t in traces], dtype=bool)
    if stale.any() and not off_policy:
        t = traces[int(np.flatnonzero(stale)[0])]
        raise WeightsVersionError(
            Where(record=t.key, field="weights_version"), repr(weights_version), repr(t.weights_version),
            f"{int(stale.sum())} of {len(traces)} traces were sampled with other weights than the ones this consumer "
            f"holds; sync the engine's weights (and its weights_version), or {opt_in}",
        )
    return stale


def replica_version_problem(trace: RolloutTrace, weights_version: Version) -> str | None:
    """None when the rollout's recorded logprobs were sampled under `weights_version` (or it is not
    tracked), else why they cannot be averaged with replicas scored under it: π_old never mixes
    weights versions, whether or not the replicas score the trace off-policy."""
    if not is_stale(trace, weights_version):
        return None
    return (f"the rollout was sampled under weights {trace.weights_version!r} and its replicas are scored under "
            f"{weights_version!r}: averaging them would mix two policies (off_policy lets replicas score other "
            "weights; the rollout's own logprobs never count as one of them)")


def consumer_identity(consumer: Any) -> tuple[ModelGeometry | None, Version, bool]:
    """(geometry, weights_version, off_policy) a consumer object states (absent: None, None, False)."""
    return (getattr(consumer, "geometry", None), getattr(consumer, "weights_version", None),
            bool(getattr(consumer, "off_policy", False)))


def check_consumer(traces: Sequence[RolloutTrace], consumer: Any, what: str = "the scorer vs the trace") -> np.ndarray:
    """`check_traces` against what `consumer` states (consumer_identity); off_policy_B."""
    geometry, version, off_policy = consumer_identity(consumer)
    return check_traces(traces, geometry, weights_version=version, off_policy=off_policy, what=what,
                        opt_in=f"give {type(consumer).__name__} off_policy=True (mr.pi_old(..., off_policy=True)) to "
                               "score them under these weights on purpose")[1]
