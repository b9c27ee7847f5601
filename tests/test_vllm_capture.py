"""vLLM capture against the real CPU engine and HF's own routing, on tiny local MoE models.

What each test proves is in its docstring. Engines are module-scoped (one per family / config);
the in-process engine needs the env vars below set before vLLM is imported.
"""

from __future__ import annotations

import gc
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.mrv2]

from moe_replay.integrations.vllm import (  # noqa: E402
    CaptureConfig,
    CollectError,
    RequestAbortedError,
    SupportOverflowError,
    UnknownRequestError,
    VllmCapture,
    capture_engine_kwargs,
)
from moe_replay.models import build_tiny_model  # noqa: E402

from .runners import RUNNER  # noqa: E402

FAMILIES = ["qwen3_moe", "mixtral", "olmoe"] if RUNNER == "v1" else ["qwen3_moe", "olmoe"]
"""Three families on the V1 runner; two under Model Runner V2 (its session runs Triton's interpreter:
~0.5 s a decode step), two router rules all the same (qwen3_moe renormalises its top-k, olmoe does not)."""
BATCHED = 64  # max_num_batched_tokens: prompts longer than this are prefilled in chunks
BLOCK = 32  # KV block size (the smallest vLLM-CPU attention accepts): prefix hits need > 32 tokens

WORDS = "the cat route token model expert layer sample mixture alpha beta dog".split()


def prompt_text(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, n_words))


def make_engine(model_dir, **overrides):
    from vllm import LLM

    kwargs = dict(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8,
                  max_num_batched_tokens=BATCHED, seed=0, distributed_executor_backend="uni", block_size=BLOCK)
    kwargs.update(overrides)
    return LLM(**capture_engine_kwargs(**kwargs))


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {f: build_tiny_model(f, root / f, seed=0) for f in FAMILIES}


# Capture batches steps and flushes when a staging buffer would overflow (or at collect). A zero
# budget leaves room for exactly one step, so that family flushes on every step: both paths run.
FLUSH_BYTES = {"qwen3_moe": CaptureConfig().flush_bytes, "mixtral": 0, "olmoe": 3000}


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, model_dirs):
    family = request.param
    llm = make_engine(model_dirs[family])
    try:  # the engine is shut down even when capture fails to install
        cap = VllmCapture(llm, CaptureConfig(flush_bytes=FLUSH_BYTES[family]))
        try:
            yield family, llm, cap, model_dirs[family]
        finally:
            cap.uninstall()
    finally:
        shutdown(llm)


# -- HF references ---------------------------------------------------------------------------
_HF: dict = {}


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    key = str(model_dir)
    if key not in _HF:
        _HF.clear()
        _HF[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
    return _HF[key]


def hf_forward(model_dir, tokens_S):
    """HF fp32 routes [S-1, L, K] (its own sorted top-k) and logits [S-1, V] of tokens_S[:-1]."""
    model = hf_model(model_dir)
    got = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: got.__setitem__(i, out[2]))
             for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            logits = model(torch.as_tensor(tokens_S[:-1], dtype=torch.long)[None]).logits[0]
    finally:
        for h in hooks:
            h.remove()
    routes = np.stack([got[i].numpy() for i in sorted(got)], axis=1)
    return routes, logits.double()


