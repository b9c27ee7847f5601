"""Entry points that meet a model and traces check the whole geometry, family included, before any
forward; and traces whose sampler's logits were shifted are refused unless the caller opts in.

Family: a trace of another family with every shape equal (here a deepseek_v3 model's own routes,
relabelled glm4_moe) is refused by name, however the plan was built: against the model's geometry
(build_plan), against the trace's own geometry (the replay entry), or against a hand-built geometry
that names no family (the plan takes its traces' family).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from moe_replay.errors import GeometryMismatchError
from moe_replay.integrations.hf import model_geometry, replay, self_routed_trace
from moe_replay.replay import PlanConfig, ScoringInputError, build_plan, score_tokens
from moe_replay.trace import Sampling


@pytest.fixture(scope="module")
def deepseek(tiny_model):
    from transformers import AutoModelForCausalLM

    path = tiny_model("deepseek_v3")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model


def _traces(model, n=2, seed=0):
    rng = np.random.default_rng(seed)
    vocab = model_geometry(model).vocab_size
    return [self_routed_trace(model, rng.integers(3, vocab, 7 + i), 3, f"req-{i}") for i in range(n)]


def _relabel(trace, family):
    return dataclasses.replace(trace, geometry=dataclasses.replace(trace.geometry, family=family))


class _Forwards:
    """Counts the model's forwards (none may run before a refusal)."""

    def __init__(self, model):
        self.n, self._h = 0, model.register_forward_pre_hook(lambda *a: self._count())

    def _count(self):
        self.n += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._h.remove()


def test_another_family_of_equal_geometry_is_refused_at_every_hf_entry(deepseek):
    _, model = deepseek
    geom = model_geometry(model)
    assert geom.family == "deepseek_v3"
    own = _traces(model)
    glm = [_relabel(t, "glm4_moe") for t in own]
    assert dataclasses.replace(glm[0].geometry, family="deepseek_v3") == geom  # every shape equal
    with _Forwards(model) as fwd:
        # build_plan against the model's geometry
        with pytest.raises(GeometryMismatchError, match=r"record 'req-0', field 'geometry.family': expected 'deepseek_v3', "
                                                        r"found 'glm4_moe' \(model vs trace: .*another model family"):
            build_plan(glm, geom)
        # a plan built from the traces' own geometry: the replay entry compares it with the model's
        plan = build_plan(glm, glm[0].geometry)
        with pytest.raises(GeometryMismatchError, match=r"field 'geometry.family': expected 'deepseek_v3', "
                                                        r"found 'glm4_moe' \(model vs plan"):
            replay(model, plan)
        # a hand-built geometry naming no family: the plan names its traces' family, replay refuses it
        unnamed = dataclasses.replace(geom, family="")
        plan = build_plan(glm, unnamed)
        assert plan.geometry.family == "glm4_moe"
        with pytest.raises(GeometryMismatchError, match="found 'glm4_moe'"):
            replay(model, plan)
        # ... and one batch cannot mix families through it
        with pytest.raises(GeometryMismatchError, match=r"record 'req-1'.*expected 'deepseek_v3', found 'glm4_moe' "
                                                        r"\(model \(family named by the batch's earlier traces\) vs trace"):
            build_plan([own[0], glm[1]], unnamed)
        assert fwd.n == 0
        # the same family passes, and replaying the model's own routes reproduces its logits
        for g in (geom, own[0].geometry, unnamed):
            plan = build_plan(own, g)
            assert plan.geometry == geom
            with torch.no_grad():
                free = model(**plan.model_inputs()).logits
                with replay(model, plan):
                    forced = model(**plan.model_inputs()).logits
            assert torch.equal(free, forced)
        # traces naming no family (unknown) are accepted when every other field is equal
        plan = build_plan([_relabel(t, "") for t in own], geom)
        with torch.no_grad(), replay(model, plan):
            model(**plan.model_inputs())


