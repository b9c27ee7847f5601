"""Every public entry point of the metrics and the corrections refuses tensors whose dtype cannot
mean what the argument says, with a typed `InputDtypeError` naming the entry, the argument, the
expected and the found dtype: integer logprobs (log-ratios of equal integers are 0, so k3 read 0
with nothing said), float or integer masks (0.5 and 2 counted as True), float expert ids.

One table row per (entry point, argument, wrong dtype); each entry point first runs with the right
dtypes, so a row fails if the refusal comes from anything but the dtype.

Legend: B batch rows, S positions, T tokens, L layers, K top-k, V vocabulary.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest
import torch

from moe_replay.corrections import aggregate_loss, apply_corrections, masked_mean, reinforce_loss
from moe_replay.metrics import (
    InputDtypeError,
    logprob_mismatch_metrics,
    mismatch_metrics,
    normalized_ess,
    route_flip_metrics,
    support_coverage_metrics,
)

TRAIN_BS = torch.tensor([[-1.0, -2.5, -0.5], [-0.3, -3.0, -1.0]])
ROLLOUT_BS = torch.tensor([[-1.5, -2.0, -0.5], [-0.3, -2.0, -1.0]])
MASK_BS = torch.tensor([[True, True, True], [True, True, False]])
ROUTES_TLK = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[2, 0], [1, 3]]])
LOGITS_TV = torch.tensor([[0.5, 1.0, -1.0, 0.0], [2.0, 0.0, 0.0, -3.0]])
SUPPORT_TV = torch.tensor([[True, True, False, False], [False, False, False, True]])


def _result():
    return apply_corrections(["tis"], TRAIN_BS, ROLLOUT_BS, MASK_BS)


ENTRIES: dict[str, tuple[Callable[..., Any], Callable[[], dict[str, Any]]]] = {
    # entry point: (function, its arguments with the right dtypes)
    "logprob_mismatch_metrics": (logprob_mismatch_metrics, lambda: dict(
        train_logprobs_BS=TRAIN_BS, rollout_logprobs_BS=ROLLOUT_BS, response_mask_BS=MASK_BS,
        is_weights_BS=torch.ones(2, 3))),
    "mismatch_metrics": (mismatch_metrics, lambda: dict(
        train_logprobs_BS=TRAIN_BS, rollout_logprobs_BS=ROLLOUT_BS, response_mask_BS=MASK_BS, train_routes=ROUTES_TLK,
        trace_routes=ROUTES_TLK.flip(-1), route_mask=torch.tensor([True, True, False]), train_logits_TV=LOGITS_TV,
        support_TV=SUPPORT_TV, support_row_mask_T=torch.tensor([True, False]))),
    "route_flip_metrics": (route_flip_metrics, lambda: dict(
        train_routes=ROUTES_TLK, trace_routes=ROUTES_TLK.flip(-1), mask=torch.tensor([True, True, False]))),
    "support_coverage_metrics": (support_coverage_metrics, lambda: dict(
        train_logits_TV=LOGITS_TV, support_TV=SUPPORT_TV, row_mask_T=torch.tensor([True, False]))),
    "support_coverage_metrics[csr]": (support_coverage_metrics, lambda: dict(
        train_logits_TV=LOGITS_TV, support_offsets_T1=torch.tensor([0, 2, 3]), support_ids_N=torch.tensor([0, 1, 3]))),
    "normalized_ess": (normalized_ess, lambda: dict(log_weights=TRAIN_BS - ROLLOUT_BS, mask=MASK_BS)),
    "apply_corrections": (apply_corrections, lambda: dict(
        corrections=["tis", "opsm"], train_logprobs_BS=TRAIN_BS, rollout_logprobs_BS=ROLLOUT_BS, response_mask_BS=MASK_BS,
        advantages=torch.tensor([1.0, -1.0]))),
    "reinforce_loss": (reinforce_loss, lambda: dict(policy_logprobs_BS=TRAIN_BS, advantages=torch.tensor([1.0, -1.0]),
                                                    result=_result())),
    "aggregate_loss": (aggregate_loss, lambda: dict(loss_BS=TRAIN_BS.neg(), keep_BS=MASK_BS)),
    "masked_mean": (masked_mean, lambda: dict(values=TRAIN_BS, mask=MASK_BS)),
}

FLOAT = "a floating-point torch.Tensor"
BOOL = "a torch.bool mask"
INT = "an integer torch.Tensor"
ROWS = [
    # (entry point, argument, wrong dtype, expected)
    ("logprob_mismatch_metrics", "train_logprobs_BS", torch.int64, FLOAT),
    ("logprob_mismatch_metrics", "rollout_logprobs_BS", torch.int32, FLOAT),
    ("logprob_mismatch_metrics", "response_mask_BS", torch.float32, BOOL),
    ("logprob_mismatch_metrics", "response_mask_BS", torch.int64, BOOL),
    ("logprob_mismatch_metrics", "is_weights_BS", torch.int64, FLOAT),
    ("mismatch_metrics", "train_logprobs_BS", torch.int64, FLOAT),
    ("mismatch_metrics", "response_mask_BS", torch.float64, BOOL),
    ("mismatch_metrics", "route_mask", torch.float32, BOOL),
    ("mismatch_metrics", "train_routes", torch.float32, INT),
    ("mismatch_metrics", "train_logits_TV", torch.int64, FLOAT),
    ("mismatch_metrics", "support_TV", torch.float32, BOOL),
    ("mismatch_metrics", "support_row_mask_T", torch.int64, BOOL),
    ("route_flip_metrics", "train_routes", torch.float32, INT),
    ("route_flip_metrics", "trace_routes", torch.bool, INT),
    ("route_flip_metrics", "mask", torch.float32, BOOL),
    ("support_coverage_metrics", "train_logits_TV", torch.int64, FLOAT),
    ("support_coverage_metrics", "support_TV", torch.float32, BOOL),
    ("support_coverage_metrics", "row_mask_T", torch.int64, BOOL),
    ("support_coverage_metrics[csr]", "support_offsets_T1", torch.float32, INT),
    ("support_coverage_metrics[csr]", "support_ids_N", torch.float64, INT),
    ("normalized_ess", "log_weights", torch.int64, FLOAT),
    ("normalized_ess", "mask", torch.float32, BOOL),
    ("apply_corrections", "train_logprobs_BS", torch.int64, FLOAT),
    ("apply_corrections", "rollout_logprobs_BS", torch.int64, FLOAT),
    ("apply_corrections", "response_mask_BS", torch.float32, BOOL),
    ("apply_corrections", "response_mask_BS", torch.int64, BOOL),
    ("apply_corrections", "advantages", torch.int64, FLOAT),
    ("reinforce_loss", "policy_logprobs_BS", torch.int64, FLOAT),
    ("reinforce_loss", "advantages", torch.int64, FLOAT),
    ("aggregate_loss", "loss_BS", torch.int64, FLOAT),
    ("aggregate_loss", "keep_BS", torch.float32, BOOL),
    ("masked_mean", "values", torch.int64, FLOAT),
    ("masked_mean", "mask", torch.int64, BOOL),
]


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_right_dtypes_run(entry):
    fn, args = ENTRIES[entry]
    fn(**args())


def test_every_entry_point_has_a_row():
    assert {row[0] for row in ROWS} == set(ENTRIES)


@pytest.mark.parametrize("entry,name,dtype,expected", ROWS, ids=[f"{e}-{n}-{str(d)[6:]}" for e, n, d, _ in ROWS])
def test_wrong_dtype_is_refused_by_name(entry, name, dtype, expected):
    fn, args = ENTRIES[entry]
    kw = args()
    kw[name] = kw[name].to(dtype)
    field = entry.split("[")[0]
    match = rf"field '{re.escape(field)}\({name}\)': expected {re.escape(expected)}.*, found dtype {re.escape(str(dtype))}"
    with pytest.raises(InputDtypeError, match=match) as e:
        fn(**kw)
    assert isinstance(e.value, TypeError) and e.value.found == f"dtype {dtype}"


def test_int_logprobs_no_longer_read_as_zero_mismatch():
    """The silent case: logprobs rounded to integers, equal on both sides, gave k3 = 0 and kl = 0."""
    train, rollout = torch.tensor([[-1.4, -2.2]]), torch.tensor([[-0.6, -1.8]])
    m = logprob_mismatch_metrics(train, rollout, torch.ones(1, 2, dtype=torch.bool))
    assert m["rollout_corr/k3_kl"] > 0.05  # the float values differ by 0.8 and 0.4 nats
    with pytest.raises(InputDtypeError, match="train_logprobs_BS"):
        logprob_mismatch_metrics(train.long(), rollout.long(), torch.ones(1, 2, dtype=torch.bool))


def test_a_non_tensor_is_named_too():
    with pytest.raises(InputDtypeError, match=r"masked_mean\(mask\)': expected a torch.bool mask.*found a list"):
        masked_mean(TRAIN_BS, [[True, True, True], [True, True, False]])
