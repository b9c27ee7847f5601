"""π_old on SGLang: re-score rollouts under their recorded routes and kept sets (forced-route scoring).

    # the scoring engine: the force hook in its scheduler (PYTHONPATH=SITE_DIR), no radix cache
    scorer = SglangScorer(engine_or_url)                   # or moe_replay.enable(estimator preset, llm=engine)
    estimates = estimate(traces, scorer, EstimatorConfig(n=4))

Each trace becomes one request: its token ids as the prompt, one new token, `return_logprob` from the
last prompt position with `token_ids_logprob` = the ids of its kept sets, and its routes in
`custom_params` (force.ROUTES_KEY), which the hook in SGLang's scheduler process (force.py) forces at every
MoE layer of that request's rows. SGLang returns, per position, the logprobs (temperature 1, fp32) of the
asked ids; the score of generated token g is x[token] - logsumexp(x[kept]) with x = logprob / temperature
(the log-partition cancels in the renormalisation), what the trainer's replay computes (replay/scoring.py).

Refused by name at attach, before any rollout is scored: an engine whose scheduler does not force (the
hook is not loaded: a probe scores one sequence under two routings and must see them differ), an engine
with the radix cache on (a prefix hit scores on KV computed under free routing), `force_routes=False` or
`use_support=False` (free routing, full-vocabulary scores: not built), families whose SGLang router is not
the torch-native top-k the hook replaces (grouped top-k: glm4_moe, deepseek), multi-span records.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...errors import Where
from ...identity import check_consumer
from ...trace import RolloutTrace
from .capture import transport_for
from .errors import SglangPayloadError, SglangScoringError
from .force import ROUTES_KEY, routes_param
from .served import served_geometry

SITE_DIR = Path(__file__).resolve().parent / "site"
"""Put it on the PYTHONPATH of the scoring engine's processes: its sitecustomize.py loads force.py's hook
in each of them (SGLang spawns its scheduler), before the model is built."""
FORCEABLE = ("qwen2_moe", "qwen3_moe", "mixtral")
"""Families whose SGLang 0.5.23 router is the torch-native top-k (softmax, no groups) the hook replaces."""


@dataclass(frozen=True)
class SglangScorerConfig:
    force_routes: bool = True
    """Force each trace's recorded expert ids (the only mode built)."""
    use_support: bool = True
    """Renormalise over each token's recorded kept set (the only mode built)."""
    weights_version: str | int | None = None
    """The weights the engine holds (None: not tracked); a trace of another version is refused
    (WeightsVersionError) unless `off_policy` (moe_replay/identity.py)."""
    off_policy: bool = False
    """Score traces of other weights versions under these weights on purpose."""


