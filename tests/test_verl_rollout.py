"""Capture inside verl's own vLLM rollout, on CPU, into the FSDP actor step.

verl 0.9.1's rollout server class (`vLLMHttpServer`, as moe_replay's subclass `MoeReplayHttpServer`
that registry.install() puts under verl's "vllm" replica) is launched in this process with its own
`launch_server` (verl's CLI args -> AsyncLLM with its engine core in a child process -> uvicorn):
each `generate` returns verl's TokenOutput carrying the sample's moe_replay trace. The outputs go
through verl's agent-loop classes (`AgentLoopOutput`, `AgentLoopWorker._agent_loop_postprocess`
and `_postprocess`, which turn extra fields into `non_tensor_batch` columns), and the DataProto
into verl's FSDP engine (compute_log_prob, update_actor). The multi-turn sample runs the turn
hooks the registry wraps around verl's `LLMServerClient.generate` / `_run_agent_loop`.
verl's fully-async rollouter's client (`FullyAsyncLLMServerClient`, its resume-on-abort `generate`
over the base `generate`) runs against the same server through verl's own load balancer class
(`GlobalRequestLoadBalancer`), with Ray's actor calls made in-process (`_InProcess`), and an abort
mid-request (vLLM's `AsyncLLM.abort`: verl 0.9.1's own aborts fail on vLLM 0.32, docs/verl.md).
verl's `AgentLoopWorker._run_agent_loop` (as the registry wraps it) then runs its single-turn agent
loop over that client, and its padded outputs go through `_postprocess` into the actor.
Where CPU stops (not run here): the server as a Ray actor placed by `vLLMReplica` on GPU
resources, Ray actors for the load balancer and the agent-loop workers, and
`FullyAsyncRollouter` itself (docs/verl.md).
"""

from __future__ import annotations

import asyncio
import copy
import os

import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("verl")
pytest.importorskip("hydra")
pytestmark = [pytest.mark.vllm, pytest.mark.hf, pytest.mark.slow]

import torch  # noqa: E402

N_PROMPTS, MAX_TOKENS, PROMPT_LEN = 8, 10, 32


def _mean(xs) -> float:
    return float(np.mean(xs))


class _InProcess:
    """A Ray actor handle's call shape (`handle.method.remote(...)`, awaited) over a local object:
    verl's client reaches its load balancer and server through handles; here both live in this process."""

    def __init__(self, obj) -> None:
        self._obj = obj

    def __getattr__(self, name):
        method = getattr(self._obj, name)

        class _Call:
            @staticmethod
            def remote(*args, **kwargs):  # arguments by value, as Ray sends them (verl's server pops from its dicts)
                out = method(*copy.deepcopy(args), **copy.deepcopy(kwargs))
                if asyncio.iscoroutine(out):
                    return asyncio.ensure_future(out)
                done = asyncio.get_running_loop().create_future()
                done.set_result(out)
                return done
        return _Call


