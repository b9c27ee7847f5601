"""The audit on a whole tiny Megatron-core GPTModel on CPU (one gloo rank; the CPU shims are the fixture of
tests/test_megatron_replay.py), with routes as Megatron's RouterReplay holds them: one [S * B, K] list per
entry of the process-global list, sequence-first, recorded by Megatron itself (RouterReplay's RECORD).

Legend: B samples, S padded length, M = S * B sequence-first positions, K top-k.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

import moe_replay  # noqa: E402
from moe_replay.audit import Cause, LayerMismatch, OtherSample  # noqa: E402
from moe_replay.replay import UnsupportedRouterError  # noqa: E402

from .megatron_native_worker import VOCAB, fresh_registry, gpt  # noqa: E402
from .test_megatron_replay import megatron_cpu  # noqa: E402,F401 (the fixture: gloo group + Megatron's CPU shims)

LENGTHS = (12, 7, 10)


def _batch(seed: int = 0):
    """(token ids [B, S] right-padded, attention mask [B, S]) of random tokens."""
    rng = np.random.default_rng(seed)
    s = max(LENGTHS)
    ids, mask = np.zeros((len(LENGTHS), s), np.int64), np.zeros((len(LENGTHS), s), np.int64)
    for b, n in enumerate(LENGTHS):
        ids[b, :n], mask[b, :n] = rng.integers(3, VOCAB, n), 1
    return torch.from_numpy(ids), torch.from_numpy(mask)


def _recorded(model, ids_BS, mask_BS, labels: bool = False) -> list[torch.Tensor]:
    """Every entry of Megatron's process-global RouterReplay list, in list order: the [S * B, K] ids its
    router chose (RECORD) in one forward of the batch (`labels`: GPTModel's loss, which runs the MTP block)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from moe_replay.audit.free import token_batch
    from moe_replay.integrations.megatron import megatron_inputs, model_geometry

    plan = token_batch([ids_BS[b, : int(mask_BS[b].sum())].numpy() for b in range(len(ids_BS))],
                       model_geometry(model, vocab_size=VOCAB))
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    try:
        with torch.no_grad():
            model(**megatron_inputs(plan), **({"labels": plan.input_ids_BS} if labels else {}))
        return [rr.recorded_topk_idx.clone() for rr in RouterReplay.global_router_replay_instances]
    finally:
        RouterReplay.clear_global_router_replay_action()
        for rr in RouterReplay.global_router_replay_instances:
            rr.clear_indices()


def test_free_routes_are_megatrons_own_choice_and_leave_replay_as_found(megatron_cpu):
    """The audit's hooks read each router's routing map: the same expert sets RouterReplay's RECORD keeps,
    at every real position; a RouterReplay action the pipeline left set is put back after the forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from moe_replay.integrations.megatron import find_routers
    from moe_replay.integrations.megatron.audit import free_routes

    fresh_registry()
    model = gpt()
    ids_BS, mask_BS = _batch()
    recorded = _recorded(model, ids_BS, mask_BS)
    rr = find_routers(model)[3].module.router_replay
    rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)  # a pipeline's leftover: the audit routes freely anyway
    free = free_routes(model, [ids_BS[b, :n].numpy() for b, n in enumerate(LENGTHS)])
    assert rr.router_replay_action is RouterReplayAction.REPLAY_FORWARD and model.training
    rr.clear_router_replay_action()
    assert free.geometry.moe_layer_ids == (1, 3)
    s, b_count = ids_BS.shape[1], len(LENGTHS)
    for j, rec_MK in enumerate(recorded):
        rec_BSK = rec_MK.view(s, b_count, -1).transpose(0, 1).sort(-1).values.numpy()
        for b, n in enumerate(LENGTHS):
            assert np.array_equal(np.sort(free.ids_SLK[b][:, j], -1), rec_BSK[b, :n])


def test_router_replay_lists_line_up_and_a_batch_first_layout_is_named(megatron_cpu):
    """Per-router lists as RouterReplay.set_replay_data takes them pass; the same lists written [B, S]
    (miles #3146: BSHD with micro-batch > 1) are read as Megatron reads them, [S, B]: most rows belong to
    other samples, and the batch-first reading lines up."""
    from moe_replay.integrations.megatron.audit import entry_layers

    fresh_registry()
    model = gpt()
    ids_BS, mask_BS = _batch()
    lists = _recorded(model, ids_BS, mask_BS)
    assert entry_layers(model) == (1, 3)
    report = moe_replay.audit(model, lists, ids_BS, format="megatron", attention_mask=mask_BS, layers=entry_layers(model))
    assert report.ok and report.format == "megatron", report.summary()
    s, b_count = ids_BS.shape[1], len(LENGTHS)
    batch_first = [x.view(s, b_count, -1).transpose(0, 1).reshape(s * b_count, -1) for x in lists]
    report = moe_replay.audit(model, batch_first, ids_BS, format="megatron", attention_mask=mask_BS)
    ev = report.verdict.evidence
    assert report.verdict.cause is Cause.OTHER_SAMPLE and isinstance(ev, OtherSample) and ev.reading == "batch-first"
    assert all(s.verdict.evidence.from_others > 0.5 for s in report.misaligned if s.index), report.summary()


def test_mtp_entries_are_left_out_and_an_mtp_collision_is_named(megatron_cpu):
    """A GPTModel with a multi-token-prediction layer: its router's entry of the global list claims no
    decoder layer (entry_layers: None) and is left out. Its routes written into decoder layer 3's entry (an
    MTP layer numbered like a backbone layer, NeMo-RL #3903) match no layer of the model: LAYERS, foreign 3."""
    from moe_replay.integrations.megatron.audit import entry_layers

    fresh_registry()
    model = gpt(mtp=True)
    ids_BS, mask_BS = _batch(1)
    lists = _recorded(model, ids_BS, mask_BS, labels=True)
    layers = entry_layers(model)
    assert layers == (1, 3, None) and len(lists) == 3
    assert moe_replay.audit(model, lists, ids_BS, format="megatron", attention_mask=mask_BS, layers=layers).ok
    collided = [lists[0], lists[2], lists[2]]
    report = moe_replay.audit(model, collided, ids_BS, format="megatron", attention_mask=mask_BS, layers=layers)
    ev = report.verdict.evidence
    assert report.verdict.cause is Cause.LAYERS and isinstance(ev, LayerMismatch), report.summary()
    assert [lid for lid, _ in ev.foreign] == [3] and not ev.remapped


def test_a_discarded_decoder_in_the_global_list_is_refused_by_name(megatron_cpu):
    """verl #7340: the decoder built twice, the list holding the discarded copy's routers first. Lists
    addressed by position would replay into the orphans while the real routers route freely; the entry
    layout refuses the positions no router of the model owns."""
    from moe_replay.integrations.megatron.audit import entry_layers

    fresh_registry()
    gpt()  # the orphan
    model = gpt()
    with pytest.raises(UnsupportedRouterError, match=r"positions \[0, 1\]\) owned by no router of this model"):
        entry_layers(model)


def test_bf16_model_audits_fp32_routes(megatron_cpu):
    """Routes recorded on the fp32 model pass against the same weights in bf16 (Megatron's Float16Module)."""
    fresh_registry()
    fp32 = gpt()
    ids_BS, mask_BS = _batch(2)
    lists = _recorded(fp32, ids_BS, mask_BS)
    fresh_registry()
    bf16 = gpt(bf16=True)
    report = moe_replay.audit(bf16, lists, ids_BS, format="megatron", attention_mask=mask_BS)
    assert report.ok, report.summary()
