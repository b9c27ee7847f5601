"""vLLM's native outputs (routed experts, sampling mask, processed logprobs) as a capture source.

vLLM-CPU 0.32's V1 runner refuses the native flags (they need Model Runner V2), so the engine never
fills `CompletionOutput.routed_experts` / `.sampling_mask` in the V1 session (the MRV2 session runs
them for real: tests/test_vllm_runners.py). What CI can prove on the V1 engine:
the source choice and its errors; vLLM-CPU's own refusal reported as moe_replay's typed error;
and the conversion, run on vLLM's real RequestOutput / CompletionOutput / SamplingMask / Logprob
objects of a real hooks-captured run (prefix-cache hits, n = 2), filled in vLLM's documented
layout from that run's hooks traces: the native source must give the same trace back, bit for bit.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import os
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np
import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from moe_replay.codec.record import encode_trace  # noqa: E402
from moe_replay.errors import ExpertIdOutOfRangeError  # noqa: E402
from moe_replay.integrations.vllm import (  # noqa: E402
    CaptureConfig,
    CaptureHookError,
    CollectError,
    SupportOverflowError,
    VllmCapture,
    capture_engine_kwargs,
)
from moe_replay.integrations.vllm.capture import native  # noqa: E402
from moe_replay.integrations.vllm.capture.native import (  # noqa: E402
    EngineFlags,
    NativeOutputError,
    NativeSourceError,
    native_engine_kwargs,
    plan_sources,
)

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32  # KV block size: a shared prefix of > 32 tokens is a prefix-cache hit
WORDS = "the cat route token model expert layer sample mixture alpha beta dog".split()
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
              seed=0, distributed_executor_backend="uni", block_size=BLOCK, enable_prefix_caching=True)


def prompt_text(n_words: int, seed: int) -> str:
    return " ".join(np.random.default_rng(seed).choice(WORDS, n_words))


def params(seed: int, n: int = 1, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True, n=n, seed=seed, **kw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from moe_replay.models import build_tiny_model

    return build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("native") / "qwen3_moe", seed=0)


# Prompts share a 40-word prefix (> one 32-token block), so later ones hit the prefix cache; the
# seeds make a second run of the same requests sample the same tokens (CPU is deterministic).
PREFIX = prompt_text(40, seed=7)
PROMPTS = [PREFIX + " " + prompt_text(w, seed=i) for i, w in enumerate([3, 9, 5])]
SEEDS = [11, 12, 13]


@pytest.fixture(scope="module")
def engine(model_dir):
    from vllm import LLM

    llm = LLM(**capture_engine_kwargs(model=str(model_dir), **ENGINE))
    yield llm
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def hooks_run(engine):
    """One real run captured by hooks (source 'auto' on an engine without native flags): the first
    prompt alone, then all three with n = 2, so the later requests read cached prefix blocks."""
    cap = VllmCapture(engine, CaptureConfig(source="auto"))
    try:
        assert cap.plan.native == frozenset() and cap.plan.hooks == frozenset(native.PARTS)
        out0, tr0 = cap.generate(PROMPTS[:1], params(SEEDS[0]), use_tqdm=False)
        outs, trs = cap.generate(PROMPTS, [params(s, n=2) for s in SEEDS], use_tqdm=False)
    finally:
        cap.uninstall()
    return out0 + outs, tr0 + trs


def as_native(out, traces, geometry):
    """A copy of a real RequestOutput whose completions carry vLLM's native fields, in vLLM's layout
    (routed_experts [T, num_hidden_layers, K] uint8, dense layers' rows zero; SamplingMask rows;
    per-position {token: Logprob}), filled from the hooks traces of the same completions (in order)."""
    import copy

    from vllm.logprobs import Logprob
    from vllm.outputs import SamplingMask

    assert len(traces) == len(out.outputs)
    comps = []
    for t, comp in zip(traces, out.outputs):
        assert np.array_equal(t.token_ids_S[t.prompt_len:], comp.token_ids)
        dense = np.zeros((len(t.routes_TLK), geometry.num_layers, geometry.top_k), dtype=np.uint8)
        dense[:, list(geometry.moe_layer_ids)] = t.routes_TLK
        gen = t.token_ids_S[t.prompt_len:]
        lps = [{int(tok): Logprob(logprob=float(lp), rank=1)} for tok, lp in zip(gen, t.logprobs_G)]
        comps.append(dataclasses.replace(
            comp, routed_experts=dense, logprobs=lps,
            sampling_mask=SamplingMask([t.support.row(g).tolist() for g in range(t.num_generated)])))
    new = copy.copy(out)
    new.outputs = comps
    return new


ALL_FLAGS = EngineFlags(routed_experts=True, sampling_mask=True, logprobs_mode="processed_logprobs")


@pytest.fixture
def native_capture(engine, monkeypatch):
    """VllmCapture on the real engine planned as if it had been built with every native flag
    (vLLM-CPU refuses them), so collect() runs the native path of the public API."""
    def make(config: CaptureConfig, flags: EngineFlags = ALL_FLAGS) -> VllmCapture:
        monkeypatch.setattr(native.EngineFlags, "of", classmethod(lambda cls, _cfg: flags))
        return VllmCapture(engine, config, reset_prefix_cache=False)

    return make


def grouped(outs, traces):
    """The traces of each output, in its completions' order (collect's order)."""
    it = iter(traces)
    return [[next(it) for _ in o.outputs] for o in outs]


def sampling_of(outs, groups):
    return {o.request_id: g[0].sampling.to_dict() for o, g in zip(outs, groups)}


def same_trace(a, b) -> None:
    b = dataclasses.replace(b, key=a.key)  # a second run's request ids differ
    assert a.key == b.key and a.prompt_len == b.prompt_len and a.route_start == b.route_start
    assert np.array_equal(a.token_ids_S, b.token_ids_S)
    assert a.routes_TLK.dtype == b.routes_TLK.dtype and np.array_equal(a.routes_TLK, b.routes_TLK)
    assert np.array_equal(a.support.offsets_G1, b.support.offsets_G1) and np.array_equal(a.support.ids_N, b.support.ids_N)
    assert np.array_equal(a.logprobs_G.view(np.uint32), b.logprobs_G.view(np.uint32))
    assert encode_trace(a) == encode_trace(b)  # every field, bit for bit


# -- the source choice ---------------------------------------------------------------------------
def test_source_is_validated():
    with pytest.raises(ValueError, match="source must be one of .* got 'engine'"):
        CaptureConfig(source="engine")
    assert CaptureConfig.from_dict(CaptureConfig(source="native").to_dict()).source == "native"


def test_plan_per_part():
    """auto: native where the engine has the flag (0.26: routes only -> support and logprobs from
    hooks); native: every wanted part native or an error naming the missing flags; hooks: none."""
    routes_only = EngineFlags(routed_experts=True)
    p = plan_sources(CaptureConfig(source="auto"), routes_only)
    assert p.native == {"routes"} and p.hooks == {"support", "logprobs"}
    hc = p.hooks_config(CaptureConfig(source="auto", max_support=7))
    assert (hc.routes, hc.support, hc.logprobs, hc.source, hc.max_support) == (False, True, True, "hooks", 7)
    assert plan_sources(CaptureConfig(source="auto"), ALL_FLAGS).hooks_config(CaptureConfig()) is None
    assert plan_sources(CaptureConfig(source="hooks"), ALL_FLAGS).native == frozenset()
    assert plan_sources(CaptureConfig(source="native", support=False, logprobs=False), routes_only).native == {"routes"}
    with pytest.raises(NativeSourceError, match=r"return_sampling_mask=True .*logprobs_mode=\"processed_logprobs\""):
        plan_sources(CaptureConfig(source="native"), routes_only)


def test_native_asked_on_engine_without_flags_names_them(engine):
    """The real engine was built without the flags: asking for 'native' fails before anything is
    installed, naming each flag the wanted parts need; 'auto' falls back to hooks (hooks_run)."""
    assert EngineFlags.of(engine.llm_engine.vllm_config) == EngineFlags()
    with pytest.raises(NativeSourceError) as e:
        VllmCapture(engine, CaptureConfig(source="native"))
    msg = str(e.value)
    assert "enable_return_routed_experts=True" in msg and "return_sampling_mask=True" in msg
    with pytest.raises(NativeSourceError) as e:
        VllmCapture(engine, CaptureConfig(source="native", support=False, logprobs=False))
    assert "enable_return_routed_experts=True" in str(e.value) and "return_sampling_mask" not in str(e.value)


@pytest.mark.parametrize("support", [False, True])
def test_vllm_cpu_refusal_is_a_typed_error(model_dir, support):
    """vLLM-CPU refuses the flags itself (Model Runner V2 needs Triton): native_engine_kwargs
    reports vLLM's reason as NativeSourceError naming the flags, before any engine loads."""
    with pytest.raises(NativeSourceError) as e:
        native_engine_kwargs(support=support, model=str(model_dir), **ENGINE)
    msg = str(e.value)
    assert "enable_return_routed_experts" in msg and "Model Runner V2" in msg
    assert ("return_sampling_mask" in msg) == support
    with pytest.raises(ValueError, match="disagree"):
        native_engine_kwargs(model=str(model_dir), logprobs_mode="raw_logprobs")


