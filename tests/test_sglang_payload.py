"""SGLang's per-request outputs -> RolloutTrace: every bad payload refused by name (no engine needed).

Payloads are built the way SGLang 0.5.23 builds them (base64 of int32 [S - 1 - start, layers, top_k], kept-id
lists in no order, the sampled token's logprob over its list); the good one is a real engine output's shape
(tests/test_sglang_capture.py runs the engine). Each refusal names the request and the position or field.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest

from moe_replay.capture_config import CaptureConfig
from moe_replay.errors import ExpertIdOutOfRangeError
from moe_replay.geometry import EngineInfo, ModelGeometry
from moe_replay.integrations.sglang import (SglangCapture, SglangCollectError, SglangPayloadError, SglangServedError,
                                            SglangSourceError, check_served)
from moe_replay.integrations.sglang.request import per_prompt, request_fields, sampling_of
from moe_replay.trace import Sampling

GEOM = ModelGeometry(num_layers=3, moe_layer_ids=(1, 2), num_experts=8, top_k=2, vocab_size=64, family="deepseek_v3")
CONFIG = {"model_type": "deepseek_v3", "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8,
          "num_experts_per_tok": 2, "vocab_size": 64}


class FakeTransport:
    """capture.Transport returning canned outputs (what SGLang would send back)."""

    where = "fake"

    def __init__(self, outputs):
        self.outputs, self.sent = outputs, []

    def generate(self, fields):
        self.sent.append(fields)
        return self.outputs

    def model_config(self):
        return CONFIG

    def engine_info(self):
        return EngineInfo(name="sglang", version="0.5.23")


def output(rid="r0", P=4, G=3, start=0, routes_THK=None, mask=None, logprobs=None, **meta):
    rng = np.random.default_rng(0)
    prompt = list(range(3, 3 + P))
    gen = [10 + g for g in range(G)]
    T = P + G - 1 - start
    if routes_THK is None:
        routes_THK = np.stack([rng.permutation(8)[:2] for _ in range(T * 3)]).reshape(T, 3, 2)
    if mask is None:
        mask = [[gen[g] + 5, gen[g], 1] for g in range(G)]  # SGLang's order: none
    m = {"id": rid, "finish_reason": {"type": "length"}, "completion_tokens": G, "weight_version": "default",
         "routed_experts": base64.b64encode(np.asarray(routes_THK, dtype=np.int32).tobytes()).decode(),
         "output_token_sampling_mask": mask,
         "output_token_sampling_logprobs": [-0.5] * G if logprobs is None else logprobs, **meta}
    return {"output_ids": gen, "prompt_token_ids": prompt, "meta_info": m}, np.asarray(routes_THK)


def capture(outputs, config=None):
    cap = SglangCapture.__new__(SglangCapture)
    cap.config, cap.transport = config or CaptureConfig(), FakeTransport(outputs)
    cap.geometry, cap.engine_info, cap.weights_version = GEOM, cap.transport.engine_info(), None
    cap.seconds = {"request": 0.0, "build": 0.0, "store": 0.0}
    return cap


def test_good_payload_is_the_trace():
    out, routes_THK = output()
    (t,) = capture([out]).collect([out], [Sampling(temperature=0.7, top_k=20)])
    assert t.key == "r0" and t.prompt_len == 4 and t.num_tokens == 7 and t.engine.name == "sglang"
    assert t.routes_TLK.dtype == np.uint8 and np.array_equal(t.routes_TLK, routes_THK[:, [1, 2], :])  # MoE layers only
    assert [t.support.row(g).tolist() for g in range(3)] == [[1, 10, 15], [1, 11, 16], [1, 12, 17]]  # sorted
    assert t.logprobs_G.tolist() == [-0.5] * 3 and t.sampling.top_k == 20 and t.weights_version is None


def test_route_start_is_routed_experts_start_len():
    out, routes_THK = output(start=4)
    (t,) = capture([out]).collect([out], route_start=4)
    assert t.route_start == 4 and t.routes_TLK.shape == (2, 2, 2)


@pytest.mark.parametrize("bad, expected, where", [
    ("rows", SglangPayloadError, "meta_info.routed_experts"),
    ("layers", SglangPayloadError, "meta_info.routed_experts"),
    ("expert", ExpertIdOutOfRangeError, "meta_info.routed_experts[position 2, layer 1, column 1]"),
    ("base64", SglangPayloadError, "meta_info.routed_experts"),
    ("missing_routes", SglangPayloadError, "meta_info.routed_experts"),
    ("mask_rows", SglangPayloadError, "meta_info.output_token_sampling_mask"),
    ("mask_token", SglangPayloadError, "meta_info.output_token_sampling_mask[row 1, position 5]"),
    ("mask_vocab", SglangPayloadError, "meta_info.output_token_sampling_mask[row 0, position 4]"),
    ("logprob", SglangPayloadError, "meta_info.output_token_sampling_logprobs[position 6]"),
    ("logprobs_count", SglangPayloadError, "meta_info.output_token_sampling_logprobs"),
    ("versions", SglangPayloadError, "meta_info.weight_versions"),
    ("abort", SglangPayloadError, "meta_info.finish_reason"),
])
def test_bad_payload_refused_naming_request_and_position(bad, expected, where):
    good, routes_THK = output(rid="req-7")
    m = dict(good["meta_info"])
    b64 = lambda a: base64.b64encode(np.asarray(a, dtype=np.int32).tobytes()).decode()  # noqa: E731
    if bad == "rows":
        m["routed_experts"] = b64(routes_THK[:-1])
    elif bad == "layers":
        m["routed_experts"] = b64(np.zeros((6, 2, 2)))  # 6 rows of 2 layers: the byte count of 4 rows of 3
    elif bad == "expert":
        r = routes_THK.copy()
        r[2, 1, 1] = 8
        m["routed_experts"] = b64(r)
    elif bad == "base64":
        m["routed_experts"] = m["routed_experts"][:-3] + "@@="
    elif bad == "missing_routes":
        m.pop("routed_experts")
    elif bad == "mask_rows":
        m["output_token_sampling_mask"] = m["output_token_sampling_mask"][:2]
    elif bad == "mask_token":
        m["output_token_sampling_mask"] = [[10, 1], [3, 4], [12]]
    elif bad == "mask_vocab":
        m["output_token_sampling_mask"] = [[10, 64], [11], [12]]
    elif bad == "logprob":
        m["output_token_sampling_logprobs"] = [-0.5, -0.5, float("nan")]
    elif bad == "logprobs_count":
        m["output_token_sampling_logprobs"] = [-0.5]
    elif bad == "versions":
        m["weight_versions"] = [{"version": "v1", "start": 0, "end": 1}, {"version": "v2", "start": 1, "end": 3}]
    elif bad == "abort":
        m["finish_reason"] = {"type": "abort", "message": "client gone"}
    ok, _ = output(rid="req-8")
    with pytest.raises(SglangCollectError) as info:
        capture([]).collect([{**good, "meta_info": m}, ok])
    assert [t.key for t in info.value.traces] == ["req-8"]  # one bad request never costs the others their traces
    err = info.value.failures["req-7"]
    assert isinstance(err, expected), err
    assert err.where.record == "req-7" and err.where.field == where, err


def test_support_overflow_follows_the_policy():
    out, _ = output(mask=[[10] + list(range(20, 40)), [11], [12]])
    with pytest.raises(SglangCollectError, match=r"max_support=8"):
        capture([out], CaptureConfig(max_support=8)).collect([out])
    (t,) = capture([out], CaptureConfig(max_support=8, on_support_overflow="omit")).collect([out])
    assert t.support is None and t.extra["support_omitted"] == {"row": 0, "size": 21, "max_support": 8}


def test_weights_version_guard():
    out, _ = output(weight_version="step-3")
    cap = capture([out])
    (t,) = cap.collect([out])
    assert t.weights_version == "step-3"  # the engine's own name, where the capture set none
    cap.weights_version = "step-3"
    assert cap.collect([out])[0].weights_version == "step-3"
    cap.weights_version = 4
    with pytest.raises(SglangCollectError) as info:
        cap.collect([out])
    assert info.value.failures["r0"].where.field == "meta_info.weight_version"


def test_generate_sends_the_flags_and_expands_n():
    """n > 1 goes as n requests of n = 1 (SGLang 0.5.23's n > 1 warm-up fails under return_sampling_mask)."""
    outs = [output(rid=f"s{i}")[0] for i in range(4)]
    cap = capture(outs)
    _, traces = cap.generate([[3, 4, 5, 6], [3, 4, 5, 6]], {"temperature": 0.0, "n": 2, "max_new_tokens": 3})
    (sent,) = cap.transport.sent
    assert sent["return_routed_experts"] and sent["return_sampling_mask"] and sent["return_prompt_token_ids"]
    assert sent["sampling_logprobs_mode"] == "selected" and sent["routed_experts_start_len"] == 0
    assert len(sent["input_ids"]) == 4 and all(p["n"] == 1 for p in sent["sampling_params"])
    assert [t.key for t in traces] == ["s0", "s1", "s2", "s3"] and traces[0].sampling.greedy


def test_sampling_of_reads_sglang_defaults_and_adjustments():
    assert sampling_of({}) == Sampling(temperature=1.0, top_k=-1, top_p=1.0)
    assert sampling_of({"temperature": 0}).greedy and sampling_of({"top_k": 1 << 30}).top_k == -1
    s = sampling_of({"temperature": 0.8, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1, "regex": "a+",
                     "sampling_seed": 3}, custom_logit_processor="x")
    assert (s.temperature, s.top_k, s.min_p, s.seed) == (0.8, 20, 0.1, 3)
    assert s.adjusted == ("custom_logit_processor", "regex", "repetition_penalty")
    with pytest.raises(ValueError, match="one n"):
        per_prompt([{"n": 1}, {"n": 2}], 2)
    with pytest.raises(ValueError, match="not both"):
        request_fields(CaptureConfig(), ["a", [1, 2]], [{}, {}])


def test_served_guard_and_source_refusals():
    check_served({"model_type": "qwen3_moe", "num_hidden_layers": 2})
    for cfg in ({"model_type": "qwen3_moe", "mlp_only_layers": [0, 2]}, {"model_type": "qwen2_moe", "decoder_sparse_step": 2}):
        with pytest.raises(SglangServedError, match=f"mis-serves this {cfg['model_type']}"):
            check_served(cfg)
    with pytest.raises(SglangSourceError, match="no worker hooks"):
        SglangCapture("http://127.0.0.1:9", CaptureConfig(source="hooks"))
