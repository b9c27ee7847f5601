"""Capture in vLLM's default compiled mode (enforce_eager=False: torch.compile on vLLM-CPU, the
stand-in for CUDA graphs' tracing constraints) against eager capture of the same run.

One compiled engine for the module (its start compiles the model: ~1-2 min on CPU), one eager
engine beside it; several checks share them.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from moe_replay.integrations.vllm import (  # noqa: E402
    CaptureConfig,
    CaptureHookError,
    CollectError,
    VllmCapture,
    capture_engine_kwargs,
)
from moe_replay.integrations.vllm.capture.route_hook import STEP_ROUTES_ATTR  # noqa: E402

from .test_vllm_capture import BLOCK, SAMPLING, check_against_hf, prompt_text, sampling_params, shutdown  # noqa: E402

BATCHED = 64  # prompts above it are prefilled in chunks


def _engine(model_dir, eager: bool):
    from vllm import LLM

    return LLM(**capture_engine_kwargs(
        model=str(model_dir), dtype="float32", enforce_eager=eager, max_model_len=512, max_num_seqs=8,
        max_num_batched_tokens=BATCHED, seed=0, distributed_executor_backend="uni", block_size=BLOCK))


def _runner(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


@pytest.fixture(scope="module")
def engines(tiny_model):
    model_dir = tiny_model("qwen3_moe")
    with contextlib.ExitStack() as stack:  # an engine made before a failure is shut down all the same
        compiled = _engine(model_dir, eager=False)
        stack.callback(shutdown, compiled)
        eager = _engine(model_dir, eager=True)
        stack.callback(shutdown, eager)
        yield compiled, eager, model_dir


def _run(llm, prompts, sps, config=None):
    """One capture run from an empty prefix cache with the torch RNG reseeded (in-process engine:
    both engines then draw the same tokens from the same logits)."""
    cap = VllmCapture(llm, config or CaptureConfig())
    try:
        llm.reset_prefix_cache()
        torch.manual_seed(11)
        _, traces = cap.generate(prompts, sps)
        outs, hit = cap.generate([prompts[1]], sampling_params(*SAMPLING[0], max_tokens=5))
        assert outs[0].num_cached_tokens >= BLOCK, "expected a prefix-cache hit"
        return traces + hit, cap.stats()
    finally:
        cap.uninstall()


def test_compiled_capture_equals_eager(engines):
    """enforce_eager=False: the routers' capture functions were bound at model load (before
    torch.compile traced the forward), and the traces equal eager capture of the same run: tokens,
    routes and support bit for bit, logprobs to float rounding, through chunked prefill, mixed
    sampling, n=2 and a prefix-cache hit; and they match HF's routing and the reference support."""
    compiled, eager, model_dir = engines
    assert getattr(_runner(compiled).model, STEP_ROUTES_ATTR, None) is not None
    assert getattr(_runner(eager).model, STEP_ROUTES_ATTR, None) is None  # eager: bound at install
    prompts = [prompt_text(n, seed=300 + n) for n in (6, 100, 35, 70)]
    sps = [sampling_params(*SAMPLING[i % len(SAMPLING)], n=2 if i == 2 else 1) for i in range(len(prompts))]
    got_c, st_c = _run(compiled, prompts, sps, CaptureConfig(flush_bytes=3000))  # flushes every few steps
    got_e, st_e = _run(eager, prompts, sps)
    assert st_c["route_mode"] == "load-time step buffer" and st_e["route_mode"] == "hold"
    # no hook before the step: the compiled forward writes exactly the step's rows, which the hook
    # after it re-arms (a padded forward would have left rows written: found at a flush, rearms > 0)
    assert st_c["route_arm_before"] is False and st_c["route_rearms"] == 0 and st_c["flushes"] > 2
    assert st_e["route_arm_before"] is False
    # the hooks time themselves (the step bracket does not time them): host time is counted
    assert st_c["hook_s"] > 0 and st_e["hook_s"] > 0
    assert len(got_c) == len(got_e) == len(prompts) + 2
    for a, b in zip(got_c, got_e, strict=True):
        assert a.key == b.key
        assert np.array_equal(a.token_ids_S, b.token_ids_S), a.key
        assert a.route_start == b.route_start and np.array_equal(a.routes_TLK, b.routes_TLK), a.key
        # Inductor fuses the forward's float ops, so the compiled logits differ from eager ones by
        # rounding (max 5e-6 nats seen here): each trace holds its own engine's logprobs.
        assert np.abs(a.logprobs_G - b.logprobs_G).max() < 1e-4, a.key
        assert all(np.array_equal(a.support.row(g), b.support.row(g)) for g in range(a.num_generated))
    check_against_hf(got_c[1], model_dir, SAMPLING[1])
    check_against_hf(got_c[-1], model_dir, SAMPLING[0])


