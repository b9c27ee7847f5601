"""One call switches a preset on for a rollout engine and a trainer.

    import moe_replay
    mr = moe_replay.enable("r3_support", llm=llm, model=model)   # vllm.LLM and an HF MoE model
    outputs, traces = mr.generate(prompts, sampling_params)       # capture on
    pi_old_G = mr.pi_old(traces)                                  # multi-sample π_old (or None)
    with mr.train_batch(traces) as batch:                         # replay on (or free routing)
        logits = model(**batch.model_inputs()).logits
        logp_G = batch.logprobs(logits)                           # at each trace's temperature, over its kept support if enabled
        fix = batch.corrections(logp_G.detach())                  # the preset's IS weights / masks
        loss = ...; loss.backward()                               # inside the `with`

`with moe_replay.enable(...) as mr:` detaches capture and scoring from the engine on exit (what
`mr.close()` does; `async with` for an async engine). Whatever the preset leaves off is a no-op,
so one training loop serves every preset. The engine and
the model are served by registered bindings (bindings.py: vLLM `LLM` and `AsyncLLM`; Megatron-core
and Hugging Face models), first match wins; a framework is imported only when its object is given.
An `AsyncLLM` attaches asynchronously: `mr = await moe_replay.enable_async(preset, llm=engine, ...)`,
then `await mr.capture.collect(outputs)`; π_old on it is `EstimatorService(mr.scorer, ...)`.

`mr.weights_version = step` names the weights now in use: capture records it in every trace, and
`train_batch` and `pi_old` (and `mr.scorer`, which it is set on) refuse traces of another version
unless `off_policy=True` (then the corrections' metrics report `moe_replay/off_policy_fraction`);
π_old never averages the rollout's logprobs of one version with re-scorings under another. The
trainer and the scorer run one identity check (moe_replay/identity.py): a trace of another model
(geometry, family included) is a GeometryMismatchError on both.

Legend: G generated tokens of the batch (flat, trace order), B rows, Gm longest row.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from .bindings import ROLLOUT_BINDINGS, TRAINER_BINDINGS, TrainerBinding, binding_for, load_bindings
from .corrections import CorrectionResult, apply_corrections
from .metrics import mismatch_metrics
from .presets import Preset, load_preset
from .replay import RoutePlan, TokenScores, build_plan
from .trace import RolloutTrace


@dataclass
class TrainBatch:
    """One micro-batch of traces under the preset: model inputs, scoring, corrections."""

    preset: Preset
    plan: RoutePlan
    traces: Sequence[RolloutTrace]
    session: Any = None
    """The replay session when the preset replays routes (HF: its `.flips` counts what the
    trainer's router would have chosen differently)."""
    trainer: TrainerBinding | None = None
    """How this model is fed and scored (bindings.py); None: Hugging Face."""

    def _binding(self) -> TrainerBinding:
        if self.trainer is None:
            load_bindings()
        return self.trainer if self.trainer is not None else TRAINER_BINDINGS.get("hf")

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The forward's inputs of the padded batch the plan laid out (HF: input_ids / attention_mask
        / position_ids; Megatron: its GPTModel's)."""
        return self._binding().model_inputs(self.plan)

    def scores(self, logits_BSV: torch.Tensor, temperature: float | torch.Tensor | None = None, *,
               full: bool = False, entropy: bool = True) -> TokenScores:
        """Logprobs and entropy [G] of every generated token, renormalised over the kept support if
        the preset enables it (`full=True` adds the full-vocabulary pair, e.g. for a KL or entropy term).

        The temperature defaults to each trace's recorded one (trace.sampling, written by capture).
        The logits are read in place, in float32 whatever their dtype (no [G, V] copy).
        """
        return self._binding().score(logits_BSV, self.plan, temperature=temperature, use_support=self.preset.replay.support,
                                     full=full, entropy=entropy)

    def logprobs(self, logits_BSV: torch.Tensor, temperature: float | torch.Tensor | None = None) -> torch.Tensor:
        """Logprobs [G] of every generated token (see `scores`; no entropy is computed)."""
        return self.scores(logits_BSV, temperature, entropy=False).logprobs_G

    @property
    def rollout_logprobs(self) -> torch.Tensor:
        """The engine's logprobs [G] of the same tokens (float64)."""
        if self.plan.engine_logprobs_G is None:
            raise ValueError(f"traces {list(self.plan.keys)[:3]} carry no engine logprobs; capture them (capture.logprobs: true)")
        return self.plan.engine_logprobs_G.double()

    def to_rows(self, x_G: torch.Tensor) -> torch.Tensor:
        """Flat [G] -> padded [B, Gm] (zeros in padding), the layout corrections and metrics take."""
        lengths = np.diff(self.plan.gen_offsets_B1)
        rows = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths))
        cols = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]))
        out = torch.zeros((len(lengths), int(lengths.max())), dtype=x_G.dtype, device=x_G.device)
        return out.index_put((rows.to(x_G.device), cols.to(x_G.device)), x_G)

    def row_mask(self) -> torch.Tensor:
        """bool [B, Gm]: True on real generated tokens."""
        return self.to_rows(torch.ones(int(self.plan.gen_offsets_B1[-1]))) > 0

    def mismatch_metrics(self, train_logprobs_G: torch.Tensor, ran_ids: dict[int, torch.Tensor] | None = None) -> dict[str, float]:
        """rollout_corr/* (trainer vs engine logprobs) and, given the expert ids each MoE layer ran
        ({layer id: ids [N, K]}, N = the plan's positions), moe_replay/route_* against the trace's."""
        plan = self.plan
        route_kwargs: dict[str, Any] = {}
        if ran_ids:
            lids = plan.geometry.moe_layer_ids
            routed_N = plan.routed_N.cpu()
            ran_NLK = torch.stack([ran_ids[lid].cpu().reshape(plan.num_positions, -1) for lid in lids], dim=1)
            trace_NLK = plan.ids_LNK.cpu().permute(1, 0, 2)
            route_kwargs = dict(train_routes=ran_NLK[routed_N], trace_routes=trace_NLK[routed_N], layer_ids=lids)
        return mismatch_metrics(self.to_rows(train_logprobs_G.double().cpu()), self.to_rows(self.rollout_logprobs.cpu()),
                                self.row_mask(), **route_kwargs)

    def corrections(self, train_logprobs_G: torch.Tensor, *, reference_G: torch.Tensor | None = None,
                    advantages: torch.Tensor | None = None) -> CorrectionResult:
        """The preset's corrections of `train_logprobs_G` against the engine's (or `reference_G`)."""
        ref = self.rollout_logprobs if reference_G is None else reference_G.double()
        result = apply_corrections(self.preset.corrections, self.to_rows(train_logprobs_G.double()), self.to_rows(ref),
                                   self.row_mask(), advantages=advantages)
        if self.plan.weights_version is not None:  # traces of other weights, accepted with off_policy=True
            result.metrics["moe_replay/off_policy_fraction"] = self.plan.off_policy_fraction
        return result


