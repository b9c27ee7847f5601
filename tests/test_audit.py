"""The audit's parts that need no model: the readers of each pipeline's format (as vLLM, SGLang, verl and
Megatron lay routes out), what columns claim, the typed verdicts and errors, the set arithmetic, and the
thresholds' validation. The audit itself, on real models, is tests/test_audit_zoo.py (HF families),
test_audit_megatron.py, test_audit_trainers.py and test_audit_cli.py.
"""

from __future__ import annotations

import base64
import pickle

import numpy as np
import pytest
import torch

from moe_replay.audit import (Aligned, AuditReport, Cause, LayerAxis, RouteAlignmentError, Shifted, Thresholds, Verdict,
                              from_megatron, from_sglang, from_traces, from_verl, from_vllm, read_routes)
from moe_replay.audit.compare import chance_agreement, codes, masks, overlap, token_consistency
from moe_replay.audit.formats import guess_format
from moe_replay.errors import GeometryMismatchError, TraceFormatError
from moe_replay.geometry import ModelGeometry
from moe_replay.trace import RolloutTrace

G = ModelGeometry(num_layers=3, moe_layer_ids=(1, 2), num_experts=8, top_k=2, vocab_size=64, family="t")
RNG = np.random.default_rng(0)


def _routes(t: int, layers: int = 2) -> np.ndarray:
    return np.argsort(RNG.random((t, layers, 8)), -1)[..., :2]


def test_vllm_rows_start_at_prompt_start_and_columns_are_decoder_layers():
    tokens = [np.arange(10), np.arange(7)]
    dense = [np.zeros((9 - 3, 3, 2), np.uint8), np.zeros((6, 3, 2), np.uint8)]
    batch = from_vllm(dense, tokens, prompt_start=[3, 0], keys=["a", "b"])
    assert [s.start for s in batch.samples] == [3, 0] and [s.rows_expected for s in batch.samples] == [6, 6]
    assert batch.layers is LayerAxis.DECODER and batch.claimed_layers(3, (1, 2)) == (0, 1, 2)
    one = from_vllm(dense[0], tokens[0], prompt_start=3)  # one request
    assert len(one.samples) == 1 and one.samples[0].key == "vllm-0"
    with pytest.raises(TraceFormatError, match="2 token sequences"):
        from_vllm(dense, [tokens[0]])
    with pytest.raises(TraceFormatError, match="integer expert ids"):
        from_vllm([d.astype(float) for d in dense], tokens)


def test_sglang_payload_is_base64_int32_shaped_by_the_model():
    rows = _routes(9, 3).astype("<i4")
    payload = base64.b64encode(rows.tobytes()).decode()
    batch = from_sglang(payload, np.arange(10), start_len=0, num_layers=3, top_k=2)
    assert np.array_equal(batch.samples[0].routes_TCK, rows) and guess_format([payload]) == "sglang"
    with pytest.raises(TraceFormatError, match=r"a multiple of 24 bytes"):
        from_sglang(base64.b64encode(rows.tobytes()[:-4]).decode(), np.arange(10), num_layers=3, top_k=2)
    with pytest.raises(TraceFormatError, match="base64 of int32 routes"):
        from_sglang("not base64!", np.arange(10), num_layers=3, top_k=2)


def test_verl_padded_and_nested_fields():
    ids_BS = torch.tensor([[0, 5, 6, 7, 8], [9, 10, 11, 0, 0]])
    mask_BS = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    re_BSLK = torch.from_numpy(np.stack([_routes(5, 3), _routes(5, 3)])).to(torch.int16)
    batch = from_verl(re_BSLK, ids_BS, mask_BS)
    assert [s.token_ids_S.tolist() for s in batch.samples] == [[5, 6, 7, 8], [9, 10, 11]]
    assert np.array_equal(batch.samples[0].routes_TCK, re_BSLK[0, 1:4].numpy())  # the real columns but the last
    assert batch.layers is LayerAxis.AUTO and batch.claimed_layers(3, (1, 2)) == (0, 1, 2)
    assert batch.claimed_layers(4, (1, 3)) == (1, 3, None)  # fewer columns than layers: the MoE layers in order
    nested = torch.nested.as_nested_tensor([torch.from_numpy(_routes(3, 2)), torch.from_numpy(_routes(4, 2))],
                                           layout=torch.jagged)
    ids = torch.nested.as_nested_tensor([torch.arange(4), torch.arange(4)], layout=torch.jagged)
    batch = from_verl(nested, ids)
    assert [len(s.routes_TCK) for s in batch.samples] == [3, 3]  # T_b - 1 kept; T_b (verl's padded row) cut
    assert guess_format(nested) == "verl" and guess_format(re_BSLK) == "verl"


