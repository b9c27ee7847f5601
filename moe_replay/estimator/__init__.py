"""Multi-sample π_old estimation (engine-agnostic core; engine scorers live in integrations)."""

from .core import BatchScorer, EstimatorConfig, PiOldEstimate, combine, estimate, placements

__all__ = ["BatchScorer", "EstimatorConfig", "PiOldEstimate", "combine", "estimate", "placements"]