# -- the conversion, on a real run -----------------------------------------------------------------
def test_hooks_run_has_prefix_hits_and_samples(hooks_run):
    outs, traces = hooks_run
    assert [len(o.outputs) for o in outs] == [1, 2, 2, 2]
    assert all((o.num_cached_tokens or 0) >= BLOCK for o in outs[1:]), [o.num_cached_tokens for o in outs]
    assert all(t.routes_TLK is not None and t.support is not None and t.logprobs_G is not None for t in traces)


def test_native_round_trip_is_bit_identical(hooks_run, native_capture):
    """Every part native, through VllmCapture.collect: the same traces back, bit for bit, for the
    first request, the prefix-cache hits and both samples of each n = 2 request."""
    outs, traces = hooks_run
    cap = native_capture(CaptureConfig(source="native"))
    assert cap.via == "native" and cap._link is None
    groups = grouped(outs, traces)
    native_outs = [as_native(o, g, cap.geometry) for o, g in zip(outs, groups)]
    got = cap.collect(native_outs, sampling=sampling_of(outs, groups))
    assert [t.key for t in got] == [t.key for t in traces] and len(got) == 7
    for a, b in zip(got, traces):
        same_trace(a, b)


def test_routes_native_support_from_hooks(engine, hooks_run, native_capture):
    """vLLM 0.26's case: the engine returns routes but no mask. 'auto' takes routes from the
    outputs and support + logprobs from hooks installed for those parts only; a second run of the
    same seeded requests gives the first run's traces bit for bit."""
    outs, traces = hooks_run
    groups = grouped(outs, traces)
    cap = native_capture(CaptureConfig(source="auto"), EngineFlags(routed_experts=True))
    try:
        assert cap.plan.native == {"routes"} and cap._hooks_config.routes is False
        engine.reset_prefix_cache()
        again = engine.generate(PROMPTS[:1], params(SEEDS[0]), use_tqdm=False)
        again += engine.generate(PROMPTS, [params(s, n=2) for s in SEEDS], use_tqdm=False)
        filled = [as_native(o, g, cap.geometry) for o, g in zip(again, groups)]
        for o in filled:
            for c in o.outputs:
                c.sampling_mask = c.logprobs = None  # 0.26: no mask; logprobs not requested
        got = cap.collect(filled, sampling=sampling_of(again, groups))
    finally:
        cap.uninstall()
    for a, b in zip(got, traces):
        same_trace(a, b)


