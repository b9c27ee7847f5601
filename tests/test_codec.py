"""Codec: exact round trips, narrow sizes, and robust decoding of damaged or random bytes."""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_replay.codec import ROUTE_CODECS, bound_bits_per_token_layer, decode_trace, encode_trace, peek_key, record_chunks
from moe_replay.codec import support as support_codec
from moe_replay.codec import varint
from moe_replay.codec.routes import _perm_table, perm_rank
from moe_replay.errors import (
    ChecksumError,
    ExpertIdOutOfRangeError,
    GeometryMismatchError,
    SchemaVersionError,
    TraceFormatError,
    TruncatedRecordError,
    Where,
)
from moe_replay.geometry import EngineInfo, ModelGeometry
from moe_replay.trace import RolloutTrace, Sampling, SamplingSupport

GOLDEN = Path(__file__).parent / "golden" / "trace_v1.msgpack"
"""Written by schema v1 (frozen: today's writer writes v3); its extra held {"sampling": {"top_p": 0.9}}."""
GOLDEN_V2 = Path(__file__).parent / "golden" / "trace_v2.msgpack"
"""Written by schema v2 (frozen): single-span, typed sampling and weights_version."""
GOLDEN_V3 = Path(__file__).parent / "golden" / "trace_v3.msgpack"
"""Written by schema v3 (frozen): a two-span (stitched two-turn) record."""
GOLDEN_V4 = Path(__file__).parent / "golden" / "trace_v4.msgpack"
"""Written by schema v4: the record of GOLDEN_V3, `route_chunks` nil (it holds every row; records naming
shared chunks read through their store: tests/golden/store_v2, tests/test_store_chunks.py)."""
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_routes(rng: np.random.Generator, t: int, l: int, e: int, k: int) -> np.ndarray:
    """Distinct ids per token-layer, in random (not sorted) column order, like unsorted top-k."""
    keys_TLE = rng.random((t, l, e))
    return np.argsort(keys_TLE, axis=-1)[..., :k]


