"""Both vLLM model runners, end to end: the engine runs the session's runner, and capture, forced
scoring and the π_old estimator are exact on it (marked `mrv2`: `make test` runs this file on the
V1 runner and again on Model Runner V2, tests/runners.py).

Proves, against HF fp32 as the reference, on the runner the session runs (asserted, not assumed):
multi-turn stitching via routed_experts_prompt_start equals HF's routing of the conversation;
forced scoring and `r3_support_multisample`'s π_old equal the trainer's replay; capture in vLLM's
default compiled mode and speculative decoding (n-gram) are exact. On Model Runner V2 also: its
traces equal the V1 runner's on the same tokens (vLLM's trace replay forces V1's tokens on MRV2;
V1 runs in a subprocess), and vLLM's own outputs (routed experts, sampling mask, processed
logprobs: native_engine_kwargs) give the same traces as the hooks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.mrv2]

from moe_replay.integrations.vllm import CaptureConfig, VllmCapture  # noqa: E402
from moe_replay.trace import stitch  # noqa: E402

from .runners import RUNNER, v1_env  # noqa: E402
from .test_vllm_capture import (  # noqa: E402
    BLOCK,
    SAMPLING,
    check_against_hf,
    hf_forward,
    prompt_text,
    sampling_params,
    shutdown,
)

ROOT = Path(__file__).resolve().parents[1]
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=384, max_num_seqs=8, max_num_batched_tokens=128,
              seed=0, distributed_executor_backend="uni", block_size=BLOCK)
RUNNER_MODULE = {"v1": "vllm.v1.worker.cpu_model_runner", "mrv2": "vllm.v1.worker.cpu.model_runner"}
"""The module of vLLM-CPU's runner class on each path."""