# -- bad native data -----------------------------------------------------------------------------
def _corrupt(out, fn):
    c = out.outputs[0]
    out.outputs = [dataclasses.replace(c, **fn(c))] + list(out.outputs[1:])
    return out


def _collect_failure(cap, out):
    with pytest.raises(CollectError) as e:
        cap.collect([out])
    return next(iter(e.value.failures.items()))


def test_bad_native_data_is_refused_naming_request_and_position(hooks_run, native_capture):
    outs, traces = hooks_run
    cap = native_capture(CaptureConfig(source="native"))
    out = outs[0]
    key, P = out.request_id, len(out.prompt_token_ids)

    def fresh():
        return as_native(out, traces[:1], cap.geometry)

    # a row short (the last position missing)
    k, err = _collect_failure(cap, _corrupt(fresh(), lambda c: {"routed_experts": c.routed_experts[:-1]}))
    assert k == key and isinstance(err, NativeOutputError) and key in str(err) and "shape" in str(err)
    # only the MoE layers (L), not all decoder layers: the layout of another engine is refused
    k, err = _collect_failure(cap, _corrupt(fresh(), lambda c: {"routed_experts": c.routed_experts[:, :1]}))
    assert isinstance(err, NativeOutputError)
    # an expert id >= E at one position and layer
    def bad_id(c):
        r = c.routed_experts.copy()
        r[5, cap.geometry.moe_layer_ids[-1], 1] = cap.geometry.num_experts
        return {"routed_experts": r}
    k, err = _collect_failure(cap, _corrupt(fresh(), bad_id))
    assert isinstance(err, ExpertIdOutOfRangeError) and key in str(err)
    assert f"position 5, layer {cap.geometry.moe_layer_ids[-1]}, column 1" in str(err)
    # a mask row without its sampled token
    def drop_sampled(c):
        from vllm.outputs import SamplingMask

        rows = [list(r) for r in c.sampling_mask.token_ids]
        rows[3] = [t for t in rows[3] if t != c.token_ids[3]] or [(c.token_ids[3] + 1) % cap.geometry.vocab_size]
        return {"sampling_mask": SamplingMask(rows)}
    k, err = _collect_failure(cap, _corrupt(fresh(), drop_sampled))
    assert isinstance(err, NativeOutputError) and key in str(err) and f"position {P + 3}" in str(err)
    assert f"sampled token {out.outputs[0].token_ids[3]}" in str(err)
    # a mask with a row too few, and none at all
    from vllm.outputs import SamplingMask

    k, err = _collect_failure(cap, _corrupt(fresh(), lambda c: {"sampling_mask": SamplingMask(c.sampling_mask.token_ids[:-1])}))
    assert isinstance(err, NativeOutputError) and "8 rows" in str(err)
    k, err = _collect_failure(cap, _corrupt(fresh(), lambda c: {"sampling_mask": None}))
    assert isinstance(err, NativeOutputError) and "return_sampling_mask" in str(err)
    # no logprobs (the request did not ask for them)
    k, err = _collect_failure(cap, _corrupt(fresh(), lambda c: {"logprobs": None}))
    assert isinstance(err, NativeOutputError) and "SamplingParams(logprobs=0)" in str(err)
    # a support row over max_support follows the overflow policy, as with hooks
    m = max(len(r) for r in fresh().outputs[0].sampling_mask.token_ids)
    assert m > 1  # top_p 0.9 keeps several tokens somewhere on this model
    k, err = _collect_failure(native_capture(CaptureConfig(source="native", max_support=m - 1)), fresh())
    assert isinstance(err, SupportOverflowError) and f"max_support={m - 1}" in str(err) and key in str(err)
    (t,) = native_capture(CaptureConfig(source="native", max_support=m - 1, on_support_overflow="omit")).collect([fresh()])
    assert t.support is None and t.extra["support_omitted"]["max_support"] == m - 1 and t.routes_TLK is not None