def random_support(rng: np.random.Generator, rows: int, vocab: int) -> SamplingSupport:
    out = []
    for _ in range(rows):
        kind = rng.integers(0, 4)
        if kind == 0:
            size = 0 if rng.random() < 0.3 else vocab  # empty, or untruncated (top_p = 1)
        elif kind == 1:
            size = int(rng.integers(vocab // 2 + 1, vocab + 1))  # wide: stored as a complement
        else:
            size = int(rng.integers(1, min(vocab, 40) + 1))
        out.append(np.sort(rng.choice(vocab, size, replace=False)))
    return SamplingSupport.from_rows(out)


def make_trace(seed: int, *, e: int = 8, k: int = 2, vocab: int = 512, s: int = 40, prompt: int = 10,
               route_start: int = 0, moe_ids=(1, 3), num_layers: int = 4, sampling: Sampling = Sampling(top_p=0.9),
               weights_version: str | int | None = None) -> RolloutTrace:
    rng = np.random.default_rng(seed)
    g = ModelGeometry(num_layers, moe_ids, e, k, vocab, "qwen3_moe")
    rows = max(s - 1 - route_start, 0)
    return RolloutTrace(
        key=f"req-{seed}",
        token_ids_S=rng.integers(0, vocab, s),
        prompt_len=prompt,
        geometry=g,
        routes_TLK=random_routes(rng, rows, len(moe_ids), e, k),
        route_start=route_start,
        support=random_support(rng, s - prompt, vocab),
        logprobs_G=rng.normal(size=s - prompt).astype(np.float32),
        engine=EngineInfo("vllm", "0.32.0", "bfloat16", {"device": "cpu"}),
        extra={"step": seed},
        sampling=sampling,
        weights_version=weights_version,
    )


# -- primitives -------------------------------------------------------------------------------
@FAST
@given(st.lists(st.integers(0, 2**64 - 1), max_size=200))
def test_varint_round_trip(values):
    arr = np.array(values, dtype=np.uint64)
    assert np.array_equal(varint.decode(varint.encode(arr), count=len(arr)), arr)


@FAST
@given(st.binary(max_size=64))
def test_varint_decode_random_bytes_only_value_error(data):
    try:
        varint.decode(data)
    except ValueError:
        pass


@pytest.mark.parametrize("e,k", [(2, 1), (4, 2), (6, 3), (8, 2), (16, 1), (5, 3)])
def test_perm_rank_inverts_table(e, k):
    table = _perm_table(e, k)
    assert len(table) == math.perm(e, k)
    assert np.array_equal(perm_rank(table, e), np.arange(len(table)))


def test_bound_matches_definition():
    assert bound_bits_per_token_layer(8, 2) == pytest.approx(math.log2(56))
    assert bound_bits_per_token_layer(128, 8) == pytest.approx(math.log2(math.perm(128, 8)))


# -- route codecs ------------------------------------------------------------------------------
@FAST
@given(
    codec=st.sampled_from(ROUTE_CODECS.names()),
    t=st.integers(0, 40),
    l=st.integers(1, 4),
    ek=st.sampled_from([(2, 1), (8, 2), (8, 8), (16, 2), (60, 4), (128, 8), (256, 3), (300, 2), (1000, 4), (300, 8), (256, 12)]),
    seed=st.integers(0, 2**32 - 1),
)
def test_route_codec_round_trip_keeps_column_order(codec, t, l, ek, seed):
    e, k = ek
    routes = random_routes(np.random.default_rng(seed), t, l, e, k)
    c = ROUTE_CODECS.get(codec)
    data, params = c.encode(routes, e)
    out = c.decode(data, routes.shape, e, params)
    assert out.shape == routes.shape and np.array_equal(out, routes)
    assert out.dtype == (np.uint8 if e <= 256 else np.uint16)


def test_route_codec_sizes_on_skewed_routing():
    """Narrow is 1 byte per id; the entropy codec beats the bound when popularity is skewed."""
    rng = np.random.default_rng(0)
    t, l, e, k = 4096, 4, 128, 8
    logpop_LE = rng.normal(0, 0.5, (l, e))
    routes = np.argsort(-(rng.gumbel(size=(t, l, e)) + logpop_LE), axis=-1)[..., :k]
    sizes = {name: len(ROUTE_CODECS.get(name).encode(routes, e)[0]) / (t * l) for name in ROUTE_CODECS}
    assert sizes["int32"] == 4 * k and sizes["narrow"] == k
    assert sizes["moe_replay"] < bound_bits_per_token_layer(e, k) / 8


@pytest.mark.parametrize("t,l,e,k", [(1, 1, 8, 2), (21, 2, 8, 2), (100, 2, 8, 2), (4, 48, 128, 8), (10, 2, 16, 4)])
def test_short_records_cost_at_most_the_bound_rounded_up_to_a_byte(t, l, e, k):
    """Huffman tables do not amortise on short records: enum mode keeps them at the bound."""
    routes = random_routes(np.random.default_rng(t), t, l, e, k)
    data, params = ROUTE_CODECS.get("moe_replay").encode(routes, e)
    assert params["mode"] == "enum"
    assert len(data) <= math.ceil(t * l * bound_bits_per_token_layer(e, k) / 8)
    assert np.array_equal(ROUTE_CODECS.get("moe_replay").decode(data, routes.shape, e, params), routes)


def test_enum_decode_refuses_damaged_bytes():
    c = ROUTE_CODECS.get("moe_replay")
    routes = random_routes(np.random.default_rng(3), 20, 2, 8, 2)
    data, params = c.encode(routes, 8)
    assert params["mode"] == "enum"
    with pytest.raises(ValueError, match="expected"):
        c.decode(data[:-1], routes.shape, 8, params)
    with pytest.raises(ValueError, match="out of range"):
        c.decode(b"\xff" * len(data), routes.shape, 8, params)


@pytest.mark.parametrize("name", ["narrow", "int32", "moe_replay"])
def test_route_decode_refuses_wrong_length(name):
    routes = random_routes(np.random.default_rng(1), 10, 2, 8, 2)
    c = ROUTE_CODECS.get(name)
    data, params = c.encode(routes, 8)
    with pytest.raises(ValueError):
        c.decode(data, (11, 2, 2), 8, params)


def test_joint_rank_out_of_range_is_an_error():
    c = ROUTE_CODECS.get("moe_replay")
    from moe_replay.codec import entropy

    bad = entropy.compress([bytes([200, 3])])  # 200 >= 8*7 = 56 valid ranks
    with pytest.raises(ValueError, match="rank out of range"):
        c.decode(bad, (2, 1, 2), 8, {"mode": "joint"})


# -- support codec -----------------------------------------------------------------------------
@FAST
@given(rows=st.integers(0, 30), vocab=st.sampled_from([2, 7, 512, 3000]), seed=st.integers(0, 2**32 - 1))
def test_support_round_trip(rows, vocab, seed):
    sup = random_support(np.random.default_rng(seed), rows, vocab)
    data, params = support_codec.encode(sup, vocab)
    out = support_codec.decode(data, vocab, params)
    assert out.equals(sup.canonical(vocab))  # a row of every id comes back kept whole


def test_untruncated_rows_cost_almost_nothing():
    vocab = 151_936  # Qwen3 vocabulary: a full row must not cost V ids
    sup = SamplingSupport.from_rows([np.arange(vocab)] * 8)
    data, _ = support_codec.encode(sup, vocab)
    assert len(data) < 64


# -- records -----------------------------------------------------------------------------------
@FAST
@given(
    seed=st.integers(0, 2**32 - 1),
    s=st.integers(1, 60),
    ek=st.sampled_from([(8, 2), (64, 6), (300, 2)]),
    with_parts=st.tuples(st.booleans(), st.booleans(), st.booleans()),
)
def test_record_round_trip(seed, s, ek, with_parts):
    e, k = ek
    prompt = s // 3
    trace = make_trace(seed, e=e, k=k, s=s, prompt=prompt)
    has_routes, has_support, has_logprobs = with_parts
    trace.routes_TLK = trace.routes_TLK if has_routes else None
    trace.support = trace.support if has_support else None
    trace.logprobs_G = trace.logprobs_G if has_logprobs else None
    data = encode_trace(trace)
    assert peek_key(data) == trace.key
    assert decode_trace(data).equals(trace)


def test_record_route_start_for_multi_turn_fragment():
    trace = make_trace(3, s=50, prompt=30, route_start=29)
    assert trace.routes_TLK.shape == (20, 2, 2)
    assert decode_trace(encode_trace(trace)).equals(trace)


def test_every_route_codec_is_readable_in_records():
    trace = make_trace(5)
    for name in ROUTE_CODECS:
        assert decode_trace(encode_trace(trace, route_codec=name)).equals(trace)


@FAST
@given(st.binary(max_size=300))
def test_decode_random_bytes_raises_trace_format_error(data):
    with pytest.raises(TraceFormatError):
        decode_trace(data, Where(file="random.bin"))


@FAST
@given(pos=st.integers(0, 10**6), bit=st.integers(0, 7))
def test_any_bit_flip_is_detected(pos, bit):
    data = bytearray(encode_trace(make_trace(7)))
    data[pos % len(data)] ^= 1 << bit
    with pytest.raises(TraceFormatError):
        decode_trace(bytes(data))


def test_every_bit_of_the_envelope_is_checked():
    """Every bit of the bytes before the checksummed body (format, version, crc32 and the body's length),
    exhaustively: the version byte is outside the crc, and 3 -> 2 (bit 0) or 3 -> 1 (bit 1) names another
    readable version, so a body holding fields of a later version is refused."""
    data = encode_trace(make_trace(7))
    head = len(data) - len(msgpack.unpackb(data, raw=False)["body"])
    for pos in range(head):
        for bit in range(8):
            bad = bytearray(data)
            bad[pos] ^= 1 << bit
            with pytest.raises(TraceFormatError):
                decode_trace(bytes(bad))


@FAST
@given(cut=st.integers(0, 10**6))
def test_any_truncation_is_detected(cut):
    data = encode_trace(make_trace(8))
    with pytest.raises(TraceFormatError):
        decode_trace(data[: cut % len(data)])


def test_truncation_error_is_typed_and_located():
    data = encode_trace(make_trace(9))
    with pytest.raises(TruncatedRecordError, match="seg-1.bin"):
        decode_trace(data[:-3], Where(file="seg-1.bin"))


def test_checksum_error_names_field():
    data = bytearray(encode_trace(make_trace(10)))
    data[-10] ^= 0xFF
    with pytest.raises(ChecksumError, match="crc32"):
        decode_trace(bytes(data))


def _rewrap(data: bytes, **outer_changes) -> bytes:
    outer = msgpack.unpackb(data)
    outer.update(outer_changes)
    return msgpack.packb(outer, use_bin_type=True)


def test_unknown_schema_version_is_refused_with_reason():
    data = _rewrap(encode_trace(make_trace(11)), v=99)
    with pytest.raises(SchemaVersionError, match=r"expected a schema version in \[1, 2, 3, 4, 5\], found 99"):
        decode_trace(data)


def test_body_field_errors_name_record_and_field():
    outer = msgpack.unpackb(encode_trace(make_trace(12)))
    body = msgpack.unpackb(outer["body"])
    body["geometry"]["top_k"] = 3  # routes were written with K=2
    packed = msgpack.packb(body, use_bin_type=True)
    data = _rewrap(encode_trace(make_trace(12)), body=packed, crc32=zlib.crc32(packed))
    with pytest.raises(TraceFormatError, match=r"record 'req-12', field 'routes'"):
        decode_trace(data)


# -- trace validation --------------------------------------------------------------------------
def test_expert_id_out_of_range_named():
    g = ModelGeometry(2, (0, 1), 8, 2, 512)
    routes = np.zeros((4, 2, 2), dtype=np.int64)
    routes[..., 1] = 1
    routes[2, 1, 0] = 9
    with pytest.raises(ExpertIdOutOfRangeError, match=r"routes_TLK\[2, 1, 0\].*expected expert ids in \[0, 8\), found 9"):
        RolloutTrace("r", np.zeros(5, dtype=np.int64), 2, g, routes)


def test_repeated_expert_in_a_row_is_refused():
    g = ModelGeometry(2, (0, 1), 8, 2, 512)
    routes = np.tile(np.array([0, 1]), (4, 2, 1))
    routes[1, 0] = [3, 3]
    with pytest.raises(TraceFormatError, match="distinct"):
        RolloutTrace("r", np.zeros(5, dtype=np.int64), 2, g, routes).validate()


def test_wrong_route_shape_refused():
    g = ModelGeometry(2, (0, 1), 8, 2, 512)
    routes = np.tile(np.array([0, 1]), (5, 2, 1))  # S=5 needs 4 rows
    with pytest.raises(TraceFormatError, match=r"shape \[4, 2, 2\]"):
        RolloutTrace("r", np.zeros(5, dtype=np.int64), 2, g, routes).validate()


def test_unsorted_support_refused():
    g = ModelGeometry(2, (0, 1), 8, 2, 512)
    sup = SamplingSupport.from_rows([[1, 5], [7, 3]])
    with pytest.raises(TraceFormatError, match=r"support.ids_N\[row 1\]"):
        RolloutTrace("r", np.zeros(4, dtype=np.int64), 2, g, support=sup).validate()


def test_geometry_mismatch_names_field():
    a = ModelGeometry(4, (1, 3), 8, 2, 512)
    b = ModelGeometry(4, (0, 1, 2, 3), 8, 2, 512)
    with pytest.raises(GeometryMismatchError, match=r"geometry.moe_layer_ids.*expected \(0, 1, 2, 3\), found \(1, 3\)"):
        b.check_matches(a, Where(record="r"))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(moe_layer_ids=()), "at least one"),
        (dict(moe_layer_ids=(2, 1)), "strictly increasing"),
        (dict(top_k=9), r"top_k \(9\) must be <= num_experts \(8\)"),
        (dict(vocab_size=0), "vocab_size"),
    ],
)
def test_geometry_validation(kwargs, match):
    base = dict(num_layers=4, moe_layer_ids=(1, 3), num_experts=8, top_k=2, vocab_size=512)
    with pytest.raises(ValueError, match=match):
        ModelGeometry(**{**base, **kwargs})


