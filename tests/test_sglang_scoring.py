"""π_old on SGLang: forced-route scoring through the hook at its top-k selection (integrations/sglang/force.py,
loaded in the scheduler process the way the test bed loads its fixes), exact against the trainer's replay.

One driver in the bed's venv (tests/sglang_bed/score_driver.py): an engine with the radix cache off and the hook
in its processes captures rollouts through `enable("r3_support_multisample", llm=engine)`, scores them under their
own routes and under shifted ones (experts neither engine would choose), and runs the preset's π_old; an engine
without the hook is refused by name. Here HF fp32 replays the same routes over the same kept sets.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_replay.store import DirectoryStore

from .sglang_bed import bed
from .sglang_bed.compare import compare_scores

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


@pytest.fixture(scope="module")
def scored(tiny_model, tmp_path_factory):
    if not bed.available():
        pytest.skip(f"the SGLang test bed is not built ({bed.PYTHON}): python3 scripts/sglang_bed.py")
    out, model = tmp_path_factory.mktemp("sglang_scoring"), tiny_model("qwen3_moe")
    proc = bed.run_driver(bed.BED / "score_driver.py", out, model)
    assert (out / "summary.json").exists(), f"the driver died ({proc.returncode}):\n{proc.stderr[-3000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert "error" not in summary, summary["error"]
    with DirectoryStore(out / "store", readonly=True) as store:
        traces = store.get_many(summary["keys"])
    return model, traces, dict(np.load(out / "scores.npz")), summary


def test_forced_scores_equal_the_trainers_replay(scored):
    """Under the trace's own routes and under shifted routes, SGLang's forced scores over the kept sets equal HF's
    replay of the same routes to the fp32 floor; shifting the experts moves the scores by nats, so forcing is real."""
    model, traces, scores, summary = scored
    got = compare_scores(model, traces, scores)
    print("sglang forced scoring vs hf replay:", got, summary)
    assert got["own_max_abs_vs_hf"] <= 2e-5 and got["shifted_max_abs_vs_hf"] <= 2e-5
    assert got["shift_moves_scores_by"] > 1.0
    rollout_G = np.concatenate([t.logprobs_G for t in traces])
    assert np.abs(scores["own"] - rollout_G).max() <= 2e-5  # the rollout's own logprobs, rescored


def test_pi_old_on_sglang_through_enable(scored):
    """The preset's estimator (n = 4) on the engine: a deterministic CPU engine gives n equal replicas."""
    _, traces, scores, summary = scored
    assert summary["n"] == 4 and len(scores["pi_old"]) == sum(t.num_generated for t in traces)
    assert np.abs(scores["pi_old"] - scores["own"]).max() <= 1e-9


class Replies:
    """capture.Transport answering every scoring request with the same logprobs: a scheduler without the hook."""

    where = "canned"

    def __init__(self, radix_off: bool = True):
        self.radix_off, self.sent = radix_off, []

    def model_config(self):
        return {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2,
                "vocab_size": 64}

    def engine_info(self):
        from moe_replay.geometry import EngineInfo

        return EngineInfo(name="sglang")

    def radix_cache_disabled(self):
        return self.radix_off

    def generate(self, fields):
        self.sent.append(fields)
        rows = [None] + [[(-1.0, t, None) for t in fields["token_ids_logprob"][0]]] * (len(fields["input_ids"][0]) - 3)
        return [{"meta_info": {"input_token_ids_logprobs": rows}}]


def test_an_engine_that_does_not_force_is_refused_by_name(monkeypatch):
    """At attach a probe scores one sequence under two routings; equal scores mean no hook: refused, naming the
    PYTHONPATH that loads it (benchmarks/sglang.py runs the same on a real engine without the hook). The radix cache
    on is refused before that."""
    from moe_replay.integrations.sglang import SglangScoringError, scoring
    from moe_replay.integrations.sglang.force import ROUTES_KEY

    replies = Replies()
    monkeypatch.setattr(scoring, "transport_for", lambda engine, model, timeout_s: replies)
    with pytest.raises(SglangScoringError, match=r"does not force routes.*PYTHONPATH=.*integrations/sglang/site"):
        scoring.SglangScorer("canned")
    a, b = (f["sampling_params"][0]["custom_params"][ROUTES_KEY]["ids"] for f in replies.sent)
    assert a != b  # the two probe requests carried different routes
    monkeypatch.setattr(scoring, "transport_for", lambda engine, model, timeout_s: Replies(radix_off=False))
    with pytest.raises(SglangScoringError, match="radix cache on"):
        scoring.SglangScorer("canned")
