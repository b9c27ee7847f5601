"""The audit at the edges and on the ids themselves, on synthetic routings: no model, no engine.

A routing here is a table of expert scores per token id (so a token routes alike wherever it stands) plus noise
per position, top-k per layer; `concentrated` adds a bias per expert that picks most experts whatever the token
(as glm4_moe's sigmoid + correction bias with narrow router weights does: unrelated tokens' sets agree ~0.7).
The model's own routing is `FreeRoutes`; the given routes are that routing with a fault, read by the formats'
readers, judged by `diagnose` as `moe_replay.audit` judges them after its forward.

Each fault here passed or was misnamed before: the last rows filled by repeating the last kept row passed, a
zero-filled boundary row passed, a GRPO sibling's completion passed on a concentrated routing, uint8-wrapped
ids of a 512-expert model were OTHER_WEIGHTS, ids >= num_experts RANDOM or ALIGNED, a prompt shifted alone ROWS.
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_replay.audit import Cause, FreeRoutes, from_traces, from_vllm
from moe_replay.audit.diagnose import diagnose
from moe_replay.geometry import ModelGeometry
from moe_replay.trace import RolloutTrace

B, S, VOCAB = 16, 64, 512


def _geometry(experts: int, top_k: int, layers: int = 4) -> ModelGeometry:
    return ModelGeometry(num_layers=layers, moe_layer_ids=tuple(range(layers)), num_experts=experts, top_k=top_k,
                         vocab_size=VOCAB, family="synthetic")


def _routing(g: ModelGeometry, seed: int = 0, concentrated: float = 0.0):
    """route(tokens_S) -> own ids [S, L, K]: per-token scores + position noise (+ a bias per expert)."""
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(VOCAB, g.num_moe_layers, g.num_experts))
    bias = concentrated * np.sort(rng.normal(size=(g.num_moe_layers, g.num_experts)) * 3, -1)

    def route(tokens_S: np.ndarray, noise_seed: int) -> np.ndarray:
        noise = np.random.default_rng(noise_seed).normal(size=(len(tokens_S), g.num_moe_layers, g.num_experts)) * 0.5
        scores = table[tokens_S] + noise + bias
        return np.argsort(-scores, -1)[..., : g.top_k].astype(np.int64)

    return route


def _batch(g: ModelGeometry, seed: int = 0, concentrated: float = 0.0, prompt: int = S // 2):
    """(tokens per sample, the model's own ids per sample, FreeRoutes): GRPO pairs share their prompt."""
    rng = np.random.default_rng(seed + 1)
    route = _routing(g, seed, concentrated)
    prompts = [rng.integers(3, VOCAB, prompt) for _ in range(B // 2)]
    tokens = [np.concatenate([prompts[b // 2], rng.integers(3, VOCAB, S - prompt)]) for b in range(B)]
    own = [route(t, 100 + b // 2) for b, t in enumerate(tokens)]  # siblings: one prefill, equal prompt routes
    for b in range(1, B, 2):
        own[b][:prompt] = own[b - 1][:prompt]
    return tokens, own, FreeRoutes(g, tuple(own))


def _vllm(g, tokens, rows, prompt=None):
    kw = {} if prompt is None else {"prompt_len": prompt}
    return from_vllm([r.astype(np.int64) for r in rows], tokens, prompt_start=0, **kw)


def _near_ties(own, rate: float, g: ModelGeometry, seed: int = 5):
    """Own rows with `rate` of token-layers' last expert swapped for another (a bf16 engine's near-tie flips)."""
    rng = np.random.default_rng(seed)
    out = []
    for o in own:
        r = o[:-1].copy()
        flip = rng.random(r.shape[:2]) < rate
        for t, layer in zip(*np.nonzero(flip)):
            r[t, layer, -1] = next(e for e in rng.permutation(g.num_experts) if e not in r[t, layer])
        out.append(r)
    return out


@pytest.mark.parametrize("concentrated", [0.0, 1.0])
def test_correct_routes_with_near_ties_raise_no_alarm(concentrated):
    g = _geometry(16, 4)
    tokens, own, free = _batch(g, concentrated=concentrated)
    report = diagnose(_vllm(g, tokens, _near_ties(own, 0.04, g), prompt=S // 2), free)
    assert report.ok, report.summary()
    if concentrated:
        assert np.mean(report.chance) > 0.55  # unrelated tokens agree as glm4_moe's do


@pytest.mark.parametrize("dropped", [1, 2, 3, 8])
def test_last_rows_dropped_and_filled_by_repeating_the_last_kept_row_are_tail_rows(dropped):
    """the gap left by the last rows filled with the last kept row passed every window."""
    g = _geometry(16, 4)
    tokens, own, free = _batch(g)
    rows = [o[:-1].copy() for o in own]
    for r in rows:
        r[-dropped:] = r[-dropped - 1]
    report = diagnose(_vllm(g, tokens, rows), free)
    assert not report.ok, report.summary()
    assert report.verdict.cause is Cause.TAIL_ROWS and len(report.misaligned) == B
    ev = report.verdict.evidence
    assert ev.edge == "sequence_end" and ev.fill == "repeat" and ev.positions == tuple(range(S - 1 - dropped, S - 1))


@pytest.mark.parametrize("edge", ["sequence_end", "prompt_end"])
def test_a_zero_padded_boundary_row_is_tail_rows(edge):
    """prime-rl #1807: a boundary token's row left zero-padded (at the sequence's end, or the prompt's: a trace
    says where its prompt ends)."""
    g = _geometry(16, 4)
    tokens, own, free = _batch(g)
    at = S - 2 if edge == "sequence_end" else S // 2 - 1
    traces = []
    for b, (t, o) in enumerate(zip(tokens, own)):
        r = o[:-1].copy()
        r[at] = 0
        traces.append(RolloutTrace(f"t{b}", t, S // 2, g, routes_TLK=r))
    report = diagnose(from_traces(traces), free)
    assert not report.ok and report.verdict.cause is Cause.TAIL_ROWS, report.summary()
    assert report.verdict.evidence.edge == edge and report.verdict.evidence.positions == (at,)
    assert report.verdict.evidence.fill == "no_top_k"


def test_a_grpo_siblings_routes_are_caught_where_unrelated_tokens_agree_by_chance():
    """on a routing where a bias picks most experts (glm4_moe's sigmoid + bias, grouped top-k,
    narrow router weights) unrelated tokens' sets agree ~0.7, above the raw window bar of 0.6: a sample given its
    sibling's routes (equal prompt rows, the sibling's completion) passed. The bars stand on measured chance."""
    g = _geometry(16, 4)
    tokens, own, free = _batch(g, concentrated=1.0)
    rows = [own[b ^ 1][:-1].copy() if b % 4 == 0 else own[b][:-1].copy() for b in range(B)]
    report = diagnose(_vllm(g, tokens, rows, prompt=S // 2), free)
    assert not report.ok, report.summary()
    assert {s.index for s in report.misaligned} == set(range(0, B, 4))
    assert report.verdict.cause is Cause.OTHER_SAMPLE
    assert all(s.verdict.evidence.sample == s.index ^ 1 for s in report.misaligned)


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_ids_wrapped_through_a_byte_on_a_512_expert_model_are_named(dtype):
    """prime-rl #3051: every id below 256 on a 512-expert model was "another model"."""
    g = _geometry(512, 8)
    tokens, own, free = _batch(g)
    rows = [o[:-1].astype(np.uint8).astype(np.int64) if dtype == "uint8" else o[:-1].astype(np.int8).astype(np.int64)
            for o in own]
    report = diagnose(_vllm(g, tokens, rows), free)
    assert not report.ok and report.verdict.cause is Cause.WRAPPED_IDS, report.summary()
    ev = report.verdict.evidence
    assert ev.dtype == dtype and ev.num_experts == 512 and ev.agreement_wrapped > 0.95  # (e, e + 256 both picked: one)
    assert ev.agreement < 0.8 and ev.model_ids_above > 0.3


def test_correct_routes_of_a_512_expert_model_are_not_wrapped():
    g = _geometry(512, 8)
    tokens, own, free = _batch(g)
    assert diagnose(_vllm(g, tokens, [o[:-1] for o in own]), free).ok


@pytest.mark.parametrize("how", ["physical", "sentinel", "garbage"])
def test_ids_out_of_range_are_named(how):
    """ids >= num_experts were RANDOM (or passed, a few of them): EPLB physical ids (replicas
    numbered from E on), a -1 sentinel mid-sequence, or ids drawn over twice the range."""
    g = _geometry(16, 4)
    tokens, own, free = _batch(g)
    rng = np.random.default_rng(3)
    rows = []
    for o in own:
        r = o[:-1].copy()
        if how == "physical":
            r[1::2] = np.where(r[1::2] < 4, r[1::2] + 16, r[1::2])
        elif how == "sentinel":
            r[20, 1, 0] = -1
        else:
            r = rng.integers(0, 32, r.shape)
        rows.append(r)
    report = diagnose(_vllm(g, tokens, rows), free)
    assert not report.ok and report.verdict.cause is Cause.OUT_OF_RANGE, report.summary()
    ev = report.verdict.evidence
    assert ev.out_of_range > 0 and (ev.max_id >= 16 or ev.min_id < 0)
    if how == "sentinel":
        assert ev.first == (20, 1) and ev.out_of_range == 1


@pytest.mark.parametrize("shift", [1, -1])
@pytest.mark.parametrize("fmt", ["trace", "vllm"])
def test_a_shift_over_the_prompt_only_is_prompt_shift(shift, fmt):
    """the prompt's rows one position off, the completion's in place, were ROWS."""
    g = _geometry(16, 4)
    tokens, own, free = _batch(g)
    p = S // 2
    rows = []
    for o in own:
        r = o[:-1]
        head = np.concatenate([r[1:p], r[p - 1: p]]) if shift == 1 else np.concatenate([r[:1], r[: p - 1]])
        rows.append(np.concatenate([head, r[p:]]))
    if fmt == "trace":
        batch = from_traces([RolloutTrace(f"t{b}", t, p, g, routes_TLK=r) for b, (t, r) in enumerate(zip(tokens, rows))])
    else:
        batch = _vllm(g, tokens, rows, prompt=p)
    report = diagnose(batch, free)
    assert not report.ok and report.verdict.cause is Cause.PROMPT_SHIFT, report.summary()
    ev = report.verdict.evidence
    assert ev.shift == shift and ev.prompt_len == p and ev.agreement >= 0.9 > ev.agreement_unshifted
    assert ev.agreement_completion == pytest.approx(1.0)
    # without the prompt's length the audit sees rows out of step, as before
    assert diagnose(_vllm(g, tokens, rows), free).verdict.cause is Cause.ROWS