class Enabled:
    """A preset switched on for an engine (capture, π_old) and/or a trainer model (replay)."""

    def __init__(self, preset: Preset, *, llm: Any = None, model: Any = None, family: str = "") -> None:
        self.preset, self.llm, self.model = preset, llm, model
        self.capture = self.scorer = None
        self.geometry = None
        self.engine_kind = self.trainer_kind = None
        """Names of the bindings serving the engine and the model (bindings.py)."""
        self.trainer: TrainerBinding | None = None
        self._rollout = None
        self._weights_version: str | int | None = None
        if model is not None:
            self.trainer_kind, self.trainer = binding_for(TRAINER_BINDINGS, model, "trainer")
            self.trainer.check_path(preset.replay.trainer_path)
            self.geometry = _trainer_geometry(self.trainer, model, preset, family)
        if llm is not None:
            self.engine_kind, self._rollout = binding_for(ROLLOUT_BINDINGS, llm, "rollout engine")

    def _attached(self, capture: Any, scorer: Any) -> "Enabled":
        self.capture, self.scorer = capture, scorer
        if scorer is not None and self._weights_version is not None:
            self.scorer = scorer.with_weights(self._weights_version)
        if self.geometry is not None:
            self.geometry.check_matches(self.capture.geometry)
        return self

    @property
    def weights_version(self) -> str | int | None:
        """The weights now in use (a step or checkpoint fingerprint); None = not tracked."""
        return self._weights_version

    @weights_version.setter
    def weights_version(self, version: str | int | None) -> None:
        if version is not None and (isinstance(version, bool) or not isinstance(version, (str, int))):
            raise ValueError(f"weights_version must be a str, an int or None, got {version!r}")
        self._weights_version = version
        if self.capture is not None:
            self.capture.weights_version = version
        if self.scorer is not None:  # the scorer scores under the weights now in use (identity.py)
            self.scorer = self.scorer.with_weights(version, self.scorer.off_policy)

    # -- rollout side ----------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: Any = None, *, store: Any = None, **kwargs: Any):
        """`LLM.generate` with capture: (outputs, traces), one trace per sample."""
        if self.capture is None:
            raise ValueError("enable(...) was given no llm: nothing to generate or capture with")
        if self._rollout.is_async:
            raise ValueError(f"{self.engine_kind}: generate with the engine's own async generate, then "
                             "`await mr.capture.collect(outputs, sampling=...)`")
        return self.capture.generate(prompts, sampling_params, store=store, **kwargs)

    def pi_old(self, traces: Sequence[RolloutTrace], *, batch_size: int = 64, off_policy: bool = False) -> np.ndarray | None:
        """Flat [G] log π_old from n engine re-scorings (None when the preset has no estimator).

        Refuses what `train_batch` refuses (moe_replay/identity.py): a trace of another model
        (GeometryMismatchError naming the field, `geometry.family` included) and, with `weights_version`
        set, one sampled under another version (WeightsVersionError) unless `off_policy=True` says to
        score it under the weights now in use on purpose (`estimator.estimate(traces, mr.scorer...)`
        says per rollout which version scored it: PiOldEstimate.weights_version, .off_policy). With
        the preset's rollout_replica, a rollout of another version is refused even so: π_old never
        averages two policies.
        """
        if self.scorer is None:
            return None
        if self._rollout.is_async:
            raise ValueError(f"{self.engine_kind}: estimate π_old with moe_replay.estimator.EstimatorService(mr.scorer, "
                             "preset.estimator.config) (an async scoring backend)")
        from .estimator import estimate

        scorer = self.scorer.with_weights(self.weights_version, off_policy) if off_policy != self.scorer.off_policy else self.scorer
        ests = estimate(traces, scorer, self.preset.estimator.config, batch_size=batch_size)
        return np.concatenate([e.logprob_G for e in ests])

    # -- trainer side ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def train_batch(self, traces: Sequence[RolloutTrace], *, input_ids_BS: torch.Tensor | None = None,
                    attention_mask_BS: torch.Tensor | None = None, track_flips: bool = False,
                    off_policy: bool = False) -> Iterator[TrainBatch]:
        """Replay the traces' routes (if the preset says so) around forward and backward.

        With `weights_version` set, traces sampled with another version are refused
        (WeightsVersionError) unless `off_policy=True` says so on purpose.
        """
        if self.model is None:
            raise ValueError("enable(...) was given no model: nothing to train")
        # routes are laid out whenever the traces carry them (free-routing presets still measure flips)
        with_routes = self.preset.replay.routes or all(t.routes_TLK is not None for t in traces)
        plan = build_plan(traces, self.geometry, input_ids_BS=input_ids_BS, attention_mask_BS=attention_mask_BS,
                          config=self.preset.replay.plan, routes=with_routes, weights_version=self.weights_version,
                          off_policy=off_policy)
        if not self.preset.replay.routes:
            yield TrainBatch(self.preset, plan, traces, trainer=self.trainer)
            return
        with self.trainer.replay(self.model, plan, track_flips, self.preset.replay.trainer_path) as (session, seen_plan):
            yield TrainBatch(self.preset, seen_plan, traces, session, self.trainer)

    def __enter__(self) -> "Enabled":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "Enabled":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._rollout is not None and self._rollout.is_async:
            await self.aclose()
        else:
            self.close()

    def close(self) -> None:
        """Detach capture and scoring hooks from a sync engine (AsyncLLM: `await mr.aclose()`); what
        `with moe_replay.enable(...) as mr:` does on exit (`async with` for an async engine)."""
        if self._rollout is not None and self._rollout.is_async:
            raise ValueError(f"{self.engine_kind}: detach with `await mr.aclose()`")
        for part in (self.scorer, self.capture):
            if part is not None:
                part.uninstall()
        self.capture = self.scorer = None

    async def aclose(self) -> None:
        """Detach capture and scoring hooks from an async engine."""
        for part in (self.scorer, self.capture):
            if part is not None:
                await part.uninstall()
        self.capture = self.scorer = None