def runner_of(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def make(model_dir, **kw):
    from vllm import LLM

    from moe_replay.integrations.vllm.scoring.scorer import scoring_engine_kwargs

    llm = LLM(**scoring_engine_kwargs(model=str(model_dir), **{**ENGINE, **kw}))
    assert type(runner_of(llm)).__module__ == RUNNER_MODULE[RUNNER], type(runner_of(llm))  # the session's runner
    return llm


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def engine(model_dir):
    llm = make(model_dir, **({"enable_trace_replay": True} if RUNNER == "mrv2" else {}))
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def test_multi_turn_stitches_to_hfs_routing_of_the_conversation(engine, model_dir):
    """Turn 2 asks only for its new routes (routed_experts_prompt_start) and reads turn 1's blocks from
    the prefix cache; stitched onto turn 1 it equals HF's routing of the whole conversation."""
    with VllmCapture(engine) as cap:
        (_,), (t1,) = cap.generate([prompt_text(40, seed=21)], sampling_params(*SAMPLING[0], max_tokens=5), use_tqdm=False)
        turn2 = [*t1.token_ids_S.tolist(), *engine.get_tokenizer().encode(" dog expert", add_special_tokens=False)]
        sp2 = sampling_params(*SAMPLING[0], max_tokens=5, routed_experts_prompt_start=t1.num_tokens - 1)
        (o2,), (t2,) = cap.generate([{"prompt_token_ids": turn2}], sp2, use_tqdm=False)
    assert t2.route_start == t1.num_tokens - 1 and o2.num_cached_tokens >= BLOCK
    full = stitch(t1, t2)
    hf_routes, _ = hf_forward(model_dir, full.token_ids_S)
    assert full.route_start == 0
    assert np.array_equal(np.sort(full.routes_TLK, -1), np.sort(hf_routes, -1).astype(full.routes_TLK.dtype))
    check_against_hf(t2, model_dir, SAMPLING[0])


def test_the_estimator_and_forced_scoring_equal_the_trainers_replay(engine, hf):
    """`r3_support_multisample` on the runner: its π_old (forced routes, n = 2 replicas) equals the
    trainer's replay of the same traces; free scoring equals it too (this engine is deterministic)."""
    import moe_replay
    from moe_replay.integrations.vllm import VllmScorer, VllmScorerConfig

    with moe_replay.enable("r3_support_multisample", llm=engine, model=hf) as mr:
        _, traces = mr.generate([prompt_text(6, seed=3), prompt_text(9, seed=4)],
                                [sampling_params(*SAMPLING[0], max_tokens=6, n=2, seed=1),
                                 sampling_params(*SAMPLING[5], max_tokens=6, seed=2)])
        pi_old = mr.pi_old(traces)
        with mr.train_batch(traces) as batch, torch.no_grad():
            logp_G = batch.logprobs(hf(**batch.model_inputs()).logits).numpy()
    assert pi_old is not None and len(pi_old) == len(logp_G) == sum(t.num_generated for t in traces)
    assert np.abs(np.asarray(pi_old) - logp_G).max() < 1e-4, np.abs(np.asarray(pi_old) - logp_G).max()
    free = VllmScorer(engine, VllmScorerConfig(force_routes=False))
    try:
        got = np.concatenate(free.score_batch(traces))
    finally:
        free.uninstall()
    assert np.abs(got - logp_G).max() < 1e-4


# -- Model Runner V2 against the V1 runner and against vLLM's own outputs -------------------------------
_V1_CAPTURE = """
import json, os, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
from moe_replay.integrations.vllm import VllmCapture, capture_engine_kwargs
from moe_replay.store import DirectoryStore
model, out, engine, requests = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
llm = LLM(**capture_engine_kwargs(model=model, **engine))
assert type(llm.llm_engine.model_executor.driver_worker.worker.model_runner).__module__ == "vllm.v1.worker.cpu_model_runner"
with VllmCapture(llm) as cap, DirectoryStore(out) as store:
    _, traces = cap.generate([r["prompt"] for r in requests],
                             [SamplingParams(**r["params"]) for r in requests], use_tqdm=False)
    for i, t in enumerate(traces):
        t.key = str(i)
    store.put_many(traces)
"""

REQUESTS = [  # (prompt, SamplingParams): top-p alone, top-k and top-p, greedy, top-k alone; unseeded (MRV2 gets V1's
    # tokens, and vLLM-CPU's V1 runner fails a seeded request whose step it discards: "CPU Generator does not use offset")
    {"prompt": prompt_text(12, seed=31), "params": dict(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True)},
    {"prompt": prompt_text(50, seed=32), "params": dict(temperature=0.8, top_k=20, top_p=0.8, max_tokens=8, ignore_eos=True)},
    {"prompt": prompt_text(20, seed=33), "params": dict(temperature=0.0, max_tokens=8, ignore_eos=True)},
    {"prompt": prompt_text(9, seed=34), "params": dict(temperature=1.2, top_k=40, max_tokens=8, ignore_eos=True)},
]


@pytest.fixture(scope="module")
def v1_traces(model_dir, tmp_path_factory):
    """The V1 runner's traces of REQUESTS, captured in a subprocess (a V1 process: no test bed)."""
    from moe_replay.store import DirectoryStore

    out = tmp_path_factory.mktemp("v1-traces")
    engine = {k: v for k, v in ENGINE.items()}
    subprocess.run([sys.executable, "-c", _V1_CAPTURE, str(model_dir), str(out / "store"), json.dumps(engine),
                    json.dumps(REQUESTS)], check=True, env=v1_env(), cwd=ROOT, timeout=600)
    with DirectoryStore(out / "store") as store:
        return [store.get(str(i)) for i in range(len(REQUESTS))]


def _forced(requests: list[dict], traces) -> list:
    """SamplingParams that make Model Runner V2 emit each trace's tokens (vLLM's trace replay)."""
    from vllm import SamplingParams

    out = []
    for r, t in zip(requests, traces):
        params = dict(r["params"], trace_decode_token_ids=t.token_ids_S[t.prompt_len:].tolist())
        params["max_tokens"] = t.num_generated
        out.append(SamplingParams(**params))
    return out


def _same_trace(a, b, where: str) -> None:
    assert np.array_equal(a.token_ids_S, b.token_ids_S), where
    assert np.array_equal(a.routes_TLK, b.routes_TLK), f"{where}: routes (column order included)"
    assert a.support.equals(b.support), f"{where}: kept sets"
    assert np.abs(a.logprobs_G - b.logprobs_G).max() < 1e-5, f"{where}: {np.abs(a.logprobs_G - b.logprobs_G).max()}"


def test_mrv2_traces_equal_the_v1_runners_on_the_same_tokens(engine, v1_traces, runner):
    """MRV2 forced by vLLM's trace replay onto the V1 runner's sampled tokens: routes (in column order),
    kept sets and logprobs equal V1's, request by request."""
    if runner != "mrv2":
        pytest.skip("compares Model Runner V2 with the V1 runner (trace replay is MRV2's)")
    with VllmCapture(engine) as cap:
        _, traces = cap.generate([r["prompt"] for r in REQUESTS], _forced(REQUESTS, v1_traces), use_tqdm=False)
    for i, (a, b) in enumerate(zip(traces, v1_traces)):
        _same_trace(a, b, f"request {i}")


def test_vllms_own_outputs_on_mrv2_equal_the_hooks(model_dir, v1_traces, runner):
    """An MRV2 engine built with native_engine_kwargs returns routed experts, the sampling mask and
    processed logprobs itself; capture reads every part from them (no hook installed), and forced onto
    the V1 runner's tokens they give the hooks' traces: routes in column order, kept sets, logprobs."""
    if runner != "mrv2":
        pytest.skip("vLLM-CPU's V1 runner returns no native routes or mask (test_vllm_native.py: refused by name)")
    from vllm import LLM

    from moe_replay.integrations.vllm.capture.native import native_engine_kwargs

    # vLLM's mask needs temperature > 0 and top_k > 0; it refuses the other requests (why capture's default is hooks)
    keep = [i for i, r in enumerate(REQUESTS) if r["params"]["temperature"] > 0 and r["params"].get("top_k", 0) > 0]
    requests, picked = [REQUESTS[i] for i in keep], [v1_traces[i] for i in keep]
    assert len(keep) == 2
    llm = LLM(**native_engine_kwargs(model=str(model_dir), enable_trace_replay=True, enable_prefix_caching=True, **ENGINE))
    try:
        with VllmCapture(llm, CaptureConfig(source="native")) as cap:
            assert cap.plan.native == {"routes", "support", "logprobs"} and cap._link is None
            _, traces = cap.generate([r["prompt"] for r in requests], _forced(requests, picked), use_tqdm=False)
    finally:
        shutdown(llm)
    for i, (a, b) in enumerate(zip(traces, picked)):
        b = dataclasses.replace(b, sampling=a.sampling)
        _same_trace(a, b, f"request {i}")


# -- engines of their own (after every test of the module's engine: in-process engines share vLLM's
#    process-wide parallel state, which shutting one down clears) ------------------------------------
def test_a_bf16_engine_with_steps_that_need_no_sampling_work(model_dir):
    """A bf16 engine whose steps alternate between needing sampling work (a top-p request: MRV2 copies the
    logits to fp32) and needing none (only an untruncated request left: MRV2 hands over the raw bf16
    logits): every trace complete, its tokens inside their kept sets, the untruncated one kept whole."""
    from vllm import SamplingParams

    llm = make(model_dir, dtype="bfloat16")
    try:
        with VllmCapture(llm) as cap:
            _, (plain, top_p) = cap.generate(
                [prompt_text(8, seed=70), prompt_text(9, seed=71)],
                [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),
                 SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, ignore_eos=True)], use_tqdm=False)
            st = cap.stats()
    finally:
        shutdown(llm)
    assert st["support_misses"] == 0 and plain.num_generated == 8 and top_p.num_generated == 3
    assert plain.support.whole_flags().all() and not top_p.support.whole_flags().any()
    assert plain.engine.dtype == "bfloat16" and np.isfinite(plain.logprobs_G).all()


