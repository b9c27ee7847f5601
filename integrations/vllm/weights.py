"""RL weight sync: load a trainer's new weights into a live vLLM engine, in place.

vLLM's own `reload_weights` (worker RPC) reloads a checkpoint directory into the running model.
On the CPU backend of vLLM 0.32 it leaves MoE expert weights wrong: the CPU experts kernel
prepacks w13/w2 into its blocked layout once, when the kernel is set up, and a weight update
copies the new checkpoint-layout values into that storage without prepacking them again
(measured: the tiny Qwen3-MoE's logprobs moved by up to 13.5 nats after reloading its own
checkpoint). `update_weights` reloads, then re-applies the kernel's own prepack to each CPU MoE
layer (WORKAROUND, vLLM-CPU only; a no-op on other backends), and resets the prefix cache so no
KV computed with the old weights is reused. Verified against HF in tests/test_vllm_weights.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _repack_cpu_moe(worker: Any) -> int:
    """Worker side: prepack every CPU MoE layer's freshly reloaded w13/w2; returns layers fixed."""
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not a CPU build: nothing to repair
        return 0
    fixed = 0
    for name, layer in worker.model_runner.model.named_modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        padded = experts._padded_intermediate_size(experts.moe_config)
        if padded != experts.moe_config.intermediate_size_per_partition:
            raise RuntimeError(
                f"{name}: weight sync on vLLM-CPU supports MoE intermediate sizes the kernel needs no padding "
                f"for; found {experts.moe_config.intermediate_size_per_partition} (padded to {padded})"
            )
        for attr in ("w13_weight", "w2_weight"):
            param = getattr(layer, attr)
            param.data.copy_(cpu_prepack_moe_weight(param.data.clone(), experts.isa))
        fixed += 1
    return fixed


def repack_cpu_moe(llm: Any) -> int:
    """After weights were loaded into `llm` by any route (reload_weights, a trainer's per-tensor
    `load_weights`), re-apply the CPU experts kernel's prepack; returns layers repacked (0 off the
    CPU backend). Call it once per full load: prepacking prepacked values scrambles them again."""
    fixed = llm.collective_rpc(_repack_cpu_moe)
    return int(fixed[0]) if fixed else 0


def update_weights(llm: Any, weights_dir: str | Path) -> int:
    """Reload `weights_dir` (a save_pretrained checkpoint) into `llm` in place; returns CPU MoE
    layers repacked (0 off the CPU backend)."""
    weights_dir = Path(weights_dir)
    if not weights_dir.is_dir():
        raise FileNotFoundError(f"update_weights: expected a checkpoint directory, found {str(weights_dir)!r}")
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_dir)})
    fixed = repack_cpu_moe(llm)
    llm.reset_prefix_cache()
    return fixed