# -- the GPU benchmark's native-vs-hooks variant ---------------------------------------------------
def test_gpu_benchmark_native_vs_hooks_plan():
    """benchmarks/gpu_capture.py --plan builds the native-vs-hooks engine's EngineArgs on CPU:
    one engine with vLLM's routes flag, the capture extension and prefix caching."""
    spec = importlib.util.spec_from_file_location("gpu_capture", ROOT / "benchmarks" / "gpu_capture.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert bench.main(["--plan", "--settings", "native_vs_hooks"]) == 0
    out = json.loads(buf.getvalue())
    kw = out["settings"]["native_vs_hooks"]
    assert kw["enable_return_routed_experts"] is True and kw["enable_prefix_caching"] is True
    assert "worker_extension_cls" in kw and out["compare"]["sources"] == ["native", "hooks"]


def test_async_capture_native_round_trip(model_dir, monkeypatch):
    """AsyncVllmCapture on a real AsyncLLM: 'auto' captures by hooks there; planned native, its
    collect turns the same outputs' native fields into the same traces, bit for bit, with no
    worker call (every part from the outputs)."""
    import asyncio

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from moe_replay.integrations.vllm import AsyncVllmCapture

    async def final(engine, prompt, sp, rid):
        last = None
        async for o in engine.generate(prompt, sp, request_id=rid):
            last = o
        return last

    # FINAL_ONLY: a streamed n = 2 request's last yield may hold only the child that finished last
    from vllm.sampling_params import RequestOutputKind

    final_only = dict(output_kind=RequestOutputKind.FINAL_ONLY)

    async def run():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**capture_engine_kwargs(model=str(model_dir), **ENGINE)))
        try:
            hooks = await AsyncVllmCapture.attach(engine, CaptureConfig(source="auto"))
            assert hooks.plan.native == frozenset()
            outs = [await final(engine, PROMPTS[0], params(SEEDS[0], **final_only), "a0")]
            outs += await asyncio.gather(*(final(engine, p, params(s, n=2, **final_only), f"a{i + 1}")
                                           for i, (p, s) in enumerate(zip(PROMPTS[1:], SEEDS[1:]))))
            traces = await hooks.collect(outs)
            await hooks.uninstall()
            monkeypatch.setattr(native.EngineFlags, "of", classmethod(lambda cls, _cfg: ALL_FLAGS))
            nat = await AsyncVllmCapture.attach(engine, CaptureConfig(source="native"), reset_prefix_cache=False)
            assert nat._link is None and nat.via == "native"
            got = await nat.collect([as_native(o, g, nat.geometry) for o, g in zip(outs, grouped(outs, traces))])
            return outs, traces, got
        finally:
            engine.shutdown()

    outs, traces, got = asyncio.run(run())
    assert len(got) == len(traces) == 5 and [len(o.outputs) for o in outs] == [1, 2, 2] and any((o.num_cached_tokens or 0) >= BLOCK for o in outs[1:])
    for a, b in zip(got, traces):
        assert a.key == b.key
        same_trace(a, b)