def reference_support(logits_GV: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    """Kept sets per row, written from the definitions (float64), not from vLLM's code."""
    rows = []
    for row in logits_GV:
        if temperature == 0:
            rows.append(np.array([int(row.argmax())]))
            continue
        x = row / temperature
        keep = torch.ones_like(x, dtype=torch.bool)
        if min_p > 0:
            p = x.softmax(-1)
            keep &= p >= min_p * p.max()
        if top_k > 0:
            keep &= x >= x.topk(top_k).values[-1]
        if top_p < 1:
            xm = x.masked_fill(~keep, -float("inf"))
            p = xm.softmax(-1)
            order = p.argsort(descending=True)
            mass_before = p[order].cumsum(0) - p[order]
            kept_sorted = mass_before < top_p
            kept_sorted[0] = True
            k2 = torch.zeros_like(keep)
            k2[order[kept_sorted]] = True
            keep &= k2
        rows.append(np.flatnonzero(keep.numpy()))
    return rows


TIE = 1e-4
"""Relative probability gap under which two tokens count as tied at a top-p cut (float32 has ~7 digits)."""


def near_tie_extension(got: np.ndarray, ref: np.ndarray, logits_V: torch.Tensor, temperature: float) -> np.ndarray:
    """Where the engine truncates with vLLM's Triton top-k/top-p kernel (Model Runner V2 here, and every
    GPU vLLM), a top-p cut keeps a token's near-ties with it (the kernel selects by a probability
    threshold; sort-and-cut, the definition, breaks the tie by order): measured on tiny qwen3_moe, two
    tokens 3e-7 apart in probability (4e-5 relative) kept together. The captured set is what the
    sampler drew from, so it is the truth; this accepts it as `ref` plus tokens tied with ref's least
    probable one (TIE), and nothing else."""
    p = (logits_V.double() / temperature).softmax(-1)
    extra = np.setdiff1d(got, ref)
    if np.setdiff1d(ref, got).size or not extra.size:
        return ref
    cut = float(p[ref].min())
    if all(abs(float(p[t]) - cut) <= TIE * cut for t in extra):
        return got
    return ref


SAMPLING = [  # (temperature, top_k, top_p, min_p): every truncation vLLM applies, greedy and none at all
    (1.0, -1, 0.9, 0.0),  # top-p alone: verl's and TRL's default rollout sampling (top-k off)
    (0.7, 5, 1.0, 0.0),
    (1.3, -1, 1.0, 0.05),
    (0.8, 20, 0.8, 0.0),
    (0.0, -1, 1.0, 0.0),  # greedy: the kept set is {argmax}
    (1.0, -1, 1.0, 0.0),  # untruncated: the kept set is the whole vocabulary
]


def sampling_params(t, k, p, mp, max_tokens=10, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp, max_tokens=max_tokens, ignore_eos=True, **kw)


def check_against_hf(trace, model_dir, params, *, order_stats=None):
    routes_hf, logits = hf_forward(model_dir, trace.token_ids_S)
    routes_hf = routes_hf[trace.route_start :]
    assert trace.routes_TLK.shape == routes_hf.shape
    same_set = np.array_equal(np.sort(trace.routes_TLK, -1), np.sort(routes_hf, -1).astype(trace.routes_TLK.dtype))
    assert same_set, f"{trace.key}: routes differ from HF as sets"
    if order_stats is not None:
        order_stats.append(float((trace.routes_TLK == routes_hf).all(-1).mean()))
    P, G = trace.prompt_len, trace.num_generated
    gen_logits = logits[P - 1 : P - 1 + G]
    ref = reference_support(gen_logits, *params)
    for g in range(G):
        if RUNNER == "mrv2" and not np.array_equal(trace.support.kept(g, trace.geometry.vocab_size), ref[g]):
            ref[g] = near_tie_extension(trace.support.kept(g, trace.geometry.vocab_size), ref[g], gen_logits[g], params[0])
        assert np.array_equal(trace.support.kept(g, trace.geometry.vocab_size), ref[g]), f"{trace.key}: support row {g} differs"
        assert trace.token_ids_S[P + g] in ref[g]
    t = params[0]
    for g in range(G):
        tok = trace.token_ids_S[P + g]
        want = 0.0 if t == 0 else float((gen_logits[g][ref[g]] / t).log_softmax(-1)[np.searchsorted(ref[g], tok)])
        assert abs(trace.logprobs_G[g] - want) < 1e-4, f"{trace.key}: logprob {g}: {trace.logprobs_G[g]} vs {want}"


# -- tests -------------------------------------------------------------------------------------
def test_routes_support_logprobs_match_hf(engine):
    """Routes equal HF's routing as sets on 100% of token-layers, sampling support equals the
    kept set recomputed from HF logits for every truncation (top-p, top-k, min-p, both, greedy),
    logprobs agree; 8 concurrent requests of mixed lengths, some chunk-prefilled (> 64 tokens)."""
    family, llm, cap, model_dir = engine
    prompts, params, sps = [], [], []
    for i in range(8):
        prm = SAMPLING[i % len(SAMPLING)]
        prompts.append(prompt_text([3, 9, 40, 110, 6, 25, 70, 14][i], seed=i))
        params.append(prm)
        sps.append(sampling_params(*prm))
    flushes = cap.stats()["flushes"]
    outputs, traces = cap.generate(prompts, sps)
    steps_flushed = cap.stats()["flushes"] - flushes
    assert steps_flushed >= (5 if FLUSH_BYTES[family] < 4096 else 1), steps_flushed
    assert [t.key for t in traces] == [o.request_id for o in outputs]
    assert max(len(o.prompt_token_ids) for o in outputs) > BATCHED  # chunked prefill happened
    order = []
    for trace, prm in zip(traces, params):
        check_against_hf(trace, model_dir, prm, order_stats=order)
        assert trace.engine.name == "vllm" and trace.engine.dtype == "float32"
    # vLLM-CPU picks top-k with torch.topk(sorted=False), HF with sorted top-k. We record the
    # engine's order; on these models with K=2 the two orders were observed to agree everywhere.
    print(f"[{family}] column order equal to HF on {np.mean(order):.4f} of token-layers")


def test_prefix_cache_hit_gets_full_routes(engine):
    """Same prompt twice: the second request hits the prefix cache (cached tokens not forwarded)
    yet gets identical, complete routes, equal to HF."""
    family, llm, cap, model_dir = engine
    prompt = prompt_text(60, seed=100)
    sp = sampling_params(*SAMPLING[0], max_tokens=6)
    (o1,), (t1,) = cap.generate([prompt], sp)
    (o2,), (t2,) = cap.generate([prompt], sp)
    assert o2.num_cached_tokens >= BLOCK, "expected a prefix-cache hit"
    n = min(t1.num_tokens, t2.num_tokens) - 1
    assert np.array_equal(t1.routes_TLK[: len(o1.prompt_token_ids)], t2.routes_TLK[: len(o2.prompt_token_ids)])
    assert n > 0
    check_against_hf(t2, model_dir, SAMPLING[0])
    # Both requests inside one flush window: the hit reads slots written earlier in the same window.
    other = prompt_text(60, seed=101)
    o3 = llm.generate([other], sp, use_tqdm=False)
    o4 = llm.generate([other], sp, use_tqdm=False)
    assert o4[0].num_cached_tokens >= BLOCK, "expected a prefix-cache hit"
    t3, t4 = cap.collect(o3 + o4)
    P = len(o3[0].prompt_token_ids)
    assert np.array_equal(t3.routes_TLK[:P], t4.routes_TLK[:P])
    check_against_hf(t4, model_dir, SAMPLING[0])


def test_take_lays_records_out_as_the_per_token_reference(engine):
    """The row log lays a real engine's records out (all taken together, array ops) exactly as the
    per-token reference does from the rows the flushes handed it (tests/capture_reference.py):
    chunked prefill, n = 2, a prefix-cache hit, one flush per step (mixtral), every few (olmoe),
    one per collect (qwen3_moe); every array bit for bit, no problem, no row left behind."""
    from moe_replay.integrations.vllm.capture import records
    from tests.capture_reference import RowLogSpy, assert_record_equals, reference_record

    family, llm, cap, model_dir = engine
    wc = llm.llm_engine.model_executor.driver_worker.worker.model_runner._moe_replay.capture
    first_uid = next(records._UIDS) + 1
    spy = RowLogSpy(wc.book.log)
    try:
        prompts = [prompt_text(n, seed=300 + n) for n in (90, 12, 40)]
        llm.generate(prompts, sampling_params(*SAMPLING[0], max_tokens=10, n=2), use_tqdm=False)
        (hit,) = llm.generate(prompts[:1], sampling_params(*SAMPLING[1], max_tokens=10), use_tqdm=False)
        assert hit.num_cached_tokens >= BLOCK
        mine = {rid: r for rid, r in (*wc.book.finished.items(), *wc.book.live.items()) if r.uid >= first_uid}
        assert len(mine) == 7
        got = wc.take(list(mine))  # flushes first: the spy has every row after it
        for (rid, rec), payload in zip(mine.items(), got):
            want = reference_record(spy.history, rec.uid, rec.route_start, rec.L, rec.K, rec.route_dtype)
            assert payload.status == "ok" and payload.problems == want["problems"] == []
            assert_record_equals(payload, want, rid)
            assert len(payload.tokens_G) == 10 and payload.routes_filled_T.all()
        assert not any((b.cols["uid"] >= first_uid).any() for b in wc.book.log.route_blocks + wc.book.log.sample_blocks)
    finally:
        spy.undo()


def test_n_samples_each_get_a_trace(engine):
    """n > 1: one trace per sample, keyed '<id>#<i>', each consistent with HF."""
    family, llm, cap, model_dir = engine
    if family != "qwen3_moe":
        pytest.skip("family-independent; run once")
    (out,), traces = cap.generate([prompt_text(20, seed=7)], sampling_params(*SAMPLING[0], n=3))
    assert [t.key for t in traces] == [f"{out.request_id}#{i}" for i in range(3)]
    assert len({t.token_ids_S.tobytes() for t in traces}) > 1
    for t in traces:
        check_against_hf(t, model_dir, SAMPLING[0])
    from moe_replay.store import MemoryStore  # the samples share one prefill: a store keeps its routes once (#48)

    store = MemoryStore(chunk_min_bytes=1)
    store.put_many(traces)
    prompt = {k for k in store._chunks if k.startswith(f"\x000:{traces[0].prompt_len}:")}
    assert len(prompt) == 1 and all(store.get(t.key).equals(t) for t in traces)


def test_errors_abort_unknown_and_nothing_lost(engine):
    """An aborted request and an unknown (already collected) one raise typed errors naming the
    request, while the good request of the same batch still yields its trace."""
    family, llm, cap, model_dir = engine
    if family != "qwen3_moe":
        pytest.skip("family-independent; run once")
    good, (tg,) = cap.generate([prompt_text(8, seed=3)], sampling_params(*SAMPLING[0]))
    eng = llm.llm_engine
    eng.add_request("to-abort", prompt_text(8, seed=4), sampling_params(*SAMPLING[0], max_tokens=50))
    eng.add_request("fine", prompt_text(8, seed=5), sampling_params(*SAMPLING[0], max_tokens=4))
    done = {}
    for _ in range(3):
        for o in eng.step():
            done[o.request_id] = o
    eng.abort_request(["to-abort"])
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o
    aborted = _aborted_output(done, "to-abort")
    batch = [done["fine"], aborted, good[0]]  # good[0] was collected already: unknown now
    with pytest.raises(CollectError) as ei:
        cap.collect(batch)
    err = ei.value
    assert [t.key for t in err.traces] == ["fine"]
    assert isinstance(err.failures["to-abort"], RequestAbortedError)
    assert isinstance(err.failures[good[0].request_id], UnknownRequestError)
    assert "no capture record" in str(err.failures[good[0].request_id])
    cap.discard(["to-abort"])


def _aborted_output(done, rid):
    """The final output of an aborted request; vLLM may or may not emit one, so build its twin."""
    if rid in done and done[rid].finished:
        return done[rid]
    from vllm.outputs import CompletionOutput, RequestOutput

    comp = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                            finish_reason="abort")
    return RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[0, 1], prompt_logprobs=None,
                         outputs=[comp], finished=True)


