"""`MoeReplayFSDPEngine`: verl's FSDP language-model engine with a moe_replay preset switched on.

Switched on from verl's own config (see this package's docstring): the engine reads the preset
name from `model.override_config.moe_replay`; without one it is verl's engine, unchanged.

What changes against verl's `FSDPEngineWithLMHead` (everything else is verl's code):
  * every forward of the actor (compute_log_prob / π_old, and each update micro-batch's forward
    and backward) is checked against the samples' traces before it runs (`build_plan`: each row's
    tokens, length and order, the sampled token in its support) and runs under the traces' expert
    ids (`integrations/hf/replay.py`, the code the TRL adapter uses) when the preset replays routes;
  * the log-probs and entropies verl's loss reads come from moe_replay's scoring alone (scoring.py:
    verl's `prepare_model_outputs` and its full-vocabulary pass are not run), renormalised over
    each generated token's kept set when the preset replays supports, at the trace's temperature,
    which must be verl's;
  * moe_replay's metrics (verl's `rollout_corr/*` names, `moe_replay/route_*`) join the
    micro-batch metrics verl already aggregates;
  * a preset with an `audit` section audits the batch's traces against the actor's own routing (in verl's
    precision, before its first micro-batch runs) on the first batch (`forward_backward_batch` call:
    compute_log_prob, each update mini-batch) and every N-th; misaligned routes stop the step with
    RouteAlignmentError, on every data-parallel rank (moe_replay/audit/schedule.py).

A replay session stays open from its micro-batch's forward until the next micro-batch starts (or
the batch ends): verl runs the backward in between, so activation recompute inside backward gets
the same routes (invariant 6).

Legend: B rows of a micro-batch, S padded columns, N = B * S, G generated tokens, T routed
positions, L MoE layers, K top-k.
"""

from __future__ import annotations

import contextlib
import sys
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import detach_tree

from ...audit.schedule import AuditSchedule, audit_metrics
from ...enablement import TrainBatch
from ...presets import Preset, load_preset
from ...replay import build_plan
from .batch import traces_of
from .layout import nested_index_G, pack_plan, padded_batch
from .options import VerlOptionError, check_engine
from .scoring import verl_outputs

PRESET_KEY = "moe_replay"
"""Key in verl's `model.override_config` naming the preset (a configs/ name or a YAML path)."""


def preset_of(model_config: Any) -> Preset | None:
    """The preset a verl model config asks for, or None."""
    name = (model_config.override_config or {}).get(PRESET_KEY)
    if name is None or isinstance(name, Preset):
        return name
    return load_preset(str(name))


