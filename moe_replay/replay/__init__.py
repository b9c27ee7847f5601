"""Replay semantics, engine-agnostic (pure torch): gate-weight rules, batch route plans,
exactly-once accounting, support-renormalised scoring.

Framework adapters (`moe_replay.integrations.hf`, `.megatron`) plug these into a model's routers.
"""

from .errors import BatchLayoutError, RouteConsumptionError, ScoringInputError, UnsupportedRouterError, WeightsVersionError
from .gates import GATE_RULES, GateSpec, gate_weights, select_experts
from .ledger import RouteLedger, in_backward
from .plan import PlanConfig, RoutePlan, build_plan
from .scoring import SCORING_BACKENDS, SupportCSR, TokenScores, VocabShard, score_logits
from . import scoring_compiled  # noqa: F401,E402 - registers the torch_compiled backend (compiles on first use only)
from .support import score_tokens

__all__ = [
    "GATE_RULES",
    "BatchLayoutError",
    "GateSpec",
    "PlanConfig",
    "RouteConsumptionError",
    "RouteLedger",
    "RoutePlan",
    "SCORING_BACKENDS",
    "ScoringInputError",
    "SupportCSR",
    "VocabShard",
    "WeightsVersionError",
    "TokenScores",
    "UnsupportedRouterError",
    "build_plan",
    "gate_weights",
    "in_backward",
    "score_logits",
    "score_tokens",
    "select_experts",
]
