"""π_old on SGLang: refused by name, with the reason (moe_replay.enable with an estimator preset).

The estimator re-scores each rollout n times under its recorded routes and kept sets. SGLang 0.5.23 has
no input that forces experts, so forcing means a hook at its top-k selection (`select_experts`) in the
scheduler process. What that hook would need and SGLang does not give it, each of which would make a
forced score silently free:
  * which request each row of the batch is: `select_experts(hidden_states, router_logits, topk_config)`
    sees the flat token rows of a batch that mixes requests, chunked prefills and decodes; the map from
    rows to (request, position) lives in the scheduler's ScheduleBatch, two calls up, on another path
    per attention backend;
  * KV computed under the forced routes: the radix cache serves a prompt's prefix from whatever request
    computed it first (a rollout routed freely), so a cache hit scores the completion on free-routed
    context;
  * the recorded routes in the scheduler: nothing in a generate request carries [T, L, K] ids to it
    except `custom_params`, which the sampler reads after the forward, not the MoE layers during it.
Until a hook closes all three (and is proven exact against the trainer's replay), π_old on SGLang is
refused here, before capture attaches: re-score on vLLM (VllmScorer) or the trainer (recompute).
"""

from __future__ import annotations

from typing import Any

from .errors import SglangScoringError

REASON = ("SGLang 0.5.23 cannot force experts: a hook at select_experts sees no request or position per row, the radix "
          "cache serves prefixes whose KV was computed under free routing, and no request field reaches the MoE layers; "
          "a forced score would silently be a free one (integrations/sglang/scoring.py)")


def scorer_for(engine: Any, estimator: Any) -> Any:
    """The π_old scorer of a preset's estimator on `engine`: refused (SglangScoringError) with REASON."""
    raise SglangScoringError(
        f"the preset's estimator (force_routes={estimator.force_routes}) on SGLang: refused: {REASON}. Use a preset "
        "without the estimator "
        "on SGLang, and estimate π_old on vLLM (VllmScorer) or by the trainer's recompute")