class MoeReplayFSDPEngine(FSDPEngineWithLMHead):
    """verl's FSDP actor engine; with `override_config.moe_replay` set, under that preset."""

    def __init__(self, model_config: Any, engine_config: Any, optimizer_config: Any, checkpoint_config: Any) -> None:
        self.moe_replay_preset = preset_of(model_config)
        if self.moe_replay_preset is not None:  # before verl builds anything
            check_engine(model_config, engine_config, self.moe_replay_preset)
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self._mr_geometry = None
        self._mr_open: contextlib.ExitStack | None = None
        self._mr_decoded: dict[bytes, Any] = {}
        """Decoded traces of the current batch by encoded record (batch.traces_of's cache)."""
        self._mr_audit = AuditSchedule(self.moe_replay_preset.audit) if self.moe_replay_preset is not None else None
        self._mr_audit_metrics: dict[str, float] = {}

    def initialize(self) -> None:
        super().initialize()
        if self.moe_replay_preset is not None:
            from ...enablement import trainer_geometry

            self._mr_geometry = trainer_geometry(self.module, self.moe_replay_preset)  # refuses an unsupported family

    # -- verl's batch loop -----------------------------------------------------------------------
    def forward_backward_batch(self, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        if self.moe_replay_preset is None:
            return super().forward_backward_batch(data, loss_function, forward_only)
        entries = traces_of(data, decode=False)  # every sample has its trace, before any micro-batch runs
        # keep the decoded traces this batch shares with the last one (π_old, then the update)
        kept = [bytes(e) for e in entries if isinstance(e, (bytes, bytearray))]
        self._mr_decoded = {rec: self._mr_decoded[rec] for rec in kept if rec in self._mr_decoded}
        if self._mr_audit.next_batch():  # the preset's audit: stop before this batch trains on misaligned routes
            report = self._mr_audit.run(self.module, traces_of(data, cache=self._mr_decoded), context=self._mr_autocast,
                                        group=self.get_data_parallel_group(), device=get_device_id())
            self._mr_audit_metrics = audit_metrics(report)
        try:
            out = super().forward_backward_batch(data, loss_function, forward_only)
        except BaseException:
            self._close_session(*sys.exc_info())
            raise
        self._close_session()
        return out

    def _mr_autocast(self) -> Any:
        """verl's forward precision: bf16 autocast unless the engine runs fp32 (`_autocast_dtype`)."""
        dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        return nullcontext() if dtype == torch.float32 else torch.autocast(device_type=get_device_name(), dtype=dtype)

    def _close_session(self, *exc: Any) -> None:
        """Close the last micro-batch's replay session (its backward has run)."""
        stack, self._mr_open = self._mr_open, None
        if stack is not None:
            stack.__exit__(*(exc or (None, None, None)))

    def forward_step(self, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        if self.moe_replay_preset is None:
            return super().forward_step(micro_batch, loss_function, forward_only)
        self._close_session()  # the previous micro-batch's forward and backward are done
        preset = self.moe_replay_preset
        micro_batch = micro_batch.to(get_device_id())
        traces = traces_of(micro_batch, cache=self._mr_decoded)
        model_inputs, output_args = self.prepare_model_inputs(micro_batch=micro_batch)
        _check_temperature(micro_batch["temperature"], traces)

        offsets_B1 = micro_batch["input_ids"].offsets().cpu()
        packed = model_inputs.get("attention_mask") is None  # verl's remove-padding layout
        if packed and output_args.get("pad_size"):
            raise VerlOptionError("packed pad_size", output_args["pad_size"], "0",
                                  "padding appended to the packed row holds positions no trace has")
        if packed:
            ids_BS, mask_BS = padded_batch(offsets_B1, micro_batch["input_ids"].values().cpu())
        else:
            ids_BS, mask_BS = model_inputs["input_ids"].detach().cpu(), model_inputs["attention_mask"].detach().cpu()
        with_routes = preset.replay.routes or all(t.routes_TLK is not None for t in traces)
        plan = build_plan(traces, self._mr_geometry, input_ids_BS=ids_BS, attention_mask_BS=mask_BS,
                          config=preset.replay.plan, routes=with_routes)
        temperature_G = plan.temperature_G
        if packed:
            plan = pack_plan(plan, offsets_B1)
        stack = contextlib.ExitStack()
        self._mr_open = stack
        session = free = None
        if preset.replay.routes:
            from ..hf.replay import replay

            session = stack.enter_context(replay(self.module, plan, record_routes=True))
            plan = session.plan
        elif with_routes:
            from ..hf.replay import capture_routes

            free = stack.enter_context(capture_routes(self.module))

        with self._mr_autocast():
            raw_output = self.module(**model_inputs, use_cache=False)
            # verl's prepare_model_outputs is not called: moe_replay scores once, where verl reads (scoring.py)
            model_output, scores = verl_outputs(
                raw_output.logits, plan, micro_batch, offsets_B1, nested_index_G(plan, offsets_B1, packed), packed,
                temperature_G=temperature_G, use_support=preset.replay.support,
                entropy=bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)))
            if loss_function is not None:
                loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                              dp_group=self.get_data_parallel_group())
            else:
                loss, metrics = torch.tensor(1.0, device=get_device_name()), {}
        if free is not None:
            stack.close()  # nothing replayed: the free-routing capture is not needed in backward
            self._mr_open = None
        ran = session.routes.used_ids if session is not None else free
        metrics = dict(metrics)
        metrics.update(TrainBatch(preset, plan, traces).mismatch_metrics(scores.logprobs_G.detach(), ran))
        metrics.update(self._mr_audit_metrics)  # the last audit's figures, with the batch it checked
        self._mr_audit_metrics = {}
        return loss, {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}


def _check_temperature(temperature: Any, traces: list) -> None:
    """verl scales the logits by its rollout temperature; moe_replay scores at the trace's: they must agree
    (checked for all rows at once, one comparison instead of one per row)."""
    mine_B = np.broadcast_to(np.asarray(temperature.detach().cpu() if isinstance(temperature, torch.Tensor) else temperature,
                                        dtype=np.float64).reshape(-1), (len(traces),))
    theirs_B = np.array([t.sampling.temperature for t in traces], dtype=np.float64)
    bad = np.flatnonzero(~np.isclose(mine_B, theirs_B, rtol=0, atol=1e-6))
    if len(bad):
        b = int(bad[0])
        raise VerlOptionError("actor_rollout_ref.rollout.temperature", float(mine_B[b]),
                              f"{theirs_B[b]} (the temperature trace {traces[b].key!r} was sampled at)",
                              "the trainer must score at the sampler's temperature")

