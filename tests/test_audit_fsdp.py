"""The audit on an FSDP2-sharded model at world size 2, each rank holding its own shard of the batch, as
verl's FSDP2 actor runs it: the sharded forward's verdicts equal the unsharded model's, and a rank whose
shard lines up stops with the rank that found misaligned routes (PeerAuditError), instead of waiting in
the next collective for a rank that left.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.hf, pytest.mark.slow]  # one spawn of 2 ranks: ~1 min on 2 shared cores

FAMILIES = ("qwen3_moe", "glm4_moe")
"""A softmax top-k router and a sigmoid, grouped one with a correction bias."""
LENGTHS = (24, 17, 30)


def _ranks(rank: int, world: int, init: str, out: dict) -> None:
    import warnings

    import torch.distributed as dist

    import moe_replay
    from moe_replay.audit import RouteAlignmentError
    from moe_replay.audit.schedule import AuditSchedule, PeerAuditError
    from moe_replay.audit.zoo import FAULTS, Sample, inject, write
    from moe_replay.integrations.hf import coverage, model_geometry, self_routed_trace
    from moe_replay.integrations.hf.fsdp import is_sharded
    from moe_replay.presets import AuditSettings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    res: dict = {}
    try:
        fams = coverage.moe_families()
        for family in FAMILIES:
            model = coverage.build_tiny(family, fams)  # seeded: the same weights on both ranks
            g = model_geometry(model)
            rng = np.random.default_rng(100 + rank)  # each rank its own samples
            tokens = [rng.integers(0, g.vocab_size, n) for n in LENGTHS]
            samples = [Sample(f"r{rank}-{b}", t, self_routed_trace(model, t, 5).routes_TLK.astype(np.int64))
                       for b, t in enumerate(tokens)]
            routes, _, _ = write(samples, "trace", g)
            plain = moe_replay.audit(model, routes)  # this rank's samples, the whole model, no group
            sharded = coverage.fsdp2_shard(model)
            schedule = AuditSchedule(AuditSettings(first_batch=True, every=1))
            row: dict = {"plain": [s.agreement for s in plain.samples], "plain_ok": plain.ok}
            assert schedule.next_batch()
            report = schedule.run(sharded, routes)
            row["sharded"] = [s.agreement for s in report.samples]
            row["sharded_ok"] = report.ok
            row["layers_equal"] = report.layer_agreement == plain.layer_agreement
            row["still_sharded"] = all(is_sharded(p) for p in sharded.parameters())

            # rank 1's routes shifted by one token; rank 0's line up
            bad = inject(FAULTS["shift_forward"], samples, "trace", g)[0] if rank == 1 else routes
            assert schedule.next_batch()
            try:
                schedule.run(sharded, bad)
                row["fault"] = None
            except PeerAuditError as e:
                row["fault"] = ("peer", str(e))
            except RouteAlignmentError as e:
                row["fault"] = ("own", e.report.verdict.cause.name, len(e.report.misaligned))
            # both ranks still answer a collective: neither waits for one that left
            flag = torch.ones(1)
            dist.all_reduce(flag)
            row["after"] = float(flag.item())
            res[family] = row
    finally:
        out[rank] = res
        dist.destroy_process_group()
    coverage.leave_dtensor_rank()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from .test_hf_fsdp import spawn_ranks

    return spawn_ranks(_ranks, tmp_path_factory.mktemp("audit-fsdp"))


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_audit_equals_the_unsharded_models(ranks, family):
    for rank, res in ranks.items():
        row = res[family]
        assert row["plain_ok"] and row["sharded_ok"], (rank, row)
        assert row["sharded"] == row["plain"] and row["layers_equal"], (rank, row)
        assert row["still_sharded"], rank


@pytest.mark.parametrize("family", FAMILIES)
def test_one_ranks_misaligned_shard_stops_every_rank(ranks, family):
    own = ranks[1][family]["fault"]
    assert own is not None and own[:2] == ("own", "SHIFTED") and own[2] == len(LENGTHS), own
    peer = ranks[0][family]["fault"]
    assert peer is not None and peer[0] == "peer", peer
    assert "another rank's routes do not line up" in peer[1] and f"this rank's {len(LENGTHS)} samples did" in peer[1]
    assert ranks[0][family]["after"] == ranks[1][family]["after"] == 2.0
