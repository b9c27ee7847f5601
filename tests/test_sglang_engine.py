"""`moe_replay.enable(preset, llm=<sglang.Engine>)` on each family SGLang 0.5.23 serves on this CPU, replayed in HF.

One driver process in the bed's venv (tests/sglang_bed/engine_driver.py) builds an engine per family in turn,
attaches `r3_support` through the `sglang.Engine` binding and writes each family's traces to a DirectoryStore;
here (the project's venv) HF fp32 replays them: 0 flips, logprobs over the kept sets at the fp32 floor, kept
sets equal to SGLang's rule over HF's logits. qwen3_moe is covered by the server (test_sglang_capture.py).
The families SGLang 0.5.23 does not serve here, and why, are in SGLANG_CPU (docs/sglang.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_replay.integrations.sglang import SglangServedError
from moe_replay.store import DirectoryStore

from .sglang_bed import bed
from .sglang_bed.compare import compare_hf

SERVED = ("qwen2_moe", "mixtral", "glm4_moe")
"""Families of build_tiny_model SGLang 0.5.23 serves on this CPU (qwen3_moe: the server's tests)."""
SGLANG_CPU = {
    "olmoe": "engine_fails: SGLang's OLMoE sizes q_norm / k_norm by hidden_size, the checkpoint by heads x head_dim "
             "(load: 'Attempted to load weight (torch.Size([64])) into parameter (torch.Size([128]))')",
    "deepseek_v3": "engine_fails: SGLang's CPU rotary embedding for MLA takes YaRN rope_scaling only "
                   "(get_rope_cpu: assert rope_scaling is not None)",
    "gpt_oss": "engine_fails: SGLang's GptOss takes a triton / trtllm_mha / fa3 / fa4 / intel_amx / ... attention backend "
               "(its sinks), not torch_native",
    "qwen3_moe_sparse": "refused: SGLang's qwen3_moe ignores mlp_only_layers (SglangServedError, before any rollout)",
}
"""Families of build_tiny_model SGLang 0.5.23 does not serve as HF computes them here, with the reason."""


@pytest.fixture(scope="module")
def engine_runs(tiny_model, tmp_path_factory):
    if not bed.available():
        pytest.skip(f"the SGLang test bed is not built ({bed.PYTHON}): python3 scripts/sglang_bed.py")
    out = tmp_path_factory.mktemp("sglang_engine")
    models = {f: tiny_model(f) for f in SERVED}
    proc = bed.run_driver(bed.BED / "engine_driver.py", out, *models.values())
    runs = {}
    for family, model in models.items():
        summary_path = out / Path(model).name / "summary.json"
        assert summary_path.exists(), f"{family}: the driver died ({proc.returncode}):\n{proc.stderr[-3000:]}"
        runs[family] = (model, out / Path(model).name, json.loads(summary_path.read_text()))
    return runs


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.parametrize("family", SERVED)
def test_enable_on_sglang_engine_is_exact_in_hf(engine_runs, family):
    model, out, summary = engine_runs[family]
    assert "error" not in summary, summary["error"]
    assert summary["engine_kind"] == "sglang.Engine" and summary["geometry"]["family"] == family
    why = "forceable" if family == "glm4_moe" else "radix cache"  # grouped top-k; the bed's engines keep the cache on
    assert summary["refusals"]["estimator"].startswith("SglangScoringError") and why in summary["refusals"]["estimator"]
    with DirectoryStore(out / "store", readonly=True) as store:
        traces = store.get_many(summary["keys"])
    assert [t.sampling.greedy for t in traces] == [False, False, False, True]
    assert all(t.engine.name == "sglang" and t.engine.dtype == "float32" for t in traces)
    got = compare_hf(model, traces)
    print(f"sglang engine vs hf [{family}]:", got, "engine start", summary["engine_start_s"], "s")
    assert got["flips"] == 0 and got["max_abs_dlogprob"] <= 2e-5 and got["kept_sets_equal_hf"]


class Engine:
    """What the binding and capture read of an sglang.Engine, on a checkpoint's config: no engine starts."""

    __module__ = "sglang.srt.entrypoints.engine"

    def __init__(self, model_dir):
        from transformers import AutoConfig

        self.server_args = type("ServerArgs", (), {"model_path": str(model_dir)})()
        model_config = type("ModelConfig", (), {"hf_config": AutoConfig.from_pretrained(str(model_dir))})()
        self.tokenizer_manager = type("TokenizerManager", (), {"model_config": model_config})()

    def __getattr__(self, name):
        raise AssertionError(f"capture reached the engine ({name}) for a checkpoint it must refuse first")


def test_misserved_checkpoint_refused_by_enable_before_any_rollout(tiny_model):
    """qwen3_moe with dense layers (mlp_only_layers): SGLang 0.5.23 would serve every layer sparse (NaN samples);
    enable() refuses it by name through the sglang.Engine binding, reading only the config."""
    import moe_replay

    with pytest.raises(SglangServedError, match=r"mlp_only_layers=\[0, 2\]"):
        moe_replay.enable("r3_support", llm=Engine(tiny_model("qwen3_moe_sparse")))