def test_capture_and_forcing_in_compiled_mode(model_dir, hf, runner):
    """vLLM's default compiled forward (enforce_eager=False): capture by the load-time step buffer and
    forced scoring by the load-time forcing step are exact. (The V1 runner's compiled tests:
    test_vllm_capture_compiled.py, test_vllm_force_compiled.py.)"""
    if runner == "v1":
        pytest.skip("the V1 runner's compiled mode has its own tests (test_vllm_capture_compiled.py)")
    import moe_replay

    llm = make(model_dir, enforce_eager=False)
    try:
        with moe_replay.enable("r3_support_multisample", llm=llm, model=hf) as mr:
            _, traces = mr.generate([prompt_text(7, seed=5), prompt_text(40, seed=6)],
                                    [sampling_params(*SAMPLING[i], max_tokens=6, seed=i) for i in (0, 3)])
            assert mr.capture.stats()["route_mode"] == "load-time step buffer"
            pi_old = mr.pi_old(traces)
            with mr.train_batch(traces) as batch, torch.no_grad():
                logp_G = batch.logprobs(hf(**batch.model_inputs()).logits).numpy()
        for t, i in zip(traces, (0, 3)):
            check_against_hf(t, model_dir, SAMPLING[i])
        assert np.abs(np.asarray(pi_old) - logp_G).max() < 1e-4
    finally:
        shutdown(llm)


def test_speculative_decoding_captures_the_target_model(model_dir, runner):
    """n-gram speculation (3 drafts a step) on Model Runner V2 (its port reads `RejectionSampler._verify`):
    routes of accepted drafts, rejected drafts' rows dropped, kept sets of the target distribution; every
    trace equals HF (as without speculation)."""
    if runner == "v1":
        pytest.skip("the V1 runner's speculation has its own tests (test_vllm_spec.py, with the shim vLLM-CPU's "
                    "V1 rejection sampler needs: tests/cpu_shims)")
    from vllm import SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    prompts = ["a b c a b c a b c a b c a b", "the cat the cat the cat the cat", "one two three one two three one"]
    sampling = [(0.0, -1, 1.0, 0.0), (1.0, -1, 0.9, 0.0), (0.7, 20, 0.8, 0.0)]
    llm = make(model_dir, speculative_config=spec)
    try:
        with VllmCapture(llm, CaptureConfig()) as cap:
            _, traces = cap.generate(prompts, [SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=12,
                                                              ignore_eos=True, seed=i)
                                               for i, (t, k, p, _) in enumerate(sampling)], use_tqdm=False)
            st = cap.stats()
    finally:
        shutdown(llm)
    assert st["spec"]["method"] == "ngram" and st["support_misses"] == 0, st
    assert 0 < st["spec_accepted"] < st["spec_drafts"], st  # drafts accepted (their routes kept) and rejected (dropped)
    for t, prm in zip(traces, sampling):
        check_against_hf(t, model_dir, prm)


