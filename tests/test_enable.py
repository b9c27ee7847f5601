"""`moe_replay.enable`: one call switches a preset on for a real vLLM engine and an HF trainer."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import moe_replay

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

PROMPTS = ["Q: 3+4=? A:", "Q: 9-2=? A:", "the cat sees a red ball"]


@pytest.fixture(scope="module")
def setup(tiny_model):
    import vllm
    from transformers import AutoModelForCausalLM

    from moe_replay.integrations.vllm import capture_engine_kwargs

    from .conftest import VLLM_TEST_ARGS, shutdown_llm

    model_dir = tiny_model("qwen3_moe")
    llm = vllm.LLM(**capture_engine_kwargs(model=str(model_dir), **{**VLLM_TEST_ARGS, "enable_prefix_caching": False}))
    try:  # the engine is shut down even when the HF model fails to load
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.moe_replay_dir = model_dir  # for tests that build a second scorer on the same checkpoint
        yield llm, model
    finally:
        shutdown_llm(llm)


@pytest.mark.parametrize("preset", ["none", "r3_support", "r3_support_multisample"])
def test_one_training_loop_serves_every_preset(setup, preset):
    from vllm import SamplingParams

    llm, model = setup
    mr = moe_replay.enable(preset, llm=llm, model=model)
    try:
        _, traces = mr.generate(PROMPTS, SamplingParams(n=2, top_p=0.9, max_tokens=6, seed=1), use_tqdm=False)
        assert len(traces) == 6 and all(t.routes_TLK is not None and t.support is not None for t in traces)
        pi_old = mr.pi_old(traces)
        with mr.train_batch(traces, track_flips=True) as batch:
            logits = model(**batch.model_inputs()).logits
            logp_G = batch.logprobs(logits)
            fix = batch.corrections(logp_G.detach())
            loss = -(batch.to_rows(logp_G) * fix.weights_BS).sum() / fix.keep_BS.sum()
            loss.backward()
        model.zero_grad(set_to_none=True)
        gap = float((logp_G.detach().double() - batch.rollout_logprobs).abs().max())
        if preset == "none":
            assert pi_old is None and batch.session is None
            assert gap > 1e-3  # full-vocabulary scores vs the engine's truncated (top-p) distribution
        else:
            assert gap < 1e-4  # fp32 engine: replayed routes + kept support reproduce its logprobs
        if preset == "r3_support_multisample":
            assert pi_old is not None and np.max(np.abs(pi_old - batch.rollout_logprobs.numpy())) < 1e-4
    finally:
        mr.close()


def test_enable_as_a_context_manager_detaches_on_exit(setup):
    from vllm import SamplingParams

    from moe_replay.integrations.vllm import CaptureHookError

    llm, model = setup
    with moe_replay.enable("r3_support", llm=llm, model=model) as mr:
        _, traces = mr.generate(PROMPTS[:1], SamplingParams(n=1, max_tokens=4, seed=0), use_tqdm=False)
        assert len(traces) == 1
        with pytest.raises(CaptureHookError, match="already installed"):  # the engine holds this capture
            moe_replay.enable("r3_support", llm=llm)
    assert mr.capture is None and mr.scorer is None
    moe_replay.enable("r3_support", llm=llm).close()  # detached on exit: a new capture installs


def test_errors_name_what_to_do(setup):
    llm, model = setup
    with pytest.raises(ValueError, match="needs an llm"):
        moe_replay.enable("r3")
    with pytest.raises(ValueError, match=r"unknown preset 'r9'"):
        moe_replay.enable("r9", model=model)
    trainer_only = moe_replay.enable("r3", model=model)
    with pytest.raises(ValueError, match="no llm"):
        trainer_only.generate(["x"])


def test_a_model_without_moe_routers_is_refused_with_the_family():
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"preset 'r3_support' replays routes, but model family 'llama' has no supported MoE router"):
        moe_replay.enable("r3_support", model=dense)


def test_traces_record_sampling_params_and_the_trainer_uses_their_temperature(setup):
    from vllm import SamplingParams

    llm, model = setup
    mr = moe_replay.enable("r3_support", llm=llm, model=model)
    try:
        _, traces = mr.generate(PROMPTS[:2], SamplingParams(n=2, temperature=0.7, top_p=0.9, max_tokens=6, seed=3),
                                use_tqdm=False)
        assert all(t.sampling.temperature == pytest.approx(0.7) and t.sampling.top_p == pytest.approx(0.9) for t in traces)
        assert all(t.sampling.seed == 3 and "sampling" not in t.extra for t in traces)
        with torch.no_grad(), mr.train_batch(traces) as batch:
            logits = model(**batch.model_inputs()).logits
            recorded = batch.logprobs(logits)  # temperature read from the traces
            at_one = batch.logprobs(logits, temperature=1.0)
        assert float((recorded.double() - batch.rollout_logprobs).abs().max()) < 1e-4
        assert float((at_one.double() - batch.rollout_logprobs).abs().max()) > 1e-3
    finally:
        mr.close()


def test_hf_scorer_scores_at_the_traces_temperature(setup):
    """A rollout sampled at 0.7 gets π_old at 0.7 from the HF scorer: equal to the engine's own
    logprobs (fp32), not to the temperature-1 score it gave before schema v2."""
    from vllm import SamplingParams

    from moe_replay.integrations.hf.scorer import HFScorer, HFScorerConfig

    llm, model = setup
    mr = moe_replay.enable("r3_support", llm=llm)
    try:
        _, traces = mr.generate(PROMPTS, SamplingParams(n=2, temperature=0.7, top_p=0.9, max_tokens=6, seed=5), use_tqdm=False)
    finally:
        mr.close()
    scorer = HFScorer(HFScorerConfig(str(model.moe_replay_dir), force_routes=True, use_support=True))
    for t, lp in zip(traces, scorer.score_batch(traces)):
        assert np.abs(lp - t.logprobs_G).max() < 1e-4, t.key
    hot = [dataclasses.replace(t, sampling=dataclasses.replace(t.sampling, temperature=1.0)) for t in traces]
    gap = max(np.abs(lp - t.logprobs_G).max() for t, lp in zip(traces, scorer.score_batch(hot)))
    assert gap > 1e-3  # the temperature matters: scoring these at 1 is wrong


def test_weights_version_is_recorded_by_capture_and_checked_by_the_trainer(setup):
    from vllm import SamplingParams

    from moe_replay.errors import GeometryMismatchError
    from moe_replay.geometry import ModelGeometry
    from moe_replay.replay import WeightsVersionError

    llm, model = setup
    mr = moe_replay.enable("r3_support", llm=llm, model=model)
    try:
        mr.weights_version = "step-3"
        _, traces = mr.generate(PROMPTS[:1], SamplingParams(n=2, top_p=0.9, max_tokens=4, seed=1), use_tqdm=False)
        assert [t.weights_version for t in traces] == ["step-3", "step-3"]
        with torch.no_grad(), mr.train_batch(traces) as batch:
            fix = batch.corrections(batch.logprobs(model(**batch.model_inputs()).logits))
        assert fix.metrics["moe_replay/off_policy_fraction"] == 0.0
        mr.weights_version = "step-4"  # the trainer moved on; these rollouts are one version behind
        with pytest.raises(WeightsVersionError, match=r"expected 'step-4', found 'step-3'.*off_policy=True"):
            with mr.train_batch(traces):
                pass
        with torch.no_grad(), mr.train_batch(traces, off_policy=True) as batch:
            logp_G = batch.logprobs(model(**batch.model_inputs()).logits)
            fix = batch.corrections(logp_G)
        assert fix.metrics["moe_replay/off_policy_fraction"] == 1.0
        other = dataclasses.replace(traces[0], geometry=ModelGeometry(**{**traces[0].geometry.to_dict(), "family": "mixtral"}))
        with pytest.raises(GeometryMismatchError, match=r"geometry.family.*'qwen3_moe'.*'mixtral'"):
            with mr.train_batch([other], off_policy=True):
                pass
    finally:
        mr.close()


def test_pi_old_refuses_what_the_trainer_refuses(setup):
    """Issue 62, items 1 and 2, on the real engine. Traces of another family of the same shape (these
    qwen3_moe traces naming qwen2_moe: every shape equal) were scored by mr.pi_old and the VllmScorer
    without an error while the trainer refused them; now all three refuse with GeometryMismatchError
    naming geometry.family. After mr.weights_version = 2, version-1 traces were scored under the new
    weights with no flag, and the rollout's version-1 logprobs averaged with version-2 re-scorings; now
    pi_old, the scorer and the trainer refuse them (WeightsVersionError), off_policy=True scores them and
    the estimates say under which version, and the rollout's replica never mixes versions."""
    import asyncio
    import json

    from vllm import SamplingParams

    from moe_replay.errors import GeometryMismatchError, WeightsVersionError
    from moe_replay.estimator import EstimatorConfig, ReplicaVersionError, estimate
    from moe_replay.estimator.service import ThreadBackend, estimate_stream
    from moe_replay.geometry import ModelGeometry

    llm, model = setup
    mr = moe_replay.enable("r3_support_multisample", llm=llm, model=model)
    try:
        mr.weights_version = 1
        _, traces = mr.generate(PROMPTS[:2], SamplingParams(n=1, top_p=0.9, max_tokens=5, seed=2), use_tqdm=False)
        assert [t.weights_version for t in traces] == [1, 1] and mr.scorer.weights_version == 1
        own = mr.pi_old(traces)
        other = dataclasses.replace(traces[0], geometry=ModelGeometry(**{**traces[0].geometry.to_dict(), "family": "qwen2_moe"}))
        family = r"field 'geometry.family'.*expected 'qwen3_moe', found 'qwen2_moe'"
        row = {}
        for name, refuse in [("pi_old", lambda: mr.pi_old([other])), ("scorer", lambda: mr.scorer.score_batch([other])),
                             ("trainer", lambda: mr.train_batch([other]).__enter__())]:
            with pytest.raises(GeometryMismatchError, match=family):
                refuse()
            row[f"{name}_refused_other_model"] = True
        mr.weights_version = 2  # weights synced (same values here): the traces are one version behind
        version = r"field 'weights_version': expected 2, found 1.*off_policy=True"
        for name, refuse in [("pi_old", lambda: mr.pi_old(traces)), ("scorer", lambda: mr.scorer.score_batch(traces)),
                             ("trainer", lambda: mr.train_batch(traces).__enter__())]:
            with pytest.raises(WeightsVersionError, match=version):
                refuse()
            row[f"{name}_refused_other_version"] = True
        out = asyncio.run(estimate_stream(traces, ThreadBackend(mr.scorer), EstimatorConfig(n=2)))
        assert all(isinstance(out[t.key], WeightsVersionError) for t in traces)  # the service: one outcome, no scoring
        assert np.abs(mr.pi_old(traces, off_policy=True) - own).max() < 1e-6  # on purpose: scored under version 2
        off = mr.scorer.with_weights(2, off_policy=True)
        assert [(e.weights_version, e.off_policy) for e in estimate(traces, off, EstimatorConfig(n=2))] == [(2, True)] * 2
        with pytest.raises(ReplicaVersionError, match=r"sampled under weights 1 and its replicas are scored under 2"):
            estimate(traces, off, EstimatorConfig(n=2, rollout_replica=True))  # never an average over two policies
        row["pi_old_refused_mixed_versions"] = True
        print("pi_old refusals:", json.dumps(row))
        assert row["pi_old_refused_other_model"] and row["pi_old_refused_other_version"]
    finally:
        mr.close()