def test_compiled_engine_refuses_capture_without_load_time_buffer(engines, monkeypatch):
    """A compiled forward whose routers got no capture function at load would report no routes:
    install refuses it by name instead of producing empty or zero routes."""
    compiled, _, _ = engines
    model = _runner(compiled).model
    monkeypatch.delitem(model.__dict__, STEP_ROUTES_ATTR)
    with pytest.raises(CaptureHookError, match="enforce_eager=False.*capture_engine_kwargs"):
        VllmCapture(compiled, CaptureConfig())


def test_unwritten_route_rows_are_an_error(engines, monkeypatch):
    """A layer that routes no rows into the step buffer leaves them at the sentinel: the requests of
    that step fail with an error naming the layer, never zero routes; the rest of capture goes on."""
    from moe_replay.integrations.vllm.capture import route_hook
    from moe_replay.integrations.vllm.model import find_moe_layers

    _, eager, _ = engines
    monkeypatch.setattr(route_hook, "HOLD_DEVICES", set())  # the step buffer, bound at install
    cap = VllmCapture(eager, CaptureConfig())
    try:
        assert cap.stats()["route_mode"] == "step buffer"
        router = find_moe_layers(_runner(eager).model)[1][1].router
        bound = router.capture_fn
        router.set_capture_fn(lambda ids: None)  # this layer stops writing
        try:
            outs = eager.generate([prompt_text(8, seed=1)], sampling_params(*SAMPLING[0], max_tokens=3),
                                  use_tqdm=False)
        finally:
            router.set_capture_fn(bound)
        with pytest.raises(CollectError) as ei:
            cap.collect(outs)
        msg = str(ei.value)
        assert "layers (id, rows) [(1, 0)] routed fewer than" in msg, msg
        _, (t,) = cap.generate([prompt_text(8, seed=2)], sampling_params(*SAMPLING[0], max_tokens=3))
        assert t.routes_TLK.shape[0] == t.num_tokens - 1
    finally:
        cap.uninstall()


def test_held_routes_of_a_silent_short_or_repeated_layer_are_an_error(engines):
    """Eager (hold) capture keeps each router's ids until the flush (each layer's list `append`s
    them). A layer that hands over nothing, fewer rows than the step scheduled, or ids twice in one
    forward fails that step's requests with an error naming the layer, never another step's ids
    or zeros; capture goes on after it."""
    from moe_replay.integrations.vllm.model import find_moe_layers

    _, eager, _ = engines
    cap = VllmCapture(eager, CaptureConfig())
    try:
        assert cap.stats()["route_mode"] == "hold"
        router = find_moe_layers(_runner(eager).model)[1][1].router
        bound = router.capture_fn
        sp = sampling_params(*SAMPLING[0], max_tokens=3)
        for fn, match in ((lambda ids: None, r"layers \(id, rows\) \[\(1, 0\)\] routed fewer than"),
                          (lambda ids: bound(ids[:1]), r"layers \(id, rows\) \[\(1, 1\)\] routed fewer than"),
                          (lambda ids: (bound(ids), bound(ids)), r"layers \(id, calls\) \[\(1, 2\)\] routed more than once")):
            router.set_capture_fn(fn)
            try:
                outs = eager.generate([prompt_text(8, seed=1)], sp, use_tqdm=False)
            finally:
                router.set_capture_fn(bound)
            with pytest.raises(CollectError, match=match):
                cap.collect(outs)
        _, (t,) = cap.generate([prompt_text(8, seed=2)], sp)
        assert t.routes_TLK.shape[0] == t.num_tokens - 1
    finally:
        cap.uninstall()


