"""vLLM's routed-experts capture test assertions, ported to this project's capture buffers and traces.

Source: vllm-project/vllm, tests/model_executor/test_routed_experts_capture.py. Each test names the
vLLM test function whose assertion it ports. vLLM's capturer keeps int32 ids in a device buffer and
hands out snapshots in the narrowest dtype (uint8 up to 256 experts, uint16 above). This project
has the same two layers: the step buffer a router's capture function writes into
(`route_hook.StepRoutes`, one id per token-layer-slot plus an "unwritten" sentinel) and the trace's
routes (`ModelGeometry.route_dtype`, what the codec stores). Routing is vLLM's own CPU router
(`CPURouter.select_experts`, which calls the capture function vLLM's `BaseRouter` exposes), not a
stand-in; no engine is started.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import dataclasses  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("vllm")

from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter  # noqa: E402
from vllm.outputs import CompletionOutput  # noqa: E402

from moe_replay.capture_config import CaptureConfig  # noqa: E402
from moe_replay.codec.record import decode_trace, encode_trace  # noqa: E402
from moe_replay.codec.routes import ROUTE_CODECS  # noqa: E402
from moe_replay.errors import TraceFormatError  # noqa: E402
from moe_replay.geometry import EngineInfo, ModelGeometry, route_dtype  # noqa: E402
from moe_replay.integrations.vllm.capture.assemble import build_trace  # noqa: E402
from moe_replay.integrations.vllm.capture.route_hook import StepRoutes, torch_route_dtype  # noqa: E402
from moe_replay.integrations.vllm.errors import CaptureAlignmentError  # noqa: E402
from moe_replay.integrations.vllm.wire import CaptureRecord  # noqa: E402
from moe_replay.trace import RolloutTrace  # noqa: E402

TOP_K = 2


def _geometry(num_experts: int) -> ModelGeometry:
    return ModelGeometry(num_layers=3, moe_layer_ids=(0, 1, 2), num_experts=num_experts, top_k=TOP_K, vocab_size=512,
                         family="test")


def _step_routes(num_experts: int, rows: int = 8, layers: int = 3) -> tuple[StepRoutes, list[CPURouter]]:
    """A real step buffer bound to real vLLM CPU routers (one per MoE layer)."""
    routers = [CPURouter(top_k=TOP_K, global_num_experts=num_experts) for _ in range(layers)]
    return StepRoutes([(j, SimpleNamespace(router=r)) for j, r in enumerate(routers)], rows, torch.device("cpu")), routers


def _route(router: CPURouter, ids_TK: list[list[int]], num_experts: int) -> torch.Tensor:
    """Run vLLM's router on logits whose top-2 are `ids_TK` (first id strongest); returns its ids."""
    logits = torch.full((len(ids_TK), num_experts), -10.0)
    for t, (a, b) in enumerate(ids_TK):
        logits[t, a], logits[t, b] = 5.0, 4.0
    _, ids = router.select_experts(hidden_states=torch.zeros(len(ids_TK), 8), router_logits=logits)
    assert ids.tolist() == ids_TK
    return ids


@pytest.mark.parametrize(("num_experts", "dtype_name"), [(256, "uint8"), (257, "uint16")])
def test_output_profile_is_the_narrowest_dtype(num_experts, dtype_name):
    """vLLM test_routed_experts_capturer_exposes_output_profile: 256 experts -> uint8, 257 ->
    uint16, per-token shape (layers, top_k), buffer [max_tokens, layers, top_k]. Ported: the
    trace's route dtype and the narrow codec's width follow the same rule; the step buffer has the
    same shape and a dtype that holds every id and its sentinel."""
    geom = _geometry(num_experts)
    assert route_dtype(num_experts) == np.dtype(dtype_name) == geom.route_dtype
    width = np.dtype(dtype_name).itemsize
    data, _ = ROUTE_CODECS.get("narrow").encode(np.zeros((4, 3, TOP_K), dtype=geom.route_dtype), num_experts)
    assert len(data) == 4 * 3 * TOP_K * width
    step, _ = _step_routes(num_experts)
    assert tuple(step.step_TLK.shape) == (8, 3, TOP_K)
    assert step.sentinel > num_experts - 1 and torch.iinfo(step.dtype).max >= step.sentinel
    # the in-forward dtype of the ids alone (no sentinel) is as narrow as vLLM's snapshot
    assert torch_route_dtype(num_experts).itemsize == width