def test_each_part_alone(engine):
    """Routes only, or support + logprobs only: each part alone is captured completely (the last
    forwarded position included) and equals the HF references; the other part is absent."""
    family, llm, cap, model_dir = engine
    if family != "qwen3_moe":
        pytest.skip("family-independent; run once")
    cap.uninstall()
    prm = SAMPLING[0]
    try:
        for cfg in (CaptureConfig(support=False, logprobs=False), CaptureConfig(routes=False)):
            part = VllmCapture(llm, cfg)
            try:
                outs = llm.generate([prompt_text(12, 3), prompt_text(30, 4)], sampling_params(*prm, max_tokens=7),
                                    use_tqdm=False)
                for t in part.collect(outs):
                    routes_hf, logits = hf_forward(model_dir, t.token_ids_S)
                    if cfg.routes:
                        assert t.support is None
                        assert t.routes_TLK.shape == routes_hf.shape
                        assert np.array_equal(np.sort(t.routes_TLK, -1), np.sort(routes_hf, -1))
                    else:
                        assert t.routes_TLK is None
                        P, G = t.prompt_len, t.num_generated
                        ref = reference_support(logits[P - 1 : P - 1 + G], *prm)
                        assert all(np.array_equal(t.support.kept(g, t.geometry.vocab_size), ref[g]) for g in range(G))
            finally:
                part.uninstall()
    finally:
        engine_cap = VllmCapture(llm, CaptureConfig())
        cap.__dict__.update(engine_cap.__dict__)


