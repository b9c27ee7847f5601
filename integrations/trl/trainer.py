"""`MoeReplayGRPOTrainer`: TRL's GRPOTrainer with a moe_replay preset switched on.

    trainer = MoeReplayGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(use_vllm=True, ...),
                                   train_dataset=ds, moe_replay="r3_support")

What changes against TRL's own trainer (everything else is TRL's code, unchanged):
  * rollouts: TRL's colocated `vllm.LLM` generates through moe_replay's capture (rollout.py), one
    trace per completion; the traces travel with TRL's batch dict (`moe_replay_traces`), through its
    shuffles and splits, to every forward that scores those completions;
  * weight sync: TRL's own, then the vLLM-CPU MoE repack it lacks (a no-op on GPU builds);
  * scoring: `_get_per_token_logps_and_entropies` (π_old, π_ref and the training forward alike) is
    checked against the traces, replayed and renormalised over the supports (scoring.py); the
    replay session stays open across TRL's backward, so activation recompute gets the same routes;
  * π_old, when the preset has the estimator: n re-scores on TRL's own engine under the traces'
    routes and kept sets replace TRL's trainer recompute (`old_per_token_logps`);
  * corrections: the preset's corrections (TIS, IcePop, ...) of π_old against the engine's
    logprobs fill TRL's importance-sampling slot (`importance_sampling_ratio`) in place of TRL's
    own ratio. A token a correction rejects gets weight 0 there and, as in TRL, stays in the loss
    denominator;
  * audit: a preset with an `audit` section audits the first generation's traces (and every N-th) against
    the trainer's own routing in TRL's precision (`moe_replay.audit`) before training on them; routes that do
    not line up stop the run with RouteAlignmentError naming the cause;
  * metrics: verl-named `rollout_corr/*` and `moe_replay/*` (route flips, corrections) go into
    TRL's own metric log, measured once per generation on the π_old pass (or the first training
    micro-batch when TRL computes no π_old).
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...audit.schedule import AuditSchedule, audit_metrics
from ...corrections import apply_corrections
from ...enablement import enable
from ...extras import require
from ...presets import Preset, load_preset
from . import rollout
from .options import TrlOptionError, check_options
from .scoring import to_columns, score_chunk

require("trl", "moe_replay.integrations.trl.MoeReplayGRPOTrainer")  # a typed error naming the extra, not trl's traceback
from trl import GRPOTrainer  # noqa: E402
from trl.extras.profiling import profiling_context  # noqa: E402

TRACES_KEY = "moe_replay_traces"
"""Key of the per-row trace list in TRL's batch dict."""

_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
               "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