# -- golden files: records written by schema v1, v2 and v3 stay readable ----------------------------
def golden_trace() -> RolloutTrace:
    """What the v1 golden record decodes to: extra["sampling"] migrated to the typed field."""
    return make_trace(2026, e=8, k=2, s=24, prompt=8)


def golden_trace_v2() -> RolloutTrace:
    return make_trace(2026, e=8, k=2, s=24, prompt=8, weights_version="ckpt-step-7",
                      sampling=Sampling(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=3))


def test_golden_v1_record_still_decodes():
    if not GOLDEN.exists():
        pytest.fail(f"golden file {GOLDEN} is missing")
    trace = decode_trace(GOLDEN.read_bytes(), Where(file=str(GOLDEN)))
    assert trace.equals(golden_trace())
    assert trace.sampling == Sampling(temperature=1.0, top_p=0.9) and "sampling" not in trace.extra
    assert trace.weights_version is None


def read_golden(path: Path, version: int) -> RolloutTrace:
    """Decode a golden record after checking it exists and was written by schema `version`."""
    if not path.exists():  # regenerate with: python -m tests.test_codec
        pytest.fail(f"golden file {path} is missing")
    data = path.read_bytes()
    assert msgpack.unpackb(data)["v"] == version
    return decode_trace(data, Where(file=str(path)))