def test_step_buffer_written_between_steps_switches_to_arming_before(engines, monkeypatch):
    """A host step buffer is re-armed by the hook after each forward; rows a forward outside the
    engine's steps wrote (a dummy or padded forward) would hide a layer that stops routing, so the
    next flush finds them, re-arms the buffer and arms before every step from then on: the routes
    stay exact and a silent layer is still named."""
    from moe_replay.integrations.vllm.capture import route_hook
    from moe_replay.integrations.vllm.model import find_moe_layers

    _, eager, _ = engines
    monkeypatch.setattr(route_hook, "HOLD_DEVICES", set())  # a host step buffer, bound at install
    cap = VllmCapture(eager, CaptureConfig())
    try:
        routes = _runner(eager)._moe_replay.capture.routes
        assert routes.arm_before is False and routes.step.dirty_rows() == 0
        sp = sampling_params(*SAMPLING[0], max_tokens=3)
        _, (first,) = cap.generate([prompt_text(8, seed=1)], sp)
        routes.step.step_TLK[:40] = 0  # what a dummy forward of 40 rows would leave
        _, (again,) = cap.generate([prompt_text(8, seed=1)], sp)
        st = cap.stats()
        assert st["route_rearms"] == 1 and st["route_arm_before"] is True
        P = first.prompt_len  # the prompt's routes (the samples differ: the RNG moved on)
        assert np.array_equal(again.routes_TLK[:P], first.routes_TLK[:P])
        router = find_moe_layers(_runner(eager).model)[1][1].router
        bound = router.capture_fn
        router.set_capture_fn(lambda ids: None)  # this layer stops writing
        try:
            outs = eager.generate([prompt_text(8, seed=2)], sp, use_tqdm=False)
        finally:
            router.set_capture_fn(bound)
        with pytest.raises(CollectError, match=r"layers \(id, rows\) \[\(1, 0\)\] routed fewer than"):
            cap.collect(outs)
    finally:
        cap.uninstall()


def test_sample_outside_recorded_support_is_reported(engines, monkeypatch):
    """A sampler kernel that draws outside the set capture recorded (here: it returns the least
    likely token, whose logit the truncation set to -inf) is caught: counted in stats() and the
    request fails with an error naming the row, never a silent wrong support or -inf logprob."""
    _, eager, _ = engines
    tts = _runner(eager).sampler.topk_topp_sampler
    inner = tts.forward

    def off_support(logits, generators, k, p):
        _, extra = inner(logits, generators, k, p)
        return logits.argmin(dim=-1), extra

    monkeypatch.setattr(tts, "forward", off_support)  # under capture's wrapper
    cap = VllmCapture(eager, CaptureConfig())
    try:
        outs = eager.generate([prompt_text(8, seed=5)], sampling_params(1.0, -1, 0.5, 0.0, max_tokens=3),
                              use_tqdm=False)
        with pytest.raises(CollectError, match="outside its recorded sampling support"):
            cap.collect(outs)
        assert cap.stats()["support_misses"] == 3
    finally:
        cap.uninstall()


def test_timings_break_capture_down_by_part(engines):
    """VllmCapture.timings(): capture's host work by part on the compiled engine, each per-step
    part called once per engine step that forwarded tokens, flush and client parts present, all
    times >= 0 and bounded by the run; reset starts the count again."""
    import time

    compiled, _, _ = engines
    cap = VllmCapture(compiled, CaptureConfig())
    try:
        t0 = time.perf_counter()
        outs = compiled.generate([prompt_text(n, seed=40 + n) for n in (9, 30)],
                                 sampling_params(*SAMPLING[0], max_tokens=6), use_tqdm=False)
        cap.collect(outs)
        wall = time.perf_counter() - t0
        parts = cap.timings(reset=True)
        steps = cap.stats()["steps"]
        assert steps >= 6
        # one hook a step, in the sampler wrapper: it files the step and commits its samples
        assert parts["step.after_sample"]["calls"] == steps, (parts["step.after_sample"], steps)
        assert "step.after_forward" not in parts and "step.arm" not in parts  # re-armed in that same hook
        assert parts["step.support_stage"]["calls"] == steps
        for name in ("flush.window", "flush.route_read", "flush.route_records", "flush.kept_sets",
                     "flush.sample_records", "take.assemble", "client.rpc", "client.build"):
            assert parts[name]["calls"] >= 1, name
        assert "forward.route_hold" not in parts  # compiled: the route writes run inside the graph
        assert all(v["s"] >= 0 for v in parts.values()) and sum(v["s"] for v in parts.values()) < wall
        assert cap.timings() == {}  # reset, and nothing ran since
    finally:
        cap.uninstall()