@pytest.mark.parametrize(("num_experts", "high"), [(256, [254, 255]), (257, [255, 256])])
def test_captured_ids_narrow_exactly_and_are_copied(num_experts, high):
    """vLLM test_routed_experts_capturer_narrows_snapshot: ids [[1, 2], [254, 255]] captured into the
    int32 buffer come out of the uint8/uint16 snapshot unchanged, in a copy (another data pointer).
    Ported: vLLM's router routes those ids (and the largest ids at 257 experts) into the step buffer,
    the trace holds them in its narrow dtype, in its own memory, and both trace codecs round-trip
    them exactly."""
    geom = _geometry(num_experts)
    step, routers = _step_routes(num_experts)
    want = [[1, 2], high, [0, num_experts - 1]]
    step.arm(len(want))
    for r in routers:
        _route(r, want, num_experts)
    rows_TLK = step.step_TLK[: len(want)]
    assert rows_TLK.dtype == step.dtype and rows_TLK[:, 0].tolist() == want
    routes = rows_TLK.numpy().astype(geom.route_dtype)  # what a flush hands to the record
    assert routes.dtype == geom.route_dtype and routes[:, 0].tolist() == want
    assert not np.shares_memory(routes, step.step_TLK.numpy())
    trace = RolloutTrace(key="r", token_ids_S=np.arange(len(want) + 1), prompt_len=2, geometry=geom, routes_TLK=routes,
                         engine=EngineInfo(name="vllm")).validate()
    for codec in ("narrow", "moe_replay", "int32"):
        back = decode_trace(encode_trace(trace, route_codec=codec))
        assert back.routes_TLK.dtype == geom.route_dtype and np.array_equal(back.routes_TLK, routes), codec


def test_rows_the_step_did_not_route_stay_unwritten():
    """vLLM test_routed_experts_capturer_single_dp_no_metadata: capture writes the routed rows and
    leaves the next row at its fill value (-1). Ported: rows armed for a step but not routed keep
    the sentinel (never an expert id, never 0), so a missing row is detectable."""
    step, routers = _step_routes(16)
    step.arm(4)
    for r in routers:
        _route(r, [[1, 2], [3, 4], [5, 6]], 16)
    assert step.step_TLK[:3, :, :].tolist() == [[[1, 2]] * 3, [[3, 4]] * 3, [[5, 6]] * 3]
    assert bool((step.step_TLK[3] == step.sentinel).all())


def test_a_batch_larger_than_the_buffer_fails_and_writes_nothing():
    """vLLM test_routed_experts_capturer_dp_unexpected_batch_raises: a topk batch dimension that
    matches no layout fails fast and the buffer keeps its fill value. Ported to the in-forward
    step: a router batch with more rows than the step buffer raises inside the capture function
    (torch's shape check; the buffer covers the largest forward the runner makes) and no row is
    written."""
    step, routers = _step_routes(16, rows=2, layers=1)
    step.arm(2)
    with pytest.raises(RuntimeError, match="size"):
        _route(routers[0], [[1, 2], [3, 4], [5, 6]], 16)
    assert bool((step.step_TLK == step.sentinel).all())


def test_routes_that_do_not_match_the_tokens_raise_typed_errors():
    """vLLM test_routed_experts_capturer_dp_unexpected_batch_raises, at the record boundary: routes
    whose row count disagrees with the request's tokens are refused with a typed error naming the
    request, never padded or truncated: the worker record (CaptureAlignmentError, from
    `build_trace`) and the trace itself (TraceFormatError naming routes_TLK)."""
    geom = _geometry(8)
    prompt, gen = [5, 6, 7], [8, 9]
    S = len(prompt) + len(gen)
    routes = np.tile(np.array([0, 1], dtype=geom.route_dtype), (S - 1, 3, 1))
    completion = CompletionOutput(index=0, text="", token_ids=gen, cumulative_logprob=None, logprobs=None,
                                  finish_reason="length")

    def record(rows: int) -> CaptureRecord:
        return CaptureRecord(status="ok", key="req-1", req_id="req-1", prompt_len=len(prompt), route_start=0,
                             routes_TLK=routes[:rows], routes_filled_T=np.ones(rows, dtype=bool),
                             tokens_G=np.array(gen), logprobs_G=np.zeros(len(gen), np.float32),
                             support_sizes_G=np.zeros(0, np.int64), support_offsets_G1=np.zeros(1, np.int64),
                             support_ids_N=np.zeros(0, np.int32))

    cfg = CaptureConfig(support=False, logprobs=False)
    good = build_trace("req-1", prompt, completion, record(S - 1), geom, cfg, EngineInfo(name="vllm"))
    assert good.routes_TLK.shape == (S - 1, 3, TOP_K)
    with pytest.raises(CaptureAlignmentError, match=r"req-1.*routes cover 2 of 4 positions"):
        build_trace("req-1", prompt, completion, record(2), geom, cfg, EngineInfo(name="vllm"))
    with pytest.raises(TraceFormatError, match="routes_TLK"):
        dataclasses.replace(good, routes_TLK=routes[:2]).validate()
    with pytest.raises(TraceFormatError, match="routes_TLK"):
        dataclasses.replace(good, routes_TLK=np.concatenate([routes, routes[:1]])).validate()
