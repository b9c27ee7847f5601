"""Capture from a running SGLang server (the CPU test bed's launch_server on tiny qwen3_moe, one for the session):
the traces HF replays exactly, n > 1, radix-cache hits, multi-turn turns stored once as shared chunks, greedy,
and SGLang's refusals named. The client runs here (the project's venv, plain HTTP); SGLang in its own venv.
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_replay.integrations.sglang import SglangCapture, SglangRequestError, stitch
from moe_replay.store import DirectoryStore

from .sglang_bed.compare import compare_hf

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

PROMPTS = ["the cat route token model", "expert layer sample mixture alpha beta dog the cat"]
PARAMS = [dict(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=10, ignore_eos=True, n=2),
          dict(temperature=0.8, top_k=8, min_p=0.05, max_new_tokens=10, ignore_eos=True, n=2)]


@pytest.fixture(scope="module")
def cap(sglang_server):
    return SglangCapture(sglang_server.url)


def test_server_traces_replay_exactly_in_hf(cap, sglang_server, tmp_path):
    """n = 2 samples of two prompts (top-k with top-p; top-k with min-p), through a DirectoryStore, replayed in
    HF fp32: HF's router picks every recorded expert in order (0 flips), the logprobs over the recorded kept sets
    agree to the fp32 floor, and each kept set is the one SGLang's rule keeps over HF's logits."""
    assert cap.geometry.family == "qwen3_moe" and cap.engine_info.name == "sglang" and cap.engine_info.version == "0.5.23"
    with DirectoryStore(tmp_path / "s") as store:
        outputs, traces = cap.generate(PROMPTS, PARAMS, store=store)
    assert len(traces) == 4 and len({t.key for t in traces}) == 4
    assert [t.prompt_len for t in traces[:2]] == [traces[0].prompt_len] * 2  # each prompt's samples together
    with DirectoryStore(tmp_path / "s", readonly=True) as store:
        stored = store.get_many([t.key for t in traces])
    assert all(a.equals(b) for a, b in zip(stored, traces))
    t = stored[0]
    assert t.routes_TLK.dtype == np.uint8 and t.routes_TLK.shape == (t.num_tokens - 1, 2, 2)
    assert t.sampling.top_k == 20 and t.sampling.top_p == 0.9 and stored[2].sampling.min_p == 0.05
    got = compare_hf(sglang_server.model_dir, stored)
    print("sglang server vs hf:", got)
    assert got["flips"] == 0 and got["positions"] == sum(x.num_route_rows for x in stored) * 2
    assert got["max_abs_dlogprob"] <= 2e-5 and got["kept_sets_equal_hf"] and got["kept_rows"] == 40


def test_radix_cache_hit_returns_the_whole_prompts_routes(cap):
    """A prompt the radix cache holds: SGLang still returns every prompt position's routes, the same as uncached."""
    greedy = dict(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    first_out, (first,) = cap.generate(PROMPTS[1], greedy)
    again_out, (again,) = cap.generate(PROMPTS[1], greedy)
    assert again_out[0]["meta_info"]["cached_tokens"] >= first.prompt_len - 1
    assert np.array_equal(again.routes_TLK, first.routes_TLK) and np.array_equal(again.token_ids_S, first.token_ids_S)
    assert [first.support.row(g).tolist() for g in range(6)] == [[int(x)] for x in first.token_ids_S[first.prompt_len:]]
    assert np.all(first.logprobs_G == 0) and first.sampling.greedy


def test_multi_turn_routes_from_start_len_stitch_and_share_chunks(cap, tmp_path):
    """Turn 2 resends turn 1's tokens plus tool text and asks only for its new routes
    (`routed_experts_start_len` = turn 1's length - 1); stitch joins the turns into the routes a whole request
    returns, and a store keeps turn 1's routes once, as a chunk the stitched record names."""
    params = dict(temperature=1.0, top_k=16, max_new_tokens=8, ignore_eos=True)
    _, (t1,) = cap.generate(PROMPTS[0], params)
    turn2 = [*t1.token_ids_S.tolist(), 5, 6, 7, 8]
    _, (t2,) = cap.generate([turn2], params, route_start=t1.num_tokens - 1)
    assert t2.route_start == t1.num_tokens - 1 and t2.num_route_rows == len(turn2) + 8 - t1.num_tokens
    conv = stitch(t1, t2)
    assert conv.spans == ((t1.prompt_len, t1.num_tokens), (len(turn2), conv.num_tokens)) and conv.rerouted is None
    _, (whole,) = cap.generate([conv.token_ids_S[:-1].tolist()], dict(params, max_new_tokens=1))
    assert np.array_equal(whole.routes_TLK, conv.routes_TLK[: whole.num_route_rows])  # the same routes, whole
    with DirectoryStore(tmp_path / "s", chunk_min_bytes=1) as store:
        store.put(t1)
        store.put(conv)
        assert store.get(conv.key).equals(conv) and store.get(t1.key).equals(t1)
        shared = set(store.record_chunks(t1.key)) & set(store.record_chunks(conv.key))
    assert shared, "turn 1's routes are stored once, named by both records"


def test_sglang_refusals_are_named(cap, sglang_server):
    """SGLang's own refusal (kept sets need a finite top_k) and an unreachable server, each by name."""
    with pytest.raises(SglangRequestError, match="top_k"):
        cap.generate(PROMPTS[0], dict(temperature=1.0, max_new_tokens=2))
    with pytest.raises(SglangRequestError, match="could not be reached"):
        SglangCapture("http://127.0.0.1:9", model=sglang_server.model_dir)