def test_hf_scorer_refuses_another_family_and_adjusted_sampling(deepseek):
    from moe_replay.integrations.hf.scorer import HFScorer, HFScorerConfig

    path, model = deepseek
    own = _traces(model)
    scorer = HFScorer(HFScorerConfig(str(path), force_routes=True, use_support=False))
    with _Forwards(scorer.model) as fwd:
        with pytest.raises(GeometryMismatchError, match="expected 'deepseek_v3', found 'glm4_moe'"):
            scorer.score_batch([_relabel(t, "glm4_moe") for t in own])
        penalised = [dataclasses.replace(t, sampling=Sampling(adjusted=("repetition_penalty",))) for t in own]
        with pytest.raises(ScoringInputError, match=r"record 'req-0', field 'sampling.adjusted'.*allow_adjusted_sampling=True"):
            scorer.score_batch(penalised)
        assert fwd.n == 0
    ref = scorer.score_batch(own)
    opted = HFScorer(HFScorerConfig(str(path), force_routes=True, allow_adjusted_sampling=True)).score_batch(penalised)
    for a, b in zip(ref, opted):  # the model's own logits: what the option documents
        np.testing.assert_array_equal(a, b)


def test_adjusted_sampling_refused_through_plan_and_score_tokens(deepseek):
    _, model = deepseek
    geom = model_geometry(model)
    own = _traces(model)
    shifted = dataclasses.replace(own[1], sampling=Sampling(adjusted=("logit_bias", "min_tokens")))
    with pytest.raises(ScoringInputError, match=r"record 'req-1'.*found \['logit_bias', 'min_tokens'\].*shifted by logit_bias:"):
        build_plan([own[0], shifted], geom)
    plan = build_plan([own[0], shifted], geom, config=PlanConfig(allow_adjusted_sampling=True))
    with torch.no_grad(), replay(model, plan):
        logits = model(**plan.model_inputs()).logits
    assert torch.isfinite(score_tokens(logits, plan).logprobs_G).all()


@pytest.fixture(scope="module")
def jetmoe(tmp_path_factory):
    """The tiny JetMoE (two routers per decoder layer: 2L route layers), saved as a checkpoint for the scorer."""
    from moe_replay.integrations.hf import coverage

    model = coverage.build_tiny("jetmoe")
    path = tmp_path_factory.mktemp("jetmoe")
    model.save_pretrained(path)
    return path, model


def test_a_trace_of_decoder_layers_not_route_layers_is_refused_at_every_hf_entry(jetmoe):
    """JetMoE's traces hold 2L route layers (each decoder layer routes twice); a trace of L layers (one router per
    decoder layer, as an engine capturing one would record) is refused by name at build_plan, at the replay entry and
    by the HF scorer, naming expected and found, before any forward; its own 2L-layer traces pass everywhere."""
    from moe_replay.integrations.hf.scorer import HFScorer, HFScorerConfig

    path, model = jetmoe
    geom = model_geometry(model)
    n = model.config.num_hidden_layers
    assert (geom.num_layers, geom.moe_layer_ids) == (2 * n, tuple(range(2 * n)))
    own = _traces(model)
    one_per_layer = [dataclasses.replace(t, geometry=dataclasses.replace(geom, num_layers=n, moe_layer_ids=tuple(range(n))),
                                         routes_TLK=t.routes_TLK[:, 0::2]) for t in own]
    want = rf"field 'geometry.num_layers': expected {2 * n}, found {n} \(model vs %s: num_layers counts route layers"
    scorer = HFScorer(HFScorerConfig(str(path), force_routes=True))
    assert scorer.geometry == geom
    with _Forwards(model) as fwd, _Forwards(scorer.model) as scored:
        with pytest.raises(GeometryMismatchError, match=r"record 'req-0', " + want % "trace"):
            build_plan(one_per_layer, geom)
        with pytest.raises(GeometryMismatchError, match=want % "plan"):
            replay(model, build_plan(one_per_layer, one_per_layer[0].geometry))
        with pytest.raises(GeometryMismatchError, match=want % "trace"):
            scorer.score_batch(one_per_layer)
        assert fwd.n == scored.n == 0
    plan = build_plan(own, geom)
    with torch.no_grad():
        free = model(**plan.model_inputs()).logits
        with replay(model, plan):
            forced = model(**plan.model_inputs()).logits
    assert torch.equal(free, forced)
    assert all(np.isfinite(lp).all() for lp in scorer.score_batch(own))
