"""Multi-sample π_old estimation (engine-agnostic core; engine scorers live in integrations)."""

from .core import (BatchScorer, EstimatorConfig, PiOldEstimate, ReplicaVersionError, RolloutReplicaError, combine, estimate,
                   placements, rollout_replica_G)

__all__ = ["BatchScorer", "EstimatorConfig", "PiOldEstimate", "ReplicaVersionError", "RolloutReplicaError", "combine",
           "estimate", "placements", "rollout_replica_G"]