class MoeReplayGRPOTrainer(GRPOTrainer):
    """GRPOTrainer plus `moe_replay=<preset>` (a name from moe_replay's configs, a YAML path, or a Preset)."""

    def __init__(self, *args: Any, moe_replay: str | Path | Preset = "r3_support", **kwargs: Any) -> None:
        preset = moe_replay if isinstance(moe_replay, Preset) else load_preset(moe_replay)
        bound = inspect.signature(GRPOTrainer.__init__).bind(None, *args, **kwargs).arguments
        check_options(bound.get("args"), bound, preset)
        if isinstance(bound.get("model"), torch.nn.Module):  # an unsupported family fails before vLLM starts
            enable(preset, model=bound["model"])
        with rollout.engine_options(preset):
            super().__init__(*args, **kwargs)
        self.moe_replay_preset = preset
        self._mr = enable(preset, llm=self.vllm_generation.llm, model=self._mr_hf(self.model))
        self._mr_llm = rollout.attach(self.vllm_generation, self._mr.capture)
        self._mr_stack: contextlib.ExitStack | None = None
        self._mr_rows: list | None = None  # traces of the batch being scored, row order
        self._mr_generating = False
        self._mr_measure_next = False
        self._mr_audit = AuditSchedule(preset.audit)

    # -- rollout ---------------------------------------------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.state.global_step != self._last_loaded_step:  # TRL's test, so TRL then skips its own sync
            with profiling_context(self, "sync_weights"):
                rollout.sync_weights(self.vllm_generation, self._mr_llm._llm)
            self._last_loaded_step = self.state.global_step
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def _generate_and_score_completions(self, inputs):
        leftover = self._mr_llm.take()
        if leftover:
            raise RuntimeError(f"moe_replay: {len(leftover)} traces from an earlier generate call were never scored")
        self._mr_generating, self._mr_rows, self._mr_measure_next = True, None, True
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self._mr_generating = False
        traces = self._mr_rows if self._mr_rows is not None else self._mr_llm.take()
        self._mr_rows = None
        _check_count(traces, out["completion_ids"].shape[0])
        if self._mr_audit.next_batch():  # the preset's audit: stop before training on misaligned routes
            hf = self._mr_hf(self.model)
            self._mr_log(audit_metrics(self._mr_audit.run(hf, traces, context=self.accelerator.autocast,
                                                          device=next(hf.parameters()).device)))
        out[TRACES_KEY] = traces
        stale = _mask_stale(out["completion_mask"], traces)
        if stale:
            self._mr_log({"moe_replay/stale_tokens": float(stale)})
        if self._mr.scorer is not None:
            self._estimate_pi_old(out, traces)
        if self.moe_replay_preset.corrections and "importance_sampling_ratio" in out:
            self._apply_corrections(out, traces)
        return out

    def _estimate_pi_old(self, out: dict, traces: list) -> None:
        """π_old from n re-scorings on TRL's own engine (the preset's estimator) in place of TRL's
        trainer recompute: the ratio π_θ / π_old and the corrections then measure against the
        engine that sampled, under its recorded experts and kept sets."""
        with profiling_context(self, "moe_replay_pi_old"):
            est_G = self._mr.pi_old(traces)
        cols = out["completion_ids"].shape[1]
        est_BC = _columns([est_G[a:b] for a, b in _spans(traces)], cols)
        trainer_BC = out.get("old_per_token_logps")
        if trainer_BC is not None:  # how far the trainer's own recompute is from the estimate
            mask_BC = out["completion_mask"].bool().cpu()
            d_BC = (trainer_BC.double().cpu() - est_BC)[mask_BC]
            self._mr_log({"moe_replay/k3_kl_vs_pi_old": float((torch.exp(-d_BC) - 1 + d_BC).mean()),
                          "moe_replay/pi_old_replicas": float(self.moe_replay_preset.estimator.config.n)})
        dtype = trainer_BC.dtype if trainer_BC is not None else torch.float32
        out["old_per_token_logps"] = est_BC.to(out["completion_ids"].device, dtype)

    def _apply_corrections(self, out: dict, traces: list) -> None:
        """The preset's corrections of π_old vs the engine, in TRL's importance_sampling_ratio slot."""
        old_BC = out["old_per_token_logps"]
        rollout_BC = _columns([t.logprobs_G for t in traces], old_BC.shape[1])
        res = apply_corrections(self.moe_replay_preset.corrections, old_BC.double().cpu(), rollout_BC,
                                out["completion_mask"].bool().cpu())
        out["importance_sampling_ratio"] = (res.weights_BS * res.keep_BS).to(old_BC.device, old_BC.dtype)
        self._mr_log(res.metrics)

    # -- training --------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch):
        with contextlib.ExitStack() as stack:  # replay sessions close after TRL's backward
            self._mr_stack = stack
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._mr_stack = None

    def _compute_loss(self, model, inputs):
        if TRACES_KEY not in inputs:
            raise KeyError(f"moe_replay: the batch has no {TRACES_KEY!r}; it was not generated by this trainer")
        self._mr_rows = inputs[TRACES_KEY]
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._mr_rows = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given:
            raise TrlOptionError("multimodal inputs", given, "text-only batches",
                                 "moe_replay's batch plan lays out token ids only")
        if self._mr_generating and self._mr_rows is None:
            self._mr_rows = self._mr_llm.take()  # this generation's traces, completion order
        traces = self._mr_rows
        if traces is None:
            raise RuntimeError("moe_replay: scoring outside a generated batch (no traces in scope)")
        _check_count(traces, input_ids.size(0))
        hf = self._mr_hf(model)
        measure = self._mr_measure_next and hf is self._mr.model
        b_count = input_ids.size(0)
        step = batch_size or b_count
        logps, entropies, aux = [], [], []
        for start in range(0, b_count, step):
            end = min(start + step, b_count)
            keep_open = torch.is_grad_enabled() and self._mr_stack is not None
            with contextlib.ExitStack() as local:
                res = score_chunk(model, hf, traces[start:end], input_ids[start:end], attention_mask[start:end],
                                  logits_to_keep, preset=self.moe_replay_preset, geometry=self._mr.geometry,
                                  stack=self._mr_stack if keep_open else local, autocast=self.accelerator.autocast,
                                  compute_aux_loss=compute_aux_loss, measure=measure)
            logps.append(res.logps_BC)
            entropies.append(res.entropy_BC)
            if res.aux_loss is not None:
                aux.append(res.aux_loss)
            if measure:
                self._mr_log(res.metrics)
        if measure:
            self._mr_measure_next = False
        return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None,
                torch.stack(aux).mean() if compute_aux_loss else None)

    # -- helpers ---------------------------------------------------------------------------------
    def _mr_hf(self, model: Any) -> torch.nn.Module:
        """The HF model under accelerate / PEFT wrappers (where the routers live)."""
        hf = self.accelerator.unwrap_model(model)
        return hf.get_base_model() if hasattr(hf, "get_base_model") else hf

    def _mr_log(self, metrics: dict[str, float]) -> None:
        mode = "train" if self.model.training else "eval"
        for key, value in metrics.items():
            self._metrics[mode][key].append(float(value))

    def close_moe_replay(self) -> None:
        """Give TRL its engine back and detach capture from it."""
        rollout.detach(self.vllm_generation)
        self._mr.close()


def _spans(traces: list) -> list[tuple[int, int]]:
    """Each trace's [start, end) in a flat [G] array of the batch's generated tokens."""
    ends = np.cumsum([t.num_generated for t in traces])
    return list(zip(np.concatenate([[0], ends[:-1]]).tolist(), ends.tolist()))


def _columns(rows_G: list, cols: int) -> torch.Tensor:
    """Per-row float64 values -> TRL's [B, C] completion layout (zeros after each row's end)."""
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows_G])])
    return to_columns(torch.from_numpy(np.concatenate(rows_G).astype(np.float64)), offsets, cols)


def _check_count(traces: list, rows: int) -> None:
    if len(traces) != rows:
        raise RuntimeError(f"moe_replay: the batch has {rows} completions but {len(traces)} traces; "
                           "every completion must come from the captured engine")


def _mask_stale(completion_mask_BC: torch.Tensor, traces: list) -> int:
    """The rule for tokens sampled before a route they depended on was changed by a later forward
    (`moe_replay.trace.Rerouted`: a recompute preemption's re-prefill): masked from TRL's loss, as
    TRL masks a truncated completion. Completion column g is generated row g. Returns how many."""
    count = 0
    for b, t in enumerate(traces):
        if t.rerouted is None or not t.rerouted.stale:
            continue
        cols = torch.as_tensor([g for g in t.rerouted.stale if g < completion_mask_BC.shape[1]], dtype=torch.long)
        count += int(completion_mask_BC[b, cols].bool().sum())
        completion_mask_BC[b, cols.to(completion_mask_BC.device)] = 0
    return count