# -- Model Runner V2 -------------------------------------------------------------------------------
@pytest.mark.mrv2
def test_the_runner_comes_from_vllm_and_capture_adds_no_native_flags(model_dir, monkeypatch, runner):
    """Which runner an engine runs is vLLM's choice (VllmConfig.use_v2_model_runner); capture's
    kwargs never switch native outputs on, on either runner (they would refuse untruncated and greedy
    requests). The V1 session has no Triton: VLLM_USE_V2_MODEL_RUNNER=1 is refused by vLLM ("Model
    Runner V2 requires Triton"), reported by name before any engine is built, and unset or 0 runs V1.
    The MRV2 session (its test bed: tests/runners.py) runs MRV2 unless VLLM_USE_V2_MODEL_RUNNER=0."""
    from vllm import envs

    from moe_replay.integrations.vllm.engine_kwargs import NATIVE_FLAGS, engine_runner

    cached = envs._is_envs_cache_enabled()  # a started engine caches vLLM's variables: read them afresh here
    envs.disable_envs_cache()
    try:
        if runner == "v1":
            monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
            with pytest.raises(CaptureHookError, match="Model Runner V2 requires Triton"):
                capture_engine_kwargs(model=str(model_dir), **ENGINE)
        for value, want in (("0", "v1"), (None, runner), ("1", "mrv2")):
            if value == "1" and runner == "v1":
                continue
            if value is None:
                monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
            else:
                monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
            assert engine_runner({"model": str(model_dir), **ENGINE}) == want, value
            kw = capture_engine_kwargs(model=str(model_dir), **ENGINE)
            assert not set(NATIVE_FLAGS) & set(kw)
    finally:
        monkeypatch.undo()
        if cached:
            envs.enable_envs_cache()


