"""RL weight sync: a trainer's new weights into a live vLLM engine, in place.

Two ways in, one worker mechanism:
  update_weights(llm, dir)   a save_pretrained checkpoint, read by the engine's own loader (one op);
  weight_sync(llm)           a context around a trainer's own per-tensor loads
                             (`model.load_weights([(name, tensor)])`, TRL's colocated sync).
Both run vLLM's layerwise reload: every layer's parameters go back to the meta device as they were
created, the tensors its weight loaders receive are buffered, and once a layer has all its
elements it is rebuilt (`process_weights_after_loading` included) and copied into the live storage
the compiled forward holds.

Why the reload and not plain per-tensor loads: vLLM-CPU packs linear weights for its GEMM kernel
at load (`dispatch_cpu_unquantized_gemm`) and leaves an empty parameter with no `weight_loader`
in their place: float32 layers on every x86 CPU (oneDNN), bfloat16 layers where oneDNN has bf16
(AVX-512 BF16 or AMX; small ones go to the AMX kernel on AMX CPUs). A plain per-tensor load then
raises "'Parameter' object has no attribute 'weight_loader'"; without AVX-512 BF16 a bf16 layer
keeps its weight (oneDNN refuses, torch's linear runs) and the same load works. The reload
restores the parameters from the metadata recorded at first load, so it works on every ISA.

Two things still go wrong on vLLM-CPU 0.32, both silently:
1. The CPU experts kernel prepacks w13/w2 into its blocked layout only on the first load; a reload
   copies checkpoint-layout values into that storage without prepacking them again (measured: the
   tiny Qwen3-MoE's logprobs moved by up to 13.5 nats after reloading its own checkpoint). We
   re-apply the kernel's own prepack to each CPU MoE layer after the reload (WORKAROUND).
2. A model loader that writes a parameter with a plain `param.copy_` instead of its weight loader
   writes into the meta placeholder during a reload: nothing arrives, and vLLM puts the layer's old
   tensors back (a log line, no error). GPT-OSS's unquantized loader does this for the expert
   weights and biases and the attention sinks (an updated GPT-OSS engine kept its old experts:
   prompt logprobs 0.95 nats from a fresh engine). We watch the reload: a layer with parameters
   that got no element is either loaded directly into its live tensors from the checkpoint keys
   registered for its model type in `PLAIN_COPY_KEYS` (then every parameter of it must have been
   written: they are NaN-filled first, so an element the direct load missed is found, not served),
   or the sync fails with `WeightSyncError` naming the layers. A per-tensor sync has no checkpoint
   to load from, so there such a layer always fails the sync.

vLLM logs, on every sync, records that say nothing new: a warning per tensor an fp32 trainer's
checkpoint casts into a bf16/fp16 engine, "RotaryEmbedding: Failed to load weights" for each rotary
layer (which no checkpoint holds), three INFO lines and a progress bar. Around a sync they are
dropped at their loggers (`EXPECTED_SYNC_LOGS`, moe_replay.expected_logs) and the bar is off; every
other record passes, and MOE_REPLAY_VERBOSE=1 shows all. A multi-process engine logs the prefix
cache reset in its engine core process, where it passes.

After the weights, everything computed with the old ones is dropped: vLLM's prefix cache (KV) and,
when capture is installed, its per-KV-slot route cache, so no cached KV or route crosses a weight
update. Every worker call goes through the adapter's link (link.py: the worker extension's method
where the engine has it, so a multi-process engine needs no pickled function) and replies in the
typed wire (wire.WeightSyncReply; a failure is re-raised as WeightSyncError); the worker side
serves the `weights.*` ops this module registers in runner.OPS.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, Iterator

from ...expected_logs import ExpectedLog, expected_logs, verbose
from .errors import WeightSyncError
from .link import SyncLink
from .runner import OPS, RunnerState, runner_state
from .versions import check_release
from .wire import WeightSyncReply

PLAIN_COPY_KEYS: dict[str, tuple[str, ...]] = {
    # vllm/model_executor/models/gpt_oss.py: _load_weights_other copies these with param.copy_
    "gpt_oss": (
        ".mlp.experts.gate_up_proj",
        ".mlp.experts.gate_up_proj_bias",
        ".mlp.experts.down_proj",
        ".mlp.experts.down_proj_bias",
        ".self_attn.sinks",
    ),
}
"""HF model_type -> checkpoint key suffixes that vLLM 0.32's loader for it writes by plain copy,
bypassing the weight loaders an in-place reload relies on; `update_weights` loads them directly."""

EXPECTED_SYNC_LOGS: tuple[ExpectedLog, ...] = (
    ExpectedLog("vllm.model_executor.models.utils",
                r"Attempted to load weight \S+ with dtype torch\.float32 into parameter with dtype torch\.(bfloat16|float16)",
                "an fp32 trainer's tensors cast into a bf16/fp16 engine: the precision the engine was built with; "
                "15 lines a sync for the 2-layer tiny Qwen3-MoE"),
    ExpectedLog("vllm.model_executor.model_loader.reload.layerwise", r"\w*RotaryEmbedding: Failed to load weights",
                "rotary layers hold a cos/sin cache computed from the config, never a checkpoint tensor, so a "
                "reload puts the engine's own back (a layer that holds checkpoint tensors and gets none fails the "
                "sync with WeightSyncError instead)"),
    ExpectedLog("vllm.model_executor.model_loader.weight_utils", r"Filesystem type for checkpoints: .*",
                "INFO at every checkpoint read: the sync reads one each step"),
    ExpectedLog("vllm.model_executor.model_loader.reload.inplace",
                r"Reloading weights inplace\.\.\.|Reloading and processing weights took [\d.]+ seconds",
                "INFO at every reload (the first, once a process)"),
    ExpectedLog("vllm.v1.core.block_pool", r"Successfully reset prefix cache",
                "INFO at the prefix cache reset that follows every sync (KV of the old weights is dropped)"),
)
"""vLLM's log records that a weight sync (and the engine's first load of an fp32 checkpoint in bf16)
emits as a matter of course: 19 lines a sync for the tiny Qwen3-MoE (15 casts, 1 rotary layer, 3
INFO) and 4 more from the progress bar, switched off; dropped around the sync, every other record
passes."""

__all__ = ["EXPECTED_SYNC_LOGS", "PLAIN_COPY_KEYS", "WeightSyncError", "update_weights", "weight_sync"]


# -- client side ---------------------------------------------------------------------------------
def _open(llm: Any, op: str, payload: Any, what: str) -> tuple[Any, WeightSyncReply | None]:
    link, replies = SyncLink.open(llm, op, payload, what=what, default=WeightSyncError,
                                  kwargs_fn="capture_engine_kwargs")
    return link, (WeightSyncReply.from_dict(replies[0]) if replies and replies[0] is not None else None)


def update_weights(llm: Any, weights_dir: str | os.PathLike) -> WeightSyncReply:
    """Reload `weights_dir` (a save_pretrained checkpoint) into `llm` in place, then reset vLLM's
    prefix cache; the capture's slot route cache is dropped on the workers. Returns what the first
    worker did. Raises WeightSyncError (naming the layers) when any layer kept its old weights."""
    weights_dir = Path(weights_dir)
    if not weights_dir.is_dir():
        raise FileNotFoundError(f"update_weights: expected a checkpoint directory, found {str(weights_dir)!r}")
    _, reply = _open(llm, "weights.update", str(weights_dir.resolve()), f"update_weights({str(weights_dir)!r})")
    with expected_logs(EXPECTED_SYNC_LOGS):  # an in-process engine logs the reset here
        llm.reset_prefix_cache()
    assert reply is not None  # the op always replies
    return reply


@contextlib.contextmanager
def weight_sync(llm: Any, *, reset_prefix_cache: bool = True) -> Iterator[list[WeightSyncReply]]:
    """Bracket a trainer's own per-tensor loads into the in-process engine `llm`:

        with weight_sync(llm) as done:
            for name, t in trainer_params():
                runner_model.load_weights([(name, t)])
        done[0].repacked  # what the worker did

    On exit every layer must have received its tensors (else WeightSyncError naming them: those
    layers still hold the old weights, so the engine must not be sampled from), the CPU MoE
    kernels are repacked and capture's slot routes dropped; `reset_prefix_cache=False` when the
    trainer resets vLLM's prefix cache itself inside the block (TRL does). An exception inside the
    block still closes the reload (the model's parameters leave the meta device) and propagates.
    """
    link, _ = _open(llm, "weights.begin", None, "opening a weight sync")
    done: list[WeightSyncReply] = []
    try:
        with expected_logs(EXPECTED_SYNC_LOGS):  # the trainer's loads run in this process's engine
            yield done
    except BaseException as failure:
        try:
            link.call("weights.end", {"check": False}, what="closing a failed weight sync")
        except Exception as e:  # the trainer's error stays the one raised; the engine's is noted on it
            failure.add_note(f"moe_replay: closing the weight sync also failed ({type(e).__name__}: {e}); "
                             "rebuild the engine before sampling from it")
        raise
    done.append(WeightSyncReply.from_dict(link.call("weights.end", {"check": True}, what="the weight sync")))
    if reset_prefix_cache:
        with expected_logs(EXPECTED_SYNC_LOGS):
            llm.reset_prefix_cache()


# -- worker side ---------------------------------------------------------------------------------
def _repack_cpu_moe(model: Any) -> int:
    """Prepack every CPU MoE layer's freshly reloaded w13/w2; returns layers fixed."""
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not a CPU build: nothing to repair
        return 0
    fixed = 0
    for name, layer in model.named_modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        padded = experts._padded_intermediate_size(experts.moe_config)
        if padded != experts.moe_config.intermediate_size_per_partition:
            raise WeightSyncError(
                f"{name}: weight sync on vLLM-CPU supports MoE intermediate sizes the kernel needs no padding "
                f"for; found {experts.moe_config.intermediate_size_per_partition} (padded to {padded})"
            )
        for attr in ("w13_weight", "w2_weight"):
            param = getattr(layer, attr)
            # the kernel reads `param` and writes a fresh tensor (vllm._custom_ops), so no clone of
            # the input: one full copy of every expert weight less per sync; copied back in place
            # because the compiled forward holds this storage
            param.data.copy_(cpu_prepack_moe_weight(param.data, experts.isa))
        fixed += 1
    return fixed


def _clear_slot_routes(runner: Any) -> bool:
    """Drop capture's per-KV-slot routes, if capture keeps them: they came from the old weights."""
    slot_cache = getattr(runner_state(runner).capture, "slot_cache", None)
    if slot_cache is not None:
        slot_cache.clear()
    return slot_cache is not None


def _checkpoint_params(info: Any) -> list[str]:
    """Names of a layer's parameters in model format (as created before any processing), which
    a checkpoint fills; parameters derived later (MLA's W_UV, W_UK_T) are recomputed, not loaded."""
    from vllm.model_executor.model_loader.reload import meta

    # 0.26 names this set SKIP_TENSORS; from 0.27 it is SKIP_LOAD_TENSORS, and SKIP_TENSORS adds
    # 'bias' (never on meta, but loaded: not to be skipped here). surface/needs.py lists both.
    skip = getattr(meta, "SKIP_LOAD_TENSORS", None)
    skip = meta.SKIP_TENSORS if skip is None else skip
    return [n for n in info.restore_metadata[0] if n not in skip]


def _reload_open(model: Any) -> bool:
    """Whether a layerwise reload is in progress on `model` (vLLM's own bookkeeping says so)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return any(info.can_load() for module in model.modules() if (info := LAYERWISE_INFO.get(module)) is not None)


def _unloaded_layers(model: Any) -> dict[str, tuple[Any, list[str]]]:
    """Layers (name -> (module, checkpoint parameter names)) that a reload in progress has
    buffered nothing for although a checkpoint fills them: their old tensors are about to be put back."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    out = {}
    for name, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        if info is None or not info.can_load() or info.kernel_tensors is None or info.load_numel > 0:
            continue
        params = _checkpoint_params(info)
        if params:
            out[name] = (module, params)
    return out


def _checkpoint_weights(runner: Any, path: str) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors through the engine's own loader, pointing the model config at
    `path` as vLLM's `reload_weights(weights_path=...)` does."""
    from vllm.model_executor.model_loader import get_model_loader

    model_config = runner.vllm_config.model_config
    model_config.model, model_config.model_weights, model_config.revision = path, "", None
    load_config = runner.vllm_config.load_config
    if not verbose():  # the loader's progress bar: 4 lines in a log at every sync
        load_config = dataclasses.replace(load_config, use_tqdm_on_load=False)
    return iter(get_model_loader(load_config).get_all_weights(model_config, runner.get_model()))


def _model_type(runner: Any) -> str:
    return str(getattr(runner.vllm_config.model_config.hf_config, "model_type", "?"))


def _load_directly(runner: Any, unloaded: dict[str, tuple[Any, list[str]]], path: str) -> list[str]:
    """Load the layers the reload left out from the checkpoint keys of PLAIN_COPY_KEYS, straight
    into their live tensors; every parameter of them must then be written. Returns those layers."""
    model_type = _model_type(runner)
    suffixes = PLAIN_COPY_KEYS.get(model_type)
    if suffixes is None:
        raise WeightSyncError(
            f"model type {model_type!r}: vLLM's in-place reload put the old weights back in layers "
            f"{sorted(unloaded)[:6]} (its loader writes them outside the weight loaders); weight sync "
            "does not support this model type: rebuild the engine from the checkpoint instead")
    params = {f"{n}.{p}": getattr(m, p) for n, (m, names) in unloaded.items() for p in names}
    for t in params.values():  # old values are wrong anyway; NaN shows any element left unwritten
        t.data.fill_(float("nan"))
    runner.get_model().load_weights(kv for kv in _checkpoint_weights(runner, path) if kv[0].endswith(suffixes))
    stale = [name for name, t in params.items() if bool(t.data.isnan().any())]
    if stale:
        raise WeightSyncError(
            f"model type {model_type!r}: parameters {stale[:6]} were not written by the reload nor by the "
            f"direct load of {suffixes} (they hold NaN now); do not sample from this engine: rebuild it from the checkpoint")
    return sorted(unloaded)


def _finished(runner: Any, reloaded_directly: list[str]) -> dict[str, Any]:
    return WeightSyncReply(repacked=_repack_cpu_moe(runner.get_model()), reloaded_directly=reloaded_directly,
                           slot_routes_cleared=_clear_slot_routes(runner)).to_dict()


def update_on_worker(runner: Any, path: str) -> dict[str, Any]:
    """Worker side of `update_weights` (op `weights.update`): a WeightSyncReply as a dict."""
    check_release(parts=("weights",))  # the reload names this module calls (surface/needs.py, part weights)
    model = runner.get_model()
    watch: dict[str, Any] = {}

    def watched(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        yield from weights
        watch["unloaded"] = _unloaded_layers(model)  # every tensor fed; old tensors not yet restored

    with expected_logs(EXPECTED_SYNC_LOGS):
        runner.reload_weights(weights_iterator=watched(_checkpoint_weights(runner, path)), is_checkpoint_format=True)
        if "unloaded" not in watch:
            raise WeightSyncError(f"{_model_type(runner)}: the model's loader stopped before the last checkpoint "
                                  "tensor, so the reload could not be checked; rebuild the engine from the checkpoint")
        direct = _load_directly(runner, watch["unloaded"], path) if watch["unloaded"] else []
    return _finished(runner, direct)


def begin_on_worker(runner: Any) -> None:
    """Worker side of `weight_sync`'s entry (op `weights.begin`): start vLLM's layerwise reload."""
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    check_release(parts=("weights",))
    model = runner.get_model()
    if _reload_open(model):
        raise WeightSyncError("a weight sync is already open on this engine; close it before opening another")
    initialize_layerwise_reload(model)


def end_on_worker(runner: Any, check: bool) -> dict[str, Any] | None:
    """Worker side of `weight_sync`'s exit (op `weights.end`): finish the reload, refuse layers
    that received nothing (`check`), repack, drop slot routes."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    model = runner.get_model()
    if not _reload_open(model):
        raise WeightSyncError("no weight sync is open on this engine (expected weights.begin before weights.end)")
    unloaded = _unloaded_layers(model)
    with expected_logs(EXPECTED_SYNC_LOGS):
        finalize_layerwise_reload(model, runner.vllm_config.model_config)
    if not check:
        return None
    if unloaded:
        raise WeightSyncError(
            f"model type {_model_type(runner)!r}: layers {sorted(unloaded)[:6]} ({len(unloaded)} in all) received "
            "no tensor during the weight sync and keep their old weights; do not sample from this engine: load "
            "every parameter, or sync through update_weights(llm, checkpoint_dir)")
    return _finished(runner, [])


# -- ops (endpoint.py) ----------------------------------------------------------------------------
@OPS.register("weights.update")
def _weights_update(runner: Any, st: RunnerState, path: str) -> dict[str, Any]:
    return update_on_worker(runner, path)


@OPS.register("weights.begin")
def _weights_begin(runner: Any, st: RunnerState, payload: Any) -> None:
    begin_on_worker(runner)


@OPS.register("weights.end")
def _weights_end(runner: Any, st: RunnerState, options: dict[str, Any]) -> dict[str, Any] | None:
    return end_on_worker(runner, bool(options["check"]))
