"""collect() still refuses every bad trace, by name, now that it validates its traces together.

The client half of capture (records as the worker sends them -> traces) on hand-made records, no
engine: a batch with a repeated expert id in one record's row, an unsorted kept set in another, an
expert id out of range and a token that disagrees with the output must fail exactly those
requests (CollectError, each with the error its own validate() raises) and return the others,
equal to the traces built one at a time. The real-engine path is in test_vllm_capture.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from moe_replay.capture_config import CaptureConfig
from moe_replay.errors import ExpertIdOutOfRangeError, TraceFormatError
from moe_replay.geometry import EngineInfo, ModelGeometry
from moe_replay.integrations.vllm.capture.api import _CaptureBase
from moe_replay.integrations.vllm.capture.assemble import build_trace
from moe_replay.integrations.vllm.errors import CaptureAlignmentError, CollectError
from moe_replay.integrations.vllm.timings import PartTimes
from moe_replay.integrations.vllm.wire import CaptureRecord

GEOMETRY = ModelGeometry(num_layers=3, moe_layer_ids=(0, 2), num_experts=8, top_k=3, vocab_size=64, family="tiny")


def _client() -> _CaptureBase:
    cap = _CaptureBase()
    cap.config = cap._hooks_config = CaptureConfig()
    cap.times, cap.geometry, cap.engine_info = PartTimes(), GEOMETRY, EngineInfo(name="vllm")
    cap.plan, cap.engine_adjusted = SimpleNamespace(native=()), ()
    return cap


def _request(rng: np.random.Generator, rid: str):
    """A finished output and its worker record (as to_dict sends it), consistent with each other."""
    P, G = int(rng.integers(2, 9)), int(rng.integers(1, 12))
    sizes = rng.integers(2, 6, G)
    rows = [np.sort(rng.choice(GEOMETRY.vocab_size, int(k), replace=False)) for k in sizes]
    gen = [int(r[rng.integers(len(r))]) for r in rows]
    prompt = rng.integers(0, GEOMETRY.vocab_size, P).tolist()
    T = P + G - 1
    routes = np.argsort(rng.random((T + 2, 2, GEOMETRY.num_experts)), axis=-1)[..., :3].astype(np.uint8)  # 2 rows past the end
    record = CaptureRecord(
        "ok", key=rid, req_id=rid, prompt_len=P, route_start=0, routes_TLK=routes, routes_filled_T=np.ones(T + 2, bool),
        tokens_G=np.array(gen, np.int64), logprobs_G=rng.normal(size=G).astype(np.float32),
        support_sizes_G=sizes.astype(np.int64), support_offsets_G1=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        support_ids_N=np.concatenate(rows).astype(np.int32))
    comp = SimpleNamespace(index=0, token_ids=gen, finish_reason="length")
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, outputs=[comp]), record


def _break(record: CaptureRecord, how: str) -> None:
    if how == "repeat":
        record.routes_TLK[1, 1, 2] = record.routes_TLK[1, 1, 0]
    elif how == "unsorted":
        g = int(np.argmax(record.support_sizes_G))
        a = record.support_offsets_G1[g]
        record.support_ids_N[a + 1] = record.support_ids_N[a]
    elif how == "expert":
        record.routes_TLK[0, 0, 1] = GEOMETRY.num_experts
    elif how == "token":
        record.tokens_G[0] = (record.tokens_G[0] + 1) % GEOMETRY.vocab_size


@pytest.mark.parametrize("seed", range(4))
def test_collect_refuses_each_bad_record_and_keeps_the_rest(seed):
    rng = np.random.default_rng(seed)
    outs, records = zip(*[_request(rng, f"req-{i}") for i in range(8)])
    broken = {"req-1": "repeat", "req-4": "unsorted", "req-5": "expert", "req-6": "token"}
    for i, rid in enumerate(r.request_id for r in outs):
        if rid in broken:
            _break(records[i], broken[rid])
    cap = _client()
    items, missing = cap._requests(outs)
    with pytest.raises(CollectError) as ei:
        cap._assemble(items, [r.to_dict() for r in records], None, None, None, missing)
    err = ei.value
    assert sorted(err.failures) == sorted(broken)
    f = err.failures
    assert isinstance(f["req-1"], TraceFormatError) and "routes_TLK[1, 1]" in str(f["req-1"]) and "distinct" in str(f["req-1"])
    assert isinstance(f["req-4"], TraceFormatError) and "strictly increasing" in str(f["req-4"])
    assert isinstance(f["req-5"], ExpertIdOutOfRangeError) and "routes_TLK[0, 0, 1]" in str(f["req-5"])
    assert isinstance(f["req-6"], CaptureAlignmentError) and "generated token 0" in str(f["req-6"])
    one_by_one = {}
    for (key, _, comp, out), rec in zip(items, records):
        try:
            one_by_one[key] = build_trace(key, out.prompt_token_ids, comp, rec, GEOMETRY, cap._hooks_config, cap.engine_info)
        except Exception as e:
            assert (type(e), str(e)) == (type(f[key]), str(f[key]))
    assert [t.key for t in err.traces] == [k for k in one_by_one]
    for t in err.traces:
        one_by_one[t.key].weights_version = t.weights_version
        assert t.equals(one_by_one[t.key])


def test_collect_of_good_records_equals_traces_built_one_at_a_time():
    rng = np.random.default_rng(11)
    outs, records = zip(*[_request(rng, f"r{i}") for i in range(5)])
    cap = _client()
    items, missing = cap._requests(outs)
    traces = cap._assemble(items, [r.to_dict() for r in records], None, None, None, missing)
    for t, (key, _, comp, out), rec in zip(traces, items, records):
        want = build_trace(key, out.prompt_token_ids, comp, rec, GEOMETRY, cap._hooks_config, cap.engine_info)
        assert t.equals(want) and t.routes_TLK.shape == (len(t.token_ids_S) - 1, 2, 3)