def _worker(rollout_config, tokenizer):
    """verl's AgentLoopWorker with only what its postprocessing reads (no Ray actor, no reward loop)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    w = object.__new__(AgentLoopWorker)
    w.rollout_config, w.tokenizer, w.processor = rollout_config, tokenizer, None
    w.reward_loop_worker_handles, w.distillation_enabled, w.mm_processor_kwargs = None, False, {}
    return w


@pytest.fixture(scope="module")
def served(tiny_model):
    import ray

    from moe_replay.integrations.verl.cpu import use_cpu

    use_cpu()
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.replica import RolloutMode, RolloutReplicaRegistry

    from moe_replay.integrations.verl.registry import install

    install()
    from moe_replay.integrations.verl.rollout import MoeReplayHttpServer, MoeReplayVLLMReplica

    assert RolloutReplicaRegistry.get("vllm") is MoeReplayVLLMReplica
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False)
    model_dir = tiny_model("qwen3_moe")
    mc = HFModelConfig(path=str(model_dir), override_config={"attn_implementation": "sdpa", "moe_replay": "r3_support"})
    rc = RolloutConfig(name="vllm", tensor_model_parallel_size=1, dtype="bfloat16", enforce_eager=True, max_model_len=512,
                       prompt_length=PROMPT_LEN, response_length=2 * PROMPT_LEN, max_num_seqs=8,
                       max_num_batched_tokens=512, top_p=0.9, load_format="auto", enable_sleep_mode=False,
                       free_cache_engine=False, engine_kwargs={"vllm": {"distributed_executor_backend": "uni"}})
    server = MoeReplayHttpServer(rc, mc, RolloutMode.HYBRID, [], 0, 0, 1, 1, "")
    tok = mc.tokenizer
    prompts = [tok.encode(f"Q: {i} + {i % 7} = ? A:", add_special_tokens=False) for i in range(N_PROMPTS)]
    tool_ids = tok.encode(" result 42. Next:", add_special_tokens=False)

    async def run():
        from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

        from moe_replay.integrations.verl.rollout import finish_sample, start_sample, take_turn

        await server.launch_server()

        def params(seed):
            return {"temperature": 1.0, "top_p": 0.9, "logprobs": True, "max_tokens": MAX_TOKENS, "seed": seed,
                    "ignore_eos": True}

        async def single(i):  # what the wrapped _run_agent_loop / LLMServerClient.generate do per sample
            token = start_sample()
            out = take_turn(await server.generate(list(prompts[i]), params(i), f"s{i}"))
            agent_out = AgentLoopOutput(prompt_ids=prompts[i], response_ids=out.token_ids, response_mask=[1] * len(out.token_ids),
                                        response_logprobs=out.log_probs, num_turns=2, metrics=AgentLoopMetrics(),
                                        extra_fields=out.extra_fields)
            return finish_sample(agent_out, token)

        async def two_turns():  # verl's tool agent loop: one request id, the second prompt extends the first turn
            token = start_sample()
            p1 = tok.encode("The tool says:", add_special_tokens=False)
            o1 = take_turn(await server.generate(list(p1), params(100), "conv"))
            p2 = [*p1, *o1.token_ids, *tool_ids]
            o2 = take_turn(await server.generate(list(p2), params(101), "conv"))
            resp = [*o1.token_ids, *tool_ids, *o2.token_ids]
            mask = [1] * len(o1.token_ids) + [0] * len(tool_ids) + [1] * len(o2.token_ids)
            fields = dict(o1.extra_fields)  # verl keeps the first turn's extra fields only
            agent_out = AgentLoopOutput(prompt_ids=p1, response_ids=resp, response_mask=mask, num_turns=4,
                                        metrics=AgentLoopMetrics(), extra_fields=fields)
            return finish_sample(agent_out, token), (o1, o2)

        singles = await asyncio.gather(*(asyncio.create_task(single(i)) for i in range(N_PROMPTS)))
        multi, turns = await asyncio.create_task(two_turns())

        # verl's fully-async client: each sample through its generate (no take_turn here: the
        # registry's patch of the base generate, which it calls per attempt, takes the trace)
        from omegaconf import OmegaConf
        from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient
        from verl.workers.rollout.router import GlobalRequestLoadBalancer

        cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "response_length": 2 * PROMPT_LEN}},
                                "async_training": {"partial_rollout": True}})
        client = FullyAsyncLLMServerClient(cfg, load_balancer_handle=_InProcess(GlobalRequestLoadBalancer({"s0": _InProcess(server)})))

        async def via_client(i, max_tokens=MAX_TOKENS):
            token = start_sample()
            prompt = list(prompts[i])
            out = await client.generate(f"fa{i}", prompt_ids=prompt, sampling_params={**params(200 + i), "max_tokens": max_tokens})
            agent_out = AgentLoopOutput(prompt_ids=prompt, response_ids=out.token_ids, response_mask=[1] * len(out.token_ids),
                                        response_logprobs=out.log_probs, num_turns=2, metrics=AgentLoopMetrics(),
                                        extra_fields=out.extra_fields)
            return finish_sample(agent_out, token)

        fully_async = await asyncio.gather(*(asyncio.create_task(via_client(i)) for i in range(4)))

        async def aborted():  # an abort mid-request; the client resumes with the tokens so far
            task = asyncio.create_task(via_client(5, max_tokens=400))
            states = server.engine.output_processor.request_states
            while not states:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            # verl 0.9.1's own aborts fail on vLLM 0.32 (docs/verl.md): `abort_all_requests` passes
            # pause_generation a keyword vLLM dropped, `abort_request` calls
            # OutputProcessor.abort_requests without its new `internal` argument; so vLLM's abort
            rid = next(iter(states))
            await server.engine.abort(rid, internal=True)
            done = {"aborted": True, "request_id": rid}
            try:
                return done, await task
            except Exception as e:  # noqa: BLE001  (the test asserts what it is)
                return done, e

        resumed = await aborted()

        # verl's own AgentLoopWorker._run_agent_loop (as the registry wraps it) running verl's
        # single-turn agent loop over the fully-async client: nothing called by hand in between
        import verl.experimental.agent_loop.single_turn_agent_loop  # noqa: F401  (registers "single_turn_agent")

        loop_tok = copy.deepcopy(tok)  # the tiny tokenizer has no chat template; verl's agent loops render one
        loop_tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                  "{% if add_generation_prompt %}assistant:{% endif %}")
        loop_worker = _worker(rc, loop_tok)
        loop_worker.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "prompt_length": PROMPT_LEN,
                                                                                "response_length": 2 * PROMPT_LEN}},
                                               "data": {}})
        loop_worker.llm_client, loop_worker.hf_model_type, loop_worker.dataset_cls, loop_worker.tools = client, None, None, []

        async def agent_loop(i):
            try:
                return await loop_worker._run_agent_loop(
                    params(300 + i), {"step": 0, "sample_index": i, "rollout_n": 0, "validate": False},
                    agent_name="single_turn_agent", raw_prompt=[{"role": "user", "content": f"Q: {i} + {i % 7} = ? A:"}])
            except Exception as e:  # noqa: BLE001  (the test names it)
                return e

        looped = list(await asyncio.gather(*(asyncio.create_task(agent_loop(i)) for i in range(4))))
        return singles, multi, turns, fully_async, resumed, looped

    try:
        singles, multi, turns, fully_async, resumed, looped = asyncio.run(run())
    finally:
        engine = getattr(server, "engine", None)
        if engine is not None:
            engine.shutdown()
        if started:
            ray.shutdown()
    worker = _worker(rc, tok)

    def pack(outputs):
        async def post():
            internal = [await worker._agent_loop_postprocess(o, False, raw_prompt=[]) for o in outputs]
            return worker._postprocess(internal, input_non_tensor_batch=None)
        return asyncio.run(post())

    return dict(model_dir=model_dir, singles=singles, multi=multi, turns=turns, pack=pack, pad=tok.pad_token_id or 0,
                fully_async=fully_async, resumed=resumed, looped=looped, postprocess=worker._postprocess)


@pytest.fixture(scope="module")
def engines(served):
    from moe_replay.integrations.verl.local import build_engine

    return {p: build_engine(str(served["model_dir"]), p) for p in ("none", "r3_support")}


def test_verls_server_returns_a_trace_per_sample(served):
    from moe_replay.codec import decode_trace
    from moe_replay.integrations.verl import TRACES_KEY

    for out in served["singles"]:
        trace = decode_trace(out.extra_fields[TRACES_KEY])
        assert trace.token_ids_S.tolist() == [*out.prompt_ids, *out.response_ids]
        assert trace.routes_TLK is not None and trace.route_start == 0 and trace.num_route_rows == trace.num_tokens - 1
        gen = trace.token_ids_S[trace.prompt_len:]
        assert all(tok in trace.support.kept(g, trace.geometry.vocab_size) for g, tok in enumerate(gen))  # each sampled token in its kept set
        np.testing.assert_allclose(trace.logprobs_G, out.response_logprobs, atol=1e-5)  # verl's rollout logprobs
        assert trace.sampling.top_p == pytest.approx(0.9)


def test_agent_loop_packing_carries_traces_into_the_actor(served, engines):
    """verl's own postprocessing puts the traces in non_tensor_batch; the actor replays them:
    0 route flips (some without), k3-KL lower, and an update step under the routes."""
    from moe_replay.integrations.verl import CHUNKS_KEY, TRACES_KEY
    from moe_replay.integrations.verl.local import advantages_from_rewards, old_log_prob, update_actor

    batch = served["pack"](served["singles"])
    assert len(batch.non_tensor_batch[TRACES_KEY]) == N_PROMPTS and "rollout_log_probs" in batch.batch.keys()
    assert len(batch.non_tensor_batch[CHUNKS_KEY]) == N_PROMPTS  # the registry's _postprocess shared the batch's chunks
    out = {p: old_log_prob(engines[p], served["pack"](served["singles"])) for p in engines}
    flips = {p: _mean(m["moe_replay/route_flip_rate"]) for p, (_, m) in out.items()}
    k3 = {p: _mean(m["rollout_corr/k3_kl"]) for p, (_, m) in out.items()}
    print(f"verl rollout -> FSDP pi_old: flips {flips}, k3 {k3}")
    assert flips["r3_support"] == 0.0 and flips["none"] > 0.0
    assert k3["r3_support"] < k3["none"]

    advantages_from_rewards(batch, torch.linspace(-1, 1, N_PROMPTS))
    m = update_actor(engines["r3_support"], batch.union(out["r3_support"][0]))
    assert max(m["moe_replay/route_flip_rate"]) == 0.0 and np.isfinite(float(m["grad_norm"]))


def test_multi_turn_sample_keeps_every_turns_routes_and_kept_sets(served, engines):
    """The stitched record of verl's two-turn sample holds both turns' routes, kept sets and
    logprobs (schema v3 spans); the actor scores each turn's sampled tokens over its own kept set
    and the tool text over the full vocabulary (checked by hand against the forward's logits)."""
    from moe_replay.codec import decode_trace
    from moe_replay.integrations.verl import TRACES_KEY
    from moe_replay.integrations.verl.local import old_log_prob

    multi = served["multi"]
    record = decode_trace(multi.extra_fields[TRACES_KEY])
    o1, o2 = served["turns"]
    assert TRACES_KEY not in o1.extra_fields and TRACES_KEY not in o2.extra_fields  # taken off each TokenOutput
    assert record.route_start == 0 and record.num_route_rows == record.num_tokens - 1
    assert record.token_ids_S.tolist() == [*multi.prompt_ids, *multi.response_ids]
    assert len(record.extra["turns"]) == 1  # the first turn's key, stitched in
    p1, n1, n2, n = len(multi.prompt_ids), len(o1.token_ids), len(o2.token_ids), record.num_tokens
    tool = n - p1 - n1 - n2
    assert record.prompt_len == p1 and record.spans == ((p1, p1 + n1), (n - n2, n)) and tool > 0
    np.testing.assert_allclose(record.logprobs_G, [*o1.log_probs, *o2.log_probs], atol=1e-5)  # verl's rollout logprobs
    pos = record.generated_positions()
    assert all(record.token_ids_S[p] in record.support.kept(g, record.geometry.vocab_size) for g, p in enumerate(pos))

    batch = served["pack"]([multi, *served["singles"][:3]])
    engine = engines["r3_support"]
    logits = []
    hook = engine.module.register_forward_hook(lambda mod, args, out: logits.append(out.logits.detach().float()))
    try:
        out, m = old_log_prob(engine, batch)
    finally:
        hook.remove()
    assert _mean(m["moe_replay/route_flip_rate"]) == 0.0
    assert sum(m["moe_replay/route_tokens"]) == record.num_tokens - 1 + sum(
        len(o.prompt_ids) + len(o.response_ids) - 1 for o in served["singles"][:3])

    (logits_BSV,) = logits  # row 0 is the conversation, right-padded from column 0
    full_RV = torch.log_softmax(logits_BSV[0, p1 - 1: n - 1], -1)  # temperature 1.0
    ids_R = torch.from_numpy(record.token_ids_S[p1:]).long()
    lp_R = out.batch["old_log_probs"][0, : n - p1]
    want_R = full_RV[torch.arange(n - p1), ids_R].clone()  # tool text: the full vocabulary
    for g, p in enumerate(pos):  # both turns' sampled tokens: their own kept sets
        kept = torch.from_numpy(record.support.kept(g, record.geometry.vocab_size)).long()
        want_R[p - p1] = full_RV[p - p1, ids_R[p - p1]] - torch.logsumexp(full_RV[p - p1, kept], 0)
    torch.testing.assert_close(lp_R, want_R, rtol=0, atol=2e-5)
    tool_R = torch.zeros(n - p1, dtype=torch.bool)
    tool_R[n1: n1 + tool] = True
    assert (lp_R[~tool_R] > full_RV[torch.arange(n - p1), ids_R][~tool_R] - 1e-6).all()  # renormalised: never lower
    assert torch.equal(batch.batch["response_mask"][0, : n - p1].bool(), ~tool_R)  # verl's own mask: tool text off


def test_fully_async_client_carries_traces_into_the_actor(served, engines):
    """verl's FullyAsyncLLMServerClient.generate (the fully-async rollouter's client) over the
    capturing server: each sample's trace is taken per attempt by the registry's hook and reaches
    the actor; 0 route flips, and the sampled tokens lie in their kept sets."""
    from moe_replay.codec import decode_trace
    from moe_replay.integrations.verl import TRACES_KEY
    from moe_replay.integrations.verl.local import old_log_prob

    outs = served["fully_async"]
    for out in outs:
        trace = decode_trace(out.extra_fields[TRACES_KEY])
        assert trace.token_ids_S.tolist() == [*out.prompt_ids, *out.response_ids] and not trace.multi_span
        assert all(trace.token_ids_S[p] in trace.support.kept(g, trace.geometry.vocab_size) for g, p in enumerate(trace.generated_positions()))
        np.testing.assert_allclose(trace.logprobs_G, out.response_logprobs, atol=1e-5)
    _, m = old_log_prob(engines["r3_support"], served["pack"](outs))
    assert _mean(m["moe_replay/route_flip_rate"]) == 0.0


def test_verls_agent_loop_over_the_fully_async_client(served, engines):
    """verl's `_run_agent_loop` (wrapped by the registry) runs its single-turn agent loop over the
    fully-async client; the padded outputs it returns carry their traces through verl's
    `_postprocess` into the actor: 0 route flips."""
    from moe_replay.integrations.verl import TRACES_KEY
    from moe_replay.integrations.verl.local import old_log_prob

    looped = served["looped"]
    bad = [o for o in looped if isinstance(o, BaseException)]
    assert not bad, repr(bad[0])
    assert all(TRACES_KEY in o.extra_fields for o in looped)
    batch = served["postprocess"](looped, input_non_tensor_batch=None)
    assert len(batch.non_tensor_batch[TRACES_KEY]) == len(looped)
    _, m = old_log_prob(engines["r3_support"], batch)
    assert _mean(m["moe_replay/route_flip_rate"]) == 0.0


def test_fully_async_resume_after_an_abort_is_refused_by_name(served):
    """The request was aborted mid-generation (as verl's weight sync does) and the fully-async
    client resumed it: the aborted attempt's tokens have no kept sets in any trace, so
    the sample is refused where it is stitched, naming the position, instead of scored over the
    full vocabulary."""
    from moe_replay.errors import TraceAlignmentError

    done, err = served["resumed"]
    assert done["aborted"], done
    assert isinstance(err, TraceAlignmentError), err
    assert "response_mask[0] (position" in str(err) and "fully-async client resumed" in str(err)


def test_a_sample_without_its_trace_is_refused(served, engines):
    from moe_replay.integrations.verl import TRACES_KEY, MissingTraceError
    from moe_replay.integrations.verl.local import old_log_prob

    outs = [o.model_copy(deep=True) for o in served["singles"]]
    del outs[5].extra_fields[TRACES_KEY]  # e.g. a sample from a server without capture
    with pytest.raises(MissingTraceError, match="row 5"):
        old_log_prob(engines["r3_support"], served["pack"](outs))


def test_uninstall_gives_verl_its_rollout_back(served):
    """The rollout patches (registry.py) are undoable: verl's replica, client, agent loop and its
    postprocessing return."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica

    from moe_replay.integrations.verl.registry import install, uninstall
    from moe_replay.integrations.verl.rollout import MoeReplayVLLMReplica

    def hooks():
        return LLMServerClient.generate, AgentLoopWorker._run_agent_loop, AgentLoopWorker._postprocess

    patched = hooks()
    uninstall()
    try:
        assert RolloutReplicaRegistry.get("vllm") is vLLMReplica
        original = hooks()
        assert all(o is not p for o, p in zip(original, patched))
    finally:
        install()
    assert RolloutReplicaRegistry.get("vllm") is MoeReplayVLLMReplica
    assert all(n is not o for n, o in zip(hooks(), original))