def test_support_overflow_policies(engine):
    """Support rows above max_support: 'error' raises SupportOverflowError for that request only;
    'omit' returns the trace with support=None and says which row overflowed. Never truncated. A row
    that keeps the whole vocabulary (untruncated sampling) never overflows: it is kept whole."""
    family, llm, cap, model_dir = engine
    if family != "qwen3_moe":
        pytest.skip("family-independent; run once")
    cap.uninstall()
    try:
        for policy in ("error", "omit"):
            small = VllmCapture(llm, CaptureConfig(max_support=8, on_support_overflow=policy))
            try:
                wide = sampling_params(2.0, -1, 0.99, 0.0, max_tokens=3)  # most of the vocabulary, not all of it
                greedy = sampling_params(0.0, -1, 1.0, 0.0, max_tokens=3)
                full = sampling_params(1.0, -1, 1.0, 0.0, max_tokens=3)  # the whole vocabulary kept
                outs = llm.generate([prompt_text(5, 1), prompt_text(5, 2), prompt_text(5, 3)], [wide, greedy, full])
                if policy == "error":
                    with pytest.raises(CollectError) as ei:
                        small.collect(outs)
                    assert isinstance(ei.value.failures[outs[0].request_id], SupportOverflowError)
                    assert "max_support=8" in str(ei.value.failures[outs[0].request_id])
                    assert [t.key for t in ei.value.traces] == [outs[1].request_id, outs[2].request_id]
                    t_full = ei.value.traces[1]
                else:
                    t_wide, t_greedy, t_full = small.collect(outs)
                    assert t_wide.support is None and 8 < t_wide.extra["support_omitted"]["size"] < 512
                    assert t_greedy.support is not None and t_wide.routes_TLK is not None
                assert t_full.support.whole_flags().all() and len(t_full.support.ids_N) == 0
            finally:
                small.uninstall()
    finally:
        engine_cap = VllmCapture(llm, CaptureConfig())
        cap.__dict__.update(engine_cap.__dict__)