def test_release_check_names_what_a_release_lacks():
    """The surface table decides (integrations/vllm/surface/table.json): 0.33's MRV2 has what the hooks
    read; 0.26's has no `Sampler._sample_random` (the call the hooks wrap); 0.34 has no V1 runner."""
    from moe_replay.integrations.vllm.errors import VllmReleaseError
    from moe_replay.integrations.vllm.versions import check_release

    assert check_release("0.33.0", runner="mrv2") == "0.33.0"
    assert check_release("0.34.0", runner="mrv2") == "0.34.0"
    with pytest.raises(VllmReleaseError, match="_sample_random"):
        check_release("0.26.0", runner="mrv2")
    with pytest.raises(VllmReleaseError, match="gpu_model_runner"):
        check_release("0.34.0", runner="v1")
    with pytest.raises(VllmReleaseError, match="routed_experts"):
        check_release("0.26.0", runner="mrv2", parts=("routes",))


def _deltas(out, chunk: int = 3):
    """A final native RequestOutput as vLLM's DELTA streaming hands it over: each delta with its
    tokens, logprobs and mask rows; routes and the finish reason on the last one only."""
    import copy

    from vllm.outputs import SamplingMask

    n = max(len(c.token_ids) for c in out.outputs)
    parts = []
    for a in range(0, n, chunk):
        delta = copy.copy(out)
        delta.finished = a + chunk >= n
        delta.outputs = [dataclasses.replace(
            c, token_ids=list(c.token_ids[a:a + chunk]), logprobs=list(c.logprobs[a:a + chunk]),
            sampling_mask=SamplingMask([list(r) for r in c.sampling_mask.token_ids[a:a + chunk]]),
            routed_experts=c.routed_experts if a + chunk >= len(c.token_ids) else None,
            finish_reason=c.finish_reason if a + chunk >= len(c.token_ids) else None)
            for c in out.outputs if a < len(c.token_ids)]
        parts.append(delta)
    return parts


def test_mrv2_native_capture_through_vllms_own_delta_merge(hooks_run, native_capture, monkeypatch):
    """An engine on MRV2 streaming deltas: vLLM's own RequestOutput.add merges them (mask rows and
    logprobs concatenated, routes from the terminal delta), and capture on the MRV2 path (source
    'auto': every part native, no worker call) gives the hooks run's traces back bit for bit."""
    from moe_replay.integrations.vllm.capture import api

    monkeypatch.setattr(api, "runner_path", lambda _cfg: "mrv2")
    outs, traces = hooks_run
    cap = native_capture(CaptureConfig())
    assert cap.runner_path == "mrv2" and cap._link is None and cap.plan.hooks == frozenset()
    groups = grouped(outs, traces)
    merged = []
    for o, g in zip(outs, groups):
        first, *rest = _deltas(as_native(o, g, cap.geometry))
        assert first.outputs[0].routed_experts is None and len(rest) >= 2
        for d in rest:
            first.add(d, aggregate=True)
        merged.append(first)
    got = cap.collect(merged, sampling=sampling_of(outs, groups))
    assert len(got) == len(traces) == 7
    for a, b in zip(got, traces):
        same_trace(a, b)