def test_megatron_lists_read_sequence_first_with_a_batch_first_reading():
    b_count, s_len = 2, 4
    ids_BS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
    mask_BS = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    flat_MK = torch.arange(b_count * s_len * 2).view(-1, 2) % 8
    batch = from_megatron([flat_MK, flat_MK], ids_BS, mask_BS)
    # sample 1, position 1 sits at m = s * B + b = 3 sequence-first, at b * S + s = 5 batch-first
    assert batch.samples[1].slots_T.tolist() == [1, 3] and batch.readings[0][0] == "batch-first"
    assert batch.readings[0][1].samples[1].slots_T.tolist() == [4, 5]
    assert batch.claimed_layers(3, (1, 2)) == (1, 2)
    packed = from_megatron([torch.arange(14).view(7, 2) % 8], [np.arange(4), np.arange(3)], layout="thd", layers=[2])
    assert [s.slots_T.tolist() for s in packed.samples] == [[0, 1, 2], [4, 5]] and packed.claimed_layers(3, (1, 2)) == (2,)
    with pytest.raises(TraceFormatError, match="S \\* B = 8 rows"):
        from_megatron([flat_MK[:6]], ids_BS)
    with pytest.raises(TraceFormatError, match="'sbhd' or 'thd'"):
        from_megatron([flat_MK], ids_BS, layout="bshd")


def test_traces_keep_their_layers_and_refuse_missing_routes():
    t = RolloutTrace("k", np.arange(6), 3, G, routes_TLK=_routes(5))
    batch = from_traces([t])
    assert batch.layers == (1, 2) and guess_format([t]) == "trace" and read_routes(batch) is batch
    with pytest.raises(TraceFormatError, match="captured without routes"):
        from_traces([RolloutTrace("n", np.arange(6), 3, G)])
    with pytest.raises(TraceFormatError, match="a trace holds its tokens"):
        from_traces([t], np.arange(6))
    with pytest.raises(GeometryMismatchError, match="expected 4, found 2"):
        batch.check_top_k(4)
    with pytest.raises(ValueError, match="pass format="):
        guess_format(object())


def test_masks_compare_sets_and_ignore_what_no_expert_is():
    ids = np.array([[[0, 1], [7, 3]], [[1, 0], [3, 3]], [[9, -1], [5, 6]]])  # swapped columns, a repeat, out of range
    m = masks(ids, 8)
    assert overlap(m[0], m[1]).tolist() == [2, 1] and overlap(m[2], m[2]).tolist() == [0, 2]
    assert codes(m)[0, 0] == codes(m)[1, 0]
    wide = masks(np.array([[[70, 127, 0]]]), 128)
    assert wide.shape == (1, 1, 2) and overlap(wide, wide).tolist() == [[3]]
    uniform = masks(np.array([[[e, (e + 1) % 8]] for e in range(8)]), 8)
    assert chance_agreement(uniform, uniform, 8, 2) == pytest.approx(2 / 8)
    assert token_consistency(uniform, np.arange(8), 8, 2) is None  # no token repeats
    same = masks(np.repeat(np.array([[[0, 1]], [[2, 3]]]), 10, 0), 8)
    assert token_consistency(same, np.repeat([5, 6], 10), 8, 2) == pytest.approx(0.5)


def test_verdicts_are_typed_and_the_error_carries_the_report():
    with pytest.raises(ValueError, match="needs Shifted evidence"):
        Verdict(Cause.SHIFTED, Aligned(1.0))
    with pytest.raises(ValueError, match="must be a Cause"):
        Verdict("shifted", Shifted(1, 0.9, 0.4))
    v = Verdict(Cause.SHIFTED, Shifted(1, 0.95, 0.4))
    report = AuditReport("vllm", v, (), (1, 2), (0.4, 0.5), np.zeros((0, 2)))
    assert not report.ok and report.to_dict()["verdict"] == {
        "cause": "shifted", "evidence": {"shift": 1, "agreement": 0.95, "agreement_unshifted": 0.4},
        "describe": "shifted by +1 tokens (agreement 0.950 shifted, 0.400 as given)"}
    with pytest.raises(RouteAlignmentError, match="shifted by \\+1 tokens") as err:
        report.raise_if_misaligned()
    again = pickle.loads(pickle.dumps(err.value))
    assert isinstance(again, RouteAlignmentError) and again.report.verdict == v


@pytest.mark.parametrize("field,value", [("aligned", 1.5), ("window", 0), ("min_run", 2.5), ("chance_margin", -0.1),
                                         ("pattern", True)])
def test_thresholds_are_validated(field, value):
    with pytest.raises(ValueError, match=f"Thresholds.{field}"):
        Thresholds(**{field: value})