def test_golden_v2_record_decodes():
    trace = read_golden(GOLDEN_V2, 2)
    assert trace.equals(golden_trace_v2()) and trace.sampling.temperature == 0.7 and trace.weights_version == "ckpt-step-7"


@pytest.mark.parametrize("version", [None, 12, "sha256:abc"])
def test_sampling_and_weights_version_round_trip(version):
    t = make_trace(5, sampling=Sampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0), weights_version=version)
    back = decode_trace(encode_trace(t))
    assert back.equals(t) and back.sampling.greedy and back.weights_version == version


def _edit_body(data: bytes, edit, version: int | None = None) -> bytes:
    outer = msgpack.unpackb(data)
    body = msgpack.unpackb(outer["body"])
    edit(body)
    packed = msgpack.packb(body, use_bin_type=True)
    outer.update(body=packed, crc32=zlib.crc32(packed), **({} if version is None else {"v": version}))
    return msgpack.packb(outer, use_bin_type=True)


def test_v1_record_without_sampling_gets_the_engine_defaults():
    def as_v1(body):
        del body["sampling"], body["weights_version"], body["spans"], body["route_chunks"], body["rerouted"]  # no v2, v3, v4 or v5 fields
    back = decode_trace(_edit_body(encode_trace(make_trace(6)), as_v1, version=1))
    assert back.sampling == Sampling() and back.weights_version is None