def test_users_default_sampling_at_a_real_vocabulary(tiny_model, runner):
    """TRL's and verl's default rollout sampling (temperature 1, top-p 1, top-k off: untruncated) and
    greedy evaluation at Qwen3's vocabulary (V = 151,936), under the default CaptureConfig
    (max_support 4096): captured, never refused. An untruncated row is kept whole (no ids: V of them
    would be 600 KB a token), a greedy row holds its token; HF replays every trace exactly."""
    if runner == "mrv2":
        pytest.skip("Triton's interpreter takes ~50 s for 6 tokens at V = 151,936 (MRV2's untruncated rows are tested "
                    "at V = 512: test_vllm_capture.py); rows kept whole are the runners' shared code (assemble.py)")
    from vllm import SamplingParams
    from transformers import AutoModelForCausalLM

    from moe_replay.integrations.vllm.coverage import replay_measure

    model_dir = tiny_model("qwen3_moe", vocab_size=151_936)
    llm = make(model_dir, max_model_len=256)
    params = [SamplingParams(max_tokens=6, temperature=1.0, top_p=1.0, top_k=0, ignore_eos=True),  # TRL / verl default
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),  # greedy evaluation
              SamplingParams(max_tokens=6, temperature=0.7, top_k=50, top_p=0.9, ignore_eos=True)]
    try:
        with VllmCapture(llm) as cap:
            _, (untruncated, greedy, truncated) = cap.generate(["the cat sat", "a dog ran far", "route the token"],
                                                               params, use_tqdm=False)
    finally:
        shutdown(llm)
    assert untruncated.support.whole_flags().all() and len(untruncated.support.ids_N) == 0
    assert (greedy.support.sizes_G() == 1).all() and not greedy.support.whole_flags().any()
    assert not truncated.support.whole_flags().any() and (truncated.support.sizes_G() <= 50).all()
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    got = replay_measure(hf, [untruncated, greedy, truncated])
    assert got["flips"] == 0 and got["hf_vs_engine_max_abs_logprob"] < 1e-4, got


_CHOOSE = """
import os, sys
from moe_replay.integrations.vllm.runner_env import RunnerChoiceError, choose_runner
print(choose_runner(sys.argv[1]))
from moe_replay.integrations.vllm.engine_kwargs import engine_runner
print("runner", engine_runner({"model": sys.argv[2], "dtype": "float32", "max_model_len": 256}))
try:
    choose_runner("v1")
except RunnerChoiceError as e:
    print("refused after import:", e)
"""


def test_the_demo_picks_the_runner_by_a_flag(model_dir, runner):
    """`moe-replay demo --runner` (runner_env.choose_runner), in a fresh vLLM-CPU process: v1 runs the V1
    runner; mrv2 runs Model Runner V2, here under the checkout's test bed (activated before vLLM is
    imported); a choice made after vLLM is imported is refused by name (vLLM caches the variable)."""
    if runner == "mrv2":
        pytest.skip("run once, from the V1 session's environment (a fresh process each way)")
    for choice, want in (("v1", "v1"), ("mrv2", "mrv2")):
        out = subprocess.run([sys.executable, "-c", _CHOOSE, choice, str(model_dir)], capture_output=True, text=True,
                             env=v1_env(), cwd=ROOT, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        assert f"runner {want}" in out.stdout and "refused after import" in out.stdout, out.stdout
        assert ("test bed" in out.stdout) == (choice == "mrv2"), out.stdout


def test_runner_seam_is_one_module_per_runner():
    """What differs between the runners lives in runners/ (one module each): capture, scoring, the
    step bracket and the noise instrument touch no attribute that only one runner has."""
    import ast

    only = {"v1": {"input_batch", "query_start_loc", "discard_request_mask", "num_computed_tokens_cpu",
                   "topk_topp_sampler", "_model_forward"},
            "mrv2": {"req_states", "_sample_random", "prepare_inputs", "block_tables", "_verify"}}
    vllm_dir = ROOT / "integrations" / "vllm"
    for path in [*vllm_dir.glob("capture/*.py"), *vllm_dir.glob("scoring/*.py"), vllm_dir / "patch.py",
                 vllm_dir / "noise.py"]:
        used = {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}
        for runner_name, names in only.items():
            assert not used & names, f"{path.name} reads {sorted(used & names)} of the {runner_name} runner outside runners/"