class SglangScorer:
    """One π_old replica per `score_batch` call on an SGLang engine or server (estimator.BatchScorer)."""

    def __init__(self, engine: Any, config: SglangScorerConfig | None = None, *, model: Any = None,
                 timeout_s: float = 600.0, probe: bool = True) -> None:
        self.config = config or SglangScorerConfig()
        if not (self.config.force_routes and self.config.use_support):
            raise SglangScoringError(f"{self.config}: only forced routes over recorded kept sets are built on SGLang")
        self.transport = transport_for(engine, model, timeout_s)
        self.geometry = served_geometry(self.transport.model_config(), self.transport.where)
        if self.geometry.family not in FORCEABLE:
            raise SglangScoringError(
                f"{self.transport.where}: family {self.geometry.family!r}: SGLang routes it by another path than the "
                f"torch-native top-k the force hook replaces (forceable: {list(FORCEABLE)}); refusing to score it freely")
        if not self.transport.radix_cache_disabled():
            raise SglangScoringError(
                f"{self.transport.where} runs with the radix cache on: a cached prefix's KV was computed under whatever "
                "routes its first request took, so a forced score would read free-routed context. Start the scoring "
                "engine with disable_radix_cache=True (--disable-radix-cache)")
        if probe:
            self._probe()

    def _probe(self) -> None:
        """Score one sequence under two routings (experts 0..K-1 everywhere, then K..2K-1): the hook is active
        only if the scores differ."""
        g = self.geometry
        S, P = 6, 3
        tokens = (np.arange(S) + 3) % g.vocab_size
        a_TLK = np.broadcast_to(np.arange(g.top_k), (S - 1, g.num_moe_layers, g.top_k))
        b_TLK = (a_TLK + g.top_k) % g.num_experts
        ids = [int(x) for x in tokens[P:]]
        if self._raw(tokens, P, a_TLK, ids) == self._raw(tokens, P, b_TLK, ids):
            raise SglangScoringError(
                f"{self.transport.where} does not force routes: two routings of one sequence scored the same. Start it "
                f"with the force hook in its processes (PYTHONPATH={SITE_DIR}), before the model is built")

    def _raw(self, tokens_S: np.ndarray, prompt_len: int, routes_TLK: np.ndarray, ids: list[int],
             route_start: int = 0, key: str = "probe") -> list[dict[int, float]]:
        """Per generated position, {id: logprob at temperature 1} of `ids`, under forced `routes_TLK`."""
        g = self.geometry
        fields = {"input_ids": [[int(t) for t in tokens_S]], "return_logprob": True,
                  "logprob_start_len": prompt_len - 1, "token_ids_logprob": [sorted(set(ids))],
                  "sampling_params": [{"max_new_tokens": 1, "temperature": 0.0,
                                       "custom_params": {ROUTES_KEY: routes_param(
                                           routes_TLK.astype(g.route_dtype), route_start, g.moe_layer_ids)}}]}
        out = self.transport.generate(fields)[0]
        rows = (out.get("meta_info") or {}).get("input_token_ids_logprobs")
        G = len(tokens_S) - prompt_len
        if not isinstance(rows, list) or len(rows) != G + 1:
            raise SglangPayloadError(Where(record=key, field="meta_info.input_token_ids_logprobs"),
                                     f"{G + 1} entries (positions {prompt_len - 1}..{len(tokens_S) - 1})",
                                     None if rows is None else f"{len(rows)} entries")
        return [{int(t): float(lp) for lp, t, *_ in row} for row in rows[1:]]

    @property
    def weights_version(self) -> str | int | None:
        """The weights this scorer scores under (config.weights_version; identity.py)."""
        return self.config.weights_version

    @property
    def off_policy(self) -> bool:
        return self.config.off_policy

    def with_weights(self, weights_version: str | int | None, off_policy: bool = False) -> "SglangScorer":
        """This scorer under `weights_version` (the same engine): what `mr.weights_version = v` uses."""
        other = copy.copy(self)
        other.config = dataclasses.replace(self.config, weights_version=weights_version, off_policy=off_policy)
        return other

    def score_batch(self, traces: Sequence[RolloutTrace]) -> list[np.ndarray]:
        """Logprobs [G] of each trace's generated tokens over its kept sets, under its forced routes."""
        out = []
        check_consumer(traces, self, "the scoring engine vs the trace")  # identity.py: geometry, family, weights
        for t in traces:
            t.require_single_span("SGLang forced scoring")
            t.require_all_layers("SGLang forced scoring")
            if t.routes_TLK is None or t.support is None:
                raise SglangScoringError(f"{t.key!r}: forced scoring over kept sets needs the trace's routes and kept "
                                         f"sets (routes: {t.routes_TLK is not None}, kept sets: {t.support is not None})")
            raw = self._raw(t.token_ids_S, t.prompt_len, t.routes_TLK, t.support.ids_N.tolist(), t.route_start, t.key)
            gen = t.token_ids_S[t.prompt_len:]
            temp = t.sampling.temperature
            scores = np.empty(len(gen), dtype=np.float64)
            for g, (row, tok) in enumerate(zip(raw, gen)):
                kept = t.support.row(g)
                if temp == 0:
                    scores[g] = 0.0 if len(kept) == 1 and kept[0] == tok else -math.inf
                    continue
                x = np.array([row[int(i)] for i in kept]) / temp
                m = x.max()
                scores[g] = row[int(tok)] / temp - (m + math.log(np.exp(x - m).sum()))
            out.append(scores)
        return out

    def recorded_logprobs_problem(self, trace: RolloutTrace) -> str | None:
        """Why the trace's recorded logprobs are not one replica of this scorer (EstimatorConfig.rollout_replica):
        SGLang's sampler and its logprob path are different computations (measured within ~1e-5, not bit for bit)."""
        return "SGLang's sampler logprobs and its prompt logprobs come from different kernels (equal within ~1e-5, " \
               "not bit for bit)"

    def uninstall(self) -> None:
        """Nothing to undo on the client (the hook lives in the scoring engine's processes)."""


def scorer_for(engine: Any, estimator: Any) -> SglangScorer:
    """The π_old scorer of a preset's estimator on `engine` (refusals: SglangScorer's)."""
    return SglangScorer(engine, SglangScorerConfig(force_routes=estimator.force_routes, use_support=estimator.use_support))