def test_bad_sampling_fields_are_refused_by_name():
    def v1_bad(body):
        del body["sampling"], body["weights_version"], body["spans"], body["route_chunks"], body["rerouted"]
        body["extra"]["sampling"] = {"temperature": -1.0}
    with pytest.raises(TraceFormatError, match=r"record 'req-7', field 'extra.sampling'.*temperature.*-1.0"):
        decode_trace(_edit_body(encode_trace(make_trace(7)), v1_bad, version=1))
    with pytest.raises(TraceFormatError, match=r"field 'sampling'.*top_p"):
        decode_trace(_edit_body(encode_trace(make_trace(7)), lambda b: b["sampling"].update(top_p=0.0)))
    with pytest.raises(TraceFormatError, match=r"field 'weights_version'.*missing"):
        decode_trace(_edit_body(encode_trace(make_trace(7)), lambda b: b.pop("weights_version")))
    with pytest.raises(TraceFormatError, match=r"field 'weights_version'.*float"):
        decode_trace(_edit_body(encode_trace(make_trace(7)), lambda b: b.update(weights_version=1.5)))
    with pytest.raises(ValueError, match="Sampling.min_p"):
        Sampling(min_p=2.0)
    with pytest.raises(ValueError, match="Sampling.adjusted.*'repetition_penalty'"):
        Sampling(adjusted="repetition_penalty")  # a name, not a sequence of names
    with pytest.raises(TraceFormatError, match=r"field 'sampling'.*adjusted"):
        decode_trace(_edit_body(encode_trace(make_trace(7)), lambda b: b["sampling"].update(adjusted=[3])))


# -- schema v3: several generated spans (a stitched multi-turn record) ------------------------------
def two_span_trace(seed: int = 2026) -> RolloutTrace:
    """24 tokens: prompt 0..5, turn 1 sampled 6..11, tool text 12..15, turn 2 sampled 16..23 (14 rows)."""
    t = make_trace(seed, e=8, k=2, s=24, prompt=6, weights_version=3,
                   sampling=Sampling(temperature=0.7, top_p=0.9, seed=1))
    rng = np.random.default_rng(seed)
    t.generated_spans = ((6, 12), (16, 24))
    t.support = random_support(rng, 14, 512)
    t.logprobs_G = rng.normal(size=14).astype(np.float32)
    return t.validate()


