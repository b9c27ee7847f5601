"""`trainer_path: megatron_native` (Megatron's process-global RouterReplay API) side by side with the
project's path, on a whole tiny GPTModel on CPU (one gloo rank; EP = 2 in test_megatron_native_ranks.py).

Routes are random traces, so replay must force them (free routing moves the logits); every case
runs two micro-batches forward, then both backward (Megatron's schedule order: recompute pops the
RouterReplay FIFO). Both paths make Megatron gather its own scores at the replayed ids, so logits
and every gradient (routers' included) must be bit-identical, in fp32 and with bf16 parameters
(Float16Module), with activation recompute on and off. The CPU shims are the fixture of
tests/test_megatron_replay.py.

Legend: B batch rows, S padded length, M = S * B sequence-first positions, V vocabulary.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from moe_replay.replay import RouteConsumptionError, UnsupportedRouterError, build_plan  # noqa: E402

from .test_megatron_replay import megatron_cpu  # noqa: E402,F401 (the fixture: gloo group + Megatron's CPU shims)
from .trace_factory import random_trace  # noqa: E402

from .megatron_native_worker import VOCAB, fresh_registry, gpt, max_diff, step  # noqa: E402

def plans(geometry, lengths=((9, 5, 7), (6, 8, 4)), seed: int = 0):
    rng = np.random.default_rng(seed)
    return [build_plan([random_trace(f"m{m}q{i}", rng, geometry=geometry, num_tokens=n, prompt_len=2)
                        for i, n in enumerate(counts)], geometry) for m, counts in enumerate(lengths)]


def router_grads(grads: dict) -> dict:
    return {n: g for n, g in grads.items() if ".router." in n}


@pytest.mark.parametrize("recompute", [False, True], ids=["no_recompute", "recompute"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_native_and_project_paths_are_bit_identical(megatron_cpu, bf16, recompute):
    """Same model, same perturbed routes, two micro-batches: logits, router gradients and every other
    gradient are equal bit for bit on both paths; the routes were forced (free routing differs);
    `auto` picks the native path here (the process-global list holds exactly this model's routers)."""
    from moe_replay.integrations.megatron import model_geometry, resolve_path

    fresh_registry()
    model = gpt(bf16=bf16, recompute=recompute)
    micro = plans(model_geometry(model, vocab_size=VOCAB))
    assert resolve_path(model)[0] == "megatron_native"
    native_out, native_grads, native = step(model, micro, "megatron_native")
    project_out, project_grads, project = step(model, micro, "project")
    free_out, _, _ = step(model, micro, None)
    assert (native.path, project.path) == ("megatron_native", "project")
    assert native._whole  # one chunk, no MTP: Megatron's own set_replay_data served every forward
    assert max_diff(native_out, project_out) == 0.0
    assert native_grads.keys() == project_grads.keys() and len(router_grads(native_grads)) == 2
    assert [n for n in native_grads if not torch.equal(native_grads[n], project_grads[n])] == []
    assert all(g.abs().sum() > 0 for g in router_grads(native_grads).values())
    assert max_diff(native_out, free_out) > 1e-3  # the routes were forced
    for session in (native, project):
        for ledger in session.ledgers:
            assert ledger.forward_takes == {1: 1, 3: 1}
            assert ledger.recompute_takes == ({1: 1, 3: 1} if recompute else {1: 0, 3: 0})
    from moe_replay.integrations.megatron import find_routers

    for site in find_routers(model).values():  # both sessions put RouterReplay back as they found it
        rr = site.module.router_replay
        assert rr.router_replay_action is None and rr.target_topk_idx is None and rr.replay_backward_list == []


def test_bypasses_refused_by_name_before_any_forward(megatron_cpu):
    """Settings whose routing never consults RouterReplay are refused by both paths (and `auto`) before
    any layer runs, naming the setting: the fused top-k (Transformer Engine's, returns before replay)
    and sinkhorn. The model replays again once they are put back."""
    from .megatron_native_worker import bypass_refusals, refused_by_name
    from moe_replay.integrations.megatron import model_geometry

    fresh_registry()
    model = gpt()
    micro = plans(model_geometry(model, vocab_size=VOCAB))
    refusals = bypass_refusals(model, micro)
    assert refused_by_name(refusals) == {"fused_router": True, "sinkhorn": True}, refusals
    assert "returns before RouterReplay is consulted" in refusals["fused_router"]["megatron_native"]
    assert "picks experts without RouterReplay" in refusals["sinkhorn"]["project"]
    step(model, micro, "auto")


def test_native_refuses_a_list_it_cannot_address(megatron_cpu):
    """The native path addresses Megatron's list by position: entries of another model (built later in
    the same process), routers built without moe_enable_routing_replay, and routers given alone are
    refused by name; `auto` takes the project's path for each and replays exactly."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_replay.integrations.megatron import find_routers, model_geometry, open_replay, resolve_path

    fresh_registry()
    model = gpt()
    micro = plans(model_geometry(model, vocab_size=VOCAB))
    other = gpt()  # a second model in the process (a reference policy, a rebuilt decoder)
    assert len(RouterReplay.global_router_replay_instances) == 4
    with pytest.raises(UnsupportedRouterError, match=r"holds 4 RouterReplay instances, 2 of them \(positions \[2, 3\]\) "
                                                     r"owned by no router of this model"):
        open_replay(model, micro, path="megatron_native")
    path, why = resolve_path(model)
    assert path == "project" and "owned by no router of this model" in why
    routers = [s.module for s in find_routers(other).values()]
    with pytest.raises(UnsupportedRouterError, match="routers given alone"):
        open_replay(routers, micro, path="megatron_native")
    assert resolve_path(routers)[0] == "project"

    fresh_registry()
    plain = gpt(moe_enable_routing_replay=False)
    assert all(s.module.router_replay is None for s in find_routers(plain).values())
    with pytest.raises(UnsupportedRouterError, match="moe_enable_routing_replay=False .*trainer_path 'project'"):
        open_replay(plain, micro, path="megatron_native")
    out, grads, session = step(plain, micro, "auto")  # the project's path lends each router a private RouterReplay
    assert session.path == "project" and RouterReplay.global_router_replay_instances == []
    assert all(s.module.router_replay is None for s in find_routers(plain).values())  # taken back
    free, _, _ = step(plain, micro, None)
    assert max_diff(out, free) > 1e-3
    fresh_registry()
    flagged = gpt()
    flagged.load_state_dict(plain.state_dict(), strict=False)
    native_out, native_grads, _ = step(flagged, micro, "megatron_native")
    assert max_diff(out, native_out) == 0.0  # the lent instance replays as Megatron's own does
    assert all(torch.equal(grads[n], native_grads[n]) for n in grads)


def test_silent_noop_replay_is_an_error(megatron_cpu):
    """A RouterReplay that does not replay (its action cleared behind the session's back, or a
    routing that falls back to the router's own top-k, as verl's RouterReplay does when its target
    is None, verl #7340) fails the forward by name on either path, instead of training on free routes."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_replay.integrations.megatron import find_routers, megatron_inputs, model_geometry, open_replay

    fresh_registry()
    model = gpt()
    micro = plans(model_geometry(model, vocab_size=VOCAB))[:1]
    clear = model.decoder.register_forward_pre_hook(lambda *a: RouterReplay.clear_global_router_replay_action())
    try:
        with pytest.raises(RouteConsumptionError, match=r"layer 1: forward of micro-batch 0: router 'decoder.layers.1.mlp.router'"
                                                        r"'s RouterReplay action is None, expected RouterReplayAction.REPLAY_FORWARD"):
            with torch.no_grad(), open_replay(model, micro, path="megatron_native"):
                model(**megatron_inputs(micro[0]))
    finally:
        clear.remove()
    rr = find_routers(model)[3].module.router_replay
    rr.get_replay_topk = lambda scores, topk, num_groups, group_topk, default_compute_topk: default_compute_topk(
        scores, topk, num_groups, group_topk)  # the router's own choice, whatever the action
    try:
        for path in ("megatron_native", "project"):
            with pytest.raises(RouteConsumptionError, match=r"layer 3: forward of micro-batch 0: router "
                                                            r"'decoder.layers.3.mlp.router' routed \d+ of 27 positions other "
                                                            r"than the replayed ids .*no-op"):
                with torch.no_grad(), open_replay(model, micro, path=path):
                    model(**megatron_inputs(micro[0]))
    finally:
        del rr.get_replay_topk


def test_mtp_routers_are_excluded_by_construction_and_named(megatron_cpu):
    """A GPTModel with a multi-token-prediction layer: its router shares Megatron's list (layer_number
    num_layers + 1) but sits in the MTP block, so both paths leave it out by name (it routes freely:
    traces hold decoder layers only), give each decoder router its own layer's routes (the native
    path per entry: the global call would need a tensor for the MTP entry), and agree bit for bit on
    the loss and every gradient."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_replay.integrations.megatron import model_geometry, mtp_routers, resolve_path

    fresh_registry()
    model = gpt(mtp=True)
    assert list(mtp_routers(model)) == ["mtp.layers.0.transformer_layer.mlp.router"]
    assert len(RouterReplay.global_router_replay_instances) == 3
    geometry = model_geometry(model, vocab_size=VOCAB)
    assert geometry.moe_layer_ids == (1, 3)
    micro = plans(geometry)
    assert resolve_path(model)[0] == "megatron_native"
    native_out, native_grads, native = step(model, micro, "megatron_native", labels=True)
    project_out, project_grads, project = step(model, micro, "project", labels=True)
    assert native.excluded == project.excluded == ("mtp.layers.0.transformer_layer.mlp.router",)
    assert native.layout.excluded == {2: "mtp.layers.0.transformer_layer.mlp.router"} and not native._whole
    assert max_diff(native_out, project_out) == 0.0
    assert [n for n in native_grads if not torch.equal(native_grads[n], project_grads[n])] == []
    assert any(n.startswith("mtp.") and ".router." in n for n in native_grads)  # the MTP router ran, with gradient
    mtp_rr = RouterReplay.global_router_replay_instances[2]
    assert mtp_rr.router_replay_action is None and mtp_rr.replay_backward_list == []  # never touched


def test_preset_switch_reaches_the_megatron_binding(megatron_cpu):
    """`replay.trainer_path` in a preset picks the path through enable(); a path the trainer does not
    offer, or a value that is not a name, is refused with what is allowed."""
    import moe_replay
    from moe_replay.presets import load_preset, preset_from_dict

    def preset(path):
        return preset_from_dict({"name": "r3_path", "capture": {"routes": True, "support": False, "logprobs": True},
                                 "replay": {"routes": True, "support": False, "trainer_path": path}})

    fresh_registry()
    model = gpt()
    rng = np.random.default_rng(0)
    for path, want in (("auto", "megatron_native"), ("project", "project"), ("megatron_native", "megatron_native")):
        mr = moe_replay.enable(preset(path), model=model)
        traces = [random_trace(f"e{i}", rng, geometry=mr.geometry, num_tokens=n, prompt_len=2) for i, n in enumerate((7, 5))]
        with mr.train_batch(traces) as batch:
            batch.logprobs(model(**batch.model_inputs())).sum().backward()
        assert batch.session.path == want
    with pytest.raises(ValueError, match=r"trainer_path 'sideways' is not offered by this trainer; expected 'auto' or one "
                                         r"of \['project', 'megatron_native'\]"):
        moe_replay.enable(preset("sideways"), model=model)
    with pytest.raises(ValueError, match=r"replay: trainer_path: expected a path name .*found 3"):
        preset(3)
    assert load_preset("r3_support").replay.trainer_path == "auto"