@pytest.mark.parametrize("flush_bytes", [CaptureConfig().flush_bytes, 0] if RUNNER == "v1" else [0])
def test_preemption_keeps_traces_exact(model_dirs, flush_bytes):
    """A KV cache too small for the batch forces the scheduler to preempt and recompute requests;
    every trace still equals HF's routing and the reference support, whether the recomputed rows
    land in the same flush as the first computation or in a later one."""
    model_dir = model_dirs["qwen3_moe"]
    llm = make_engine(model_dir, num_gpu_blocks_override=12, max_num_seqs=6, max_model_len=256)
    try:
        cap = VllmCapture(llm, CaptureConfig(flush_bytes=flush_bytes))
        prm = SAMPLING[0]
        prompts = [prompt_text(30 + 3 * i, seed=50 + i) for i in range(6)]
        outputs, traces = cap.generate(prompts, sampling_params(*prm, max_tokens=40))
        assert cap.stats()["preemptions"] > 0, "the small KV cache should have forced preemption"
        for t in traces:
            check_against_hf(t, model_dir, prm)
    finally:
        shutdown(llm)


def test_device_runner_path_on_cpu(engine, monkeypatch):
    """The path a GPU runner takes (routes copied into a device arena, positions and KV slots derived
    from the host mirrors instead of read from host buffers), run on the CPU engine: for the same
    sampled tokens (torch RNG reseeded) every trace equals the host path's, bit for bit, through
    chunked prefill, mixed sampling and a prefix-cache hit; and it matches HF."""
    from moe_replay.integrations.vllm.capture import route_hook
    from moe_replay.integrations.vllm.runners import v1

    family, llm, cap, model_dir = engine
    if family != "qwen3_moe":
        pytest.skip("family-independent; run once")
    if RUNNER != "v1":
        pytest.skip("the V1 runner's two layout paths; Model Runner V2 has one (runners/mrv2.py), derived from the host")
    prompts = [prompt_text(n, seed=200 + n) for n in (5, 90, 30, 60)]
    sps = [sampling_params(*SAMPLING[i % len(SAMPLING)]) for i in range(len(prompts))]
    repeat = sampling_params(*SAMPLING[0], max_tokens=6)

    def run(c):
        llm.reset_prefix_cache()
        torch.manual_seed(7)
        _, traces = c.generate(prompts, sps)
        outs, (hit,) = c.generate([prompts[3]], repeat)  # prompt blocks cached by the first call
        assert outs[0].num_cached_tokens >= BLOCK
        return traces + [hit]

    host = run(cap)
    cap.uninstall()
    monkeypatch.setattr(route_hook, "HOLD_DEVICES", set())
    monkeypatch.setattr(v1, "HOST_MIRROR_DEVICES", set())
    try:
        dev = VllmCapture(llm, CaptureConfig(flush_bytes=3000))  # and flushes every few steps
        try:
            assert not llm.llm_engine.model_executor.driver_worker.worker.model_runner._moe_replay.capture.routes.hold
            derived = run(dev)
        finally:
            dev.uninstall()
    finally:
        monkeypatch.undo()
        engine_cap = VllmCapture(llm, CaptureConfig())
        cap.__dict__.update(engine_cap.__dict__)
    for a, b in zip(host, derived, strict=True):
        assert np.array_equal(a.token_ids_S, b.token_ids_S) and np.array_equal(a.routes_TLK, b.routes_TLK)
        assert np.array_equal(a.logprobs_G, b.logprobs_G)
        assert all(np.array_equal(a.support.row(g), b.support.row(g)) for g in range(a.num_generated))
    check_against_hf(derived[-1], model_dir, SAMPLING[0])