def test_golden_v3_record_decodes():
    trace = read_golden(GOLDEN_V3, 3)
    assert trace.equals(two_span_trace()) and trace.spans == ((6, 12), (16, 24)) and trace.num_generated == 14
    assert trace.generated_positions().tolist() == [*range(6, 12), *range(16, 24)]


def test_golden_v4_record_decodes():
    trace = read_golden(GOLDEN_V4, 4)
    assert trace.equals(two_span_trace()) and record_chunks(GOLDEN_V4.read_bytes()) == []


def test_multi_span_round_trip_and_single_span_writes_nil():
    t = two_span_trace(7)
    assert decode_trace(encode_trace(t)).equals(t)
    body = msgpack.unpackb(msgpack.unpackb(encode_trace(t))["body"])
    assert body["spans"] == [[6, 12], [16, 24]]
    single = make_trace(8)
    single.generated_spans = ((single.prompt_len, single.num_tokens),)  # the default, spelled out
    body = msgpack.unpackb(msgpack.unpackb(encode_trace(single))["body"])
    assert body["spans"] is None and not single.multi_span and decode_trace(encode_trace(single)).equals(single)


@pytest.mark.parametrize("spans, match", [
    (((6, 12), (12, 24)), r"generated_spans\[1\]'.*inside \[13, 24\)"),   # adjacent: one span, not two
    (((6, 12), (10, 24)), r"generated_spans\[1\]'.*inside \[13, 24\)"),   # overlapping
    (((16, 24), (6, 12)), r"generated_spans\[1\]'.*inside \[25, 24\)"),   # descending
    (((4, 12), (16, 24)), r"generated_spans\[0\]'.*inside \[6, 24\).*from prompt_len 6"),  # inside the prompt
    (((6, 12), (16, 25)), r"generated_spans\[1\]'.*found \(16, 25\)"),    # past the sequence
    (((6, 6), (16, 24)), r"generated_spans\[0\]'.*non-empty"),
    ((), r"generated_spans'.*>= 1 span"),
])
def test_bad_spans_are_refused_on_construction_and_read(spans, match):
    t = two_span_trace(9)
    t.generated_spans = spans
    with pytest.raises(TraceFormatError, match=match):
        t.validate()
    body_spans = [list(s) for s in spans]
    data = _edit_body(encode_trace(two_span_trace(9)), lambda b: b.update(spans=body_spans))
    with pytest.raises(TraceFormatError, match=match):
        decode_trace(data)


def test_spans_field_is_checked_by_name():
    with pytest.raises(TraceFormatError, match=r"field 'spans'.*missing"):
        decode_trace(_edit_body(encode_trace(make_trace(10)), lambda b: b.pop("spans")))
    with pytest.raises(TraceFormatError, match=r"field 'spans'.*\[start, end\] int pairs"):
        decode_trace(_edit_body(encode_trace(make_trace(10)), lambda b: b.update(spans=[[1, 2, 3]])))
    # rows follow the spans: logprobs of S - prompt_len tokens do not fit a two-span record of 14
    with pytest.raises(TraceFormatError, match=r"field 'logprobs'.*56 bytes"):
        decode_trace(_edit_body(encode_trace(make_trace(2026, s=24, prompt=6)), lambda b: b.update(spans=[[6, 12], [16, 24]])))


def test_v2_body_with_spans_is_single_span():
    """A v2 reader never wrote spans: a v2 envelope is read as one span whatever its body holds."""
    t = make_trace(11)
    back = decode_trace(_edit_body(encode_trace(t), lambda b: (b.pop("spans"), b.pop("route_chunks"), b.pop("rerouted")), version=2))
    assert back.equals(t) and not back.multi_span


if __name__ == "__main__":  # the v1, v2 and v3 golden files are frozen: only v4 is (re)written
    GOLDEN_V4.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN_V4.write_bytes(encode_trace(two_span_trace()))
    print(f"wrote {GOLDEN_V4}")