def trainer_geometry(model: Any, preset: Preset, family: str = ""):
    """The MoE geometry of a trainer model (HF or Megatron, through its registered binding), or a
    ValueError naming the family when `preset` needs replay and the model has no supported router.
    Trainer adapters (verl's engine) call this before their first forward."""
    _, trainer = binding_for(TRAINER_BINDINGS, model, "trainer")
    return _trainer_geometry(trainer, model, preset, family)


def _trainer_geometry(trainer: TrainerBinding, model: Any, preset: Preset, family: str):
    from .replay.errors import UnsupportedRouterError

    try:
        return trainer.geometry(model, family)
    except UnsupportedRouterError as e:
        family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        need = "replays routes" if preset.replay.routes else "needs the MoE geometry for its traces"
        raise ValueError(f"preset {preset.name!r} {need}, but model family {family!r} has no supported MoE router: {e}. "
                         f"Add a RouterAdapter (moe_replay.integrations.hf.register_router) or train without moe_replay.") from None


def _enabled(preset: str | os.PathLike | Preset, llm: Any, model: Any, family: str) -> Enabled:
    if llm is None and model is None:
        raise ValueError("enable(...) needs an llm (rollout engine), a model (trainer), or both")
    return Enabled(preset if isinstance(preset, Preset) else load_preset(preset), llm=llm, model=model, family=family)


def enable(preset: str | os.PathLike | Preset, *, llm: Any = None, model: Any = None, family: str = "") -> Enabled:
    """Switch `preset` (a name from configs/, a YAML path, or a Preset) on for `llm` and/or `model`.

    `family` names the model family where the model does not (a Megatron model: e.g. 'qwen3_moe'),
    so traces of another family are refused; empty: the model's own, or unknown (matches any).
    An async engine (AsyncLLM) needs `await enable_async(...)`.
    """
    mr = _enabled(preset, llm, model, family)
    if llm is None:
        return mr
    if mr._rollout.is_async:
        raise ValueError(f"enable(...): a {mr.engine_kind} attaches asynchronously; use `await moe_replay.enable_async(...)`")
    return mr._attached(*mr._rollout.attach(llm, mr.preset))


async def enable_async(preset: str | os.PathLike | Preset, *, llm: Any = None, model: Any = None, family: str = "") -> Enabled:
    """`enable` for any engine, awaiting the attachment of async ones (AsyncLLM)."""
    mr = _enabled(preset, llm, model, family)
    if llm is None:
        return mr
    pair = mr._rollout.attach(llm, mr.preset)
    return mr._attached(*(await pair if mr._rollout.is_async else pair))
