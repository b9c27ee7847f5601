"""`collective_device`: the device every collective of moe_replay puts its tensors on, per process group.

NCCL (Megatron-LM's default backend) serves CUDA only: a collective on CPU tensors over it raises
"No backend type associated with device type cpu". A CPU build cannot start NCCL, but
`init_process_group("cuda:gloo")` makes a group of the same shape, whose only backend serves
"cuda": the helper must pick cuda there (and for the subgroups Megatron cuts from it), cpu for a
CPU-only group, and the real collectives must run on a "cpu:gloo" group through it. Each case runs
in its own spawned process, so no process group leaks into other tests.
"""

from __future__ import annotations

import types

import pytest
import torch

from moe_replay.collectives import CollectiveDeviceError, collective_device, group_device_types

CASES = {
    # backend: (device types served, chosen device, chosen with prefer="cuda")
    "cuda:gloo": (("cuda",), "cuda", "cuda"),
    "cpu:gloo": (("cpu",), "cpu", "cpu"),
    "gloo": (("cpu", "cuda"), "cpu", "cuda"),
    "cpu:gloo,cuda:gloo": (("cpu", "cuda"), "cpu", "cuda"),
}


def _one_rank(rank: int, work: str, out: dict) -> None:
    """Every backend of CASES in turn, one single-rank default group each (a fresh rendezvous file per group)."""
    import torch.distributed as dist

    for i, backend in enumerate(CASES):
        dist.init_process_group(backend, init_method=f"file://{work}/init{i}", rank=rank, world_size=1)
        try:
            sub = dist.new_group([0])  # Megatron's groups (tp_ep_group, ...) are cut from the default one like this
            got = {"types": group_device_types(), "sub_types": group_device_types(sub),
                   "device": str(collective_device()), "sub_device": str(collective_device(sub)),
                   "prefer_cuda": str(collective_device(sub, prefer="cuda"))}
            try:  # what a CPU tensor meets on this group without the helper
                dist.all_gather([torch.zeros(2, dtype=torch.int64)], torch.zeros(2, dtype=torch.int64), group=sub)
                got["cpu_all_gather"] = "ran"
            except RuntimeError as e:
                got["cpu_all_gather"] = str(e)
            out[backend] = got
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank_results(tmp_path_factory) -> dict:
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    mp.spawn(_one_rank, args=(str(tmp_path_factory.mktemp("groups")), out), nprocs=1, join=True)
    return dict(out)


@pytest.mark.parametrize("backend", list(CASES))
def test_device_chosen_from_the_groups_own_backends(one_rank_results, backend):
    types_, device, prefer_cuda = CASES[backend]
    got = one_rank_results[backend]
    assert got["types"] == got["sub_types"] == types_
    assert got["device"] == got["sub_device"] == device  # no accelerator here: the type, without an index
    assert got["prefer_cuda"] == prefer_cuda  # a tensor's own device wins only where the group serves it
    if "cpu" in types_:
        assert got["cpu_all_gather"] == "ran"
    else:  # NCCL's shape: the failure the helper exists to avoid
        assert "No backend type associated with device type cpu" in got["cpu_all_gather"], got["cpu_all_gather"]


def _two_ranks(rank: int, init: str, out: dict) -> None:
    import torch.distributed as dist

    from moe_replay.replay.scoring import VocabShard

    dist.init_process_group("cpu:gloo", init_method=init, rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        x = torch.tensor([1.0 + rank, -2.0 * rank])
        summed = VocabShard(rank, 2, group).all_reduce(x.clone(), "sum")
        top = VocabShard(rank, 2, group).all_reduce(x.clone(), "max")
        dev = collective_device(group)
        counts = torch.tensor([rank + 1], dtype=torch.int64, device=dev)
        gathered = [torch.empty_like(counts) for _ in range(2)]
        dist.all_gather(gathered, counts, group=group)
        out[rank] = (summed.tolist(), top.tolist(), [int(g) for g in gathered], str(dev))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_collectives_run_on_a_cpu_only_group(tmp_path):
    """Two ranks of a "cpu:gloo" group (the CPU mirror of NCCL's CUDA-only one): the vocabulary-parallel
    all-reduces of scoring and an all_gather on the chosen device give every rank the same totals."""
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    mp.spawn(_two_ranks, args=(f"file://{tmp_path}/init", out), nprocs=2, join=True)
    for rank in (0, 1):
        assert out[rank] == ([3.0, -2.0], [2.0, 0.0], [1, 2], "cpu")


def test_a_group_naming_no_device_is_refused_by_name():
    stub = types.SimpleNamespace(_device_types=[], group_name="tp_ep")
    assert group_device_types(stub) == ()
    with pytest.raises(CollectiveDeviceError, match=r"field 'process group tp_ep backends': expected a backend serving"):
        collective_device(stub)
    served = types.SimpleNamespace(_device_types=[torch.device("cuda")], group_name="nccl_like")
    assert group_device_types(served) == ("cuda",) and collective_device(served) == torch.device("cuda")
