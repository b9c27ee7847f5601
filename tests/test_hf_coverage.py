"""HF replay beyond the registered families: rules inferred and verified, the coverage table's claims re-run.

Every family docs/hf_coverage.md marks replayed in fp32 is rebuilt from its config class (tiny,
random, no download) and must again pass self-replay bit for bit, change under other routes, and
train its routers; so must, in bf16 weights and under bf16 autocast, every family whose verified rule
differs between the table's modes (read from the table) and those whose router arithmetic depends on the
precision under one rule name (PRECISION_SENSITIVE). Refusals are checked on real families whose routers
cannot be replayed, on a rule that holds in fp32 but not under autocast, and on a registered rule the
probe cannot run. The FSDP2 rows: tests/test_hf_fsdp.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from moe_replay.integrations.hf import adapter_for, coverage, find_routers, model_geometry, replay
from moe_replay.replay import UnsupportedRouterError

TABLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "hf_coverage.md")
CLAIMED = coverage.claimed(TABLE, "fp32") if os.path.exists(TABLE) else {}
_FAMILY = {
    "phimoe": ("PhimoeConfig", "transformers.models.phimoe.configuration_phimoe"),
    "llama4_text": ("Llama4TextConfig", "transformers.models.llama4.configuration_llama4"),
    "qwen3_moe": ("Qwen3MoeConfig", "transformers.models.qwen3_moe.configuration_qwen3_moe"),
    "mellum": ("MellumConfig", "transformers.models.mellum.configuration_mellum"),
    "minimax_m2": ("MiniMaxM2Config", "transformers.models.minimax_m2.configuration_minimax_m2"),
}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls on a shared CPU run 10-20x faster on one thread than fighting over several."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SLOW = {"kimi_linear", "afmoe", "granitemoehybrid"}
"""Families whose tiny model runs torch reference kernels (linear attention, mamba): 45-130 s each on a loaded 2-core CPU."""


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in sorted(CLAIMED)])
def test_claimed_family_replays(family):
    result = coverage.check_family(family, CLAIMED)
    assert result.status == "replayed", result.reason
    assert result.rule and result.layers


def test_inferred_rule_is_verified_not_guessed():
    """Mellum has no registered adapter: its rule comes from probing, and names what it found."""
    model = coverage.build_tiny("mellum", _FAMILY)
    sites = find_routers(model)
    adapters = {type(s.adapter).__name__ for s in sites.values()}
    assert adapters == {"InferredAdapter"}
    site = next(iter(sites.values()))
    assert site.adapter.describe() == "softmax_topk renorm"
    assert site.adapter.top_k(site.module) == 2 and site.adapter.num_experts(site.module) == 8


def test_selection_bias_on_the_parent_block_is_read_live():
    """MiniMax-M2 passes its bias from the MoE block: selection uses it, and a later change is seen."""
    model = coverage.build_tiny("minimax_m2", _FAMILY)
    site = next(iter(find_routers(model).values()))
    assert site.adapter.describe() == "sigmoid_bias_group renorm bias"
    bias = site.adapter.selection_bias(site.module)
    owner = dict(model.named_modules())[site.name.rsplit(".", 1)[0]]
    assert bias is owner.e_score_correction_bias
    owner.e_score_correction_bias = torch.zeros_like(bias)  # e.g. a checkpoint load replacing the buffer
    assert site.adapter.selection_bias(site.module) is owner.e_score_correction_bias


def test_router_no_rule_reproduces_is_refused_by_name_before_forward():
    """A gate arithmetic in no rule (Mellum's router with its weights squared, on the instance): refused with
    family, router, layer and what did not match, before any forward of the model."""
    model = coverage.build_tiny("mellum", _FAMILY)
    for m in model.modules():
        if type(m).__name__ == "MellumTopKRouter":
            m.forward = lambda h, own=m.forward: (lambda o: (o[0], o[1] ** 2, o[2]))(own(h))
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(UnsupportedRouterError, match=r"mellum: router 'model\.layers\.0\.mlp\.gate \(layer 0\)'.*no rule .*bit for bit"):
        model_geometry(model)
    assert not calls


def test_router_with_another_output_structure_is_refused():
    """A router whose output fits no registered convention (Mellum's, its ids dropped on the instance) is refused
    with what it returns. Registered conventions (Llama 4's dense scores, ...): tests/test_hf_router_outputs.py."""
    model = coverage.build_tiny("mellum", _FAMILY)
    for m in model.modules():
        if type(m).__name__ == "MellumTopKRouter":
            m.forward = lambda h, own=m.forward: own(h)[:2]
    with pytest.raises(UnsupportedRouterError, match=r"mellum: .*MellumTopKRouter.*returns 2 tensors"):
        find_routers(model)


def test_uninitialised_router_is_refused():
    """All-zero router weights make every rule agree: nothing can be verified, so nothing is claimed."""
    from moe_replay.integrations.hf.infer import looks_like_router

    fresh = coverage.build_tiny("mellum", _FAMILY)  # a new instance: no verified adapter cached
    with torch.no_grad():
        for module in fresh.modules():
            if looks_like_router(module):
                module.weight.zero_()
    with pytest.raises(UnsupportedRouterError, match="uninitialised"):
        find_routers(fresh)


def test_mtp_layers_never_take_decoder_layer_ids():
    """transformers' MtpModel numbers its own layers from 0: its routers are refused, not mapped onto decoder layers."""
    from transformers.modeling_layers import MtpModel

    main = coverage.build_tiny("qwen3_moe", _FAMILY)
    main.config.num_mtp_layers = 1
    mtp = MtpModel(main, 1)
    assert any(".mtp_block." in n for n, _ in mtp.named_modules())
    with pytest.raises(UnsupportedRouterError, match="outside the decoder stack"):
        find_routers(mtp)
    main.mtp = mtp  # draft layers attached to the trainer's model: still refused by name
    with pytest.raises(UnsupportedRouterError, match=r"router 'mtp\.layers\.0\..*outside the decoder stack"):
        model_geometry(main)
    del main.mtp
    assert tuple(find_routers(main)) == (0, 1, 2)


def test_bf16_inferred_replay_is_bit_identical():
    """The verified dtype handling holds in bf16 too: self-replay reproduces HF's bf16 outputs exactly."""
    from moe_replay.replay import build_plan

    from dataclasses import replace as with_routes

    from moe_replay.integrations.hf import capture_routes

    model = coverage.build_tiny("mellum", _FAMILY).to(torch.bfloat16)
    geometry = model_geometry(model)
    (trace,) = coverage._traces(model, geometry)[:1]
    plan = build_plan([trace], geometry)
    # HF's own bf16 routes on exactly the inputs the plan feeds (a mask changes bf16 rounding vs a bare call)
    with torch.no_grad(), capture_routes(model) as cap:
        ref = model(**plan.model_inputs()).logits
    routes_TLK = torch.stack([cap[lid] for lid in geometry.moe_layer_ids], 1)[:-1].numpy()
    plan = build_plan([with_routes(trace, routes_TLK=routes_TLK)], geometry)
    with torch.no_grad(), replay(model, plan) as session:
        out = model(**session.model_inputs()).logits
    mask = plan.attention_mask_BS.bool()
    assert torch.equal(out[mask], ref[mask])


PRECISION_SENSITIVE = (
    "axk2", "cohere2_moe", "deepseek_v2", "deepseek_v3", "deepseek_v4", "dots1", "ernie4_5_moe", "exaone_moe", "glm4_moe",
    "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "laguna",
    "lfm2_moe", "longcat_flash", "minimax_m2",
)
"""Families whose router scores in the logits' own dtype, casts its weights to the input dtype, keeps its
weights in fp32 in a bf16 model, or whose bf16 logits tie outside the top k: each mode takes another arithmetic,
some under the same rule name (so `mode_dependent`, which reads rule names, does not list them all)."""


@dataclass(frozen=True)
class TableRow:
    status: str
    rule: str
    reason: str
    config: tuple[str, str]
    """(config class name, its module)"""


def table_row(family: str, mode: str) -> TableRow:
    """docs/hf_coverage.md's row of `family` in `mode`."""
    cells = next((c for c in coverage._rows(TABLE) if c[0] == family and c[2] == mode), None)
    assert cells is not None, f"no row of {family!r} in mode {mode!r} in docs/hf_coverage.md"
    module, _, cls_name = cells[1].strip("`").rpartition(".")
    return TableRow(cells[6], cells[5], cells[7], (cls_name, module))


def mode_dependent() -> list[str]:
    """Families whose verified rule differs between docs/hf_coverage.md's modes."""
    return coverage.mode_dependent(TABLE) if os.path.exists(TABLE) else []


RECHECKED = sorted(set(mode_dependent()) | set(PRECISION_SENSITIVE))
"""The families whose bf16 and autocast_bf16 rows are re-run: every one whose rule or arithmetic depends on the
mode (~1 s a family and mode on 2 cores; kimi_linear's linear-attention reference kernels are SLOW)."""


@pytest.mark.parametrize("precision", ["bf16", "autocast_bf16"])
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in RECHECKED])
def test_mode_dependent_families_replay_bit_identically(family, precision):
    """Each re-run gets the status the table gives that mode (a family HF's own forward fails in a mode stays an
    error there, not a silent pass), and a replayed one the rule the table says the mode verifies."""
    row = table_row(family, precision)
    result = coverage.check_family(family, {family: row.config}, precision)
    assert result.status == row.status, (result.status, result.reason, row.reason)
    if row.status == "replayed":
        assert result.rule == row.rule, (result.rule, row.rule)


def test_mode_dependent_set_is_read_from_the_table():
    """autocast scores DeepSeek-style sigmoid routers in bf16 (`logits-dtype`): the table's rule names differ."""
    assert {"axk1", "glm4_moe_lite", "solar_open"} <= set(mode_dependent())
    assert "mellum" not in mode_dependent()


def test_a_rule_that_holds_in_fp32_but_not_under_autocast_is_refused_on_the_first_forward(monkeypatch):
    """DeepSeek-V3 scores `logits.sigmoid()`: bf16 under autocast. A registration scoring fp32 logits verifies
    at attach (fp32) and is refused by name on the first autocast forward, before any replayed output."""
    from dataclasses import replace

    from moe_replay.integrations.hf import routers
    from moe_replay.replay import build_plan

    fams = {"deepseek_v3": ("DeepseekV3Config", "transformers.models.deepseek_v3.configuration_deepseek_v3")}
    registered = routers.ROUTER_ADAPTERS.get("deepseek_v3")
    monkeypatch.setattr(routers, "_DISPATCH_ORDER", [replace(registered, upcast=True) if a is registered else a
                                                     for a in routers._DISPATCH_ORDER])
    model = coverage.build_tiny("deepseek_v3", fams)
    geometry = model_geometry(model)
    plan = build_plan(coverage._traces(model, geometry), geometry)
    session = replay(model, plan)  # attach: fp32, the rule holds
    with torch.no_grad(), session:
        model(**session.model_inputs())
    outputs = []
    session = replay(model, plan)
    model.register_forward_hook(lambda *a: outputs.append(1))
    with pytest.raises(UnsupportedRouterError, match=r"deepseek_v3: router 'model\.layers\.1\.mlp\.gate \(layer 1\)'.*"
                                                     r"bfloat16 autocast.*registered rule"):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), session:
            model(**session.model_inputs())
    assert not outputs


def test_verification_runs_once_per_precision_context(monkeypatch):
    """The first forward of a context probes the router; later forwards in it are a dict lookup."""
    from moe_replay.integrations.hf import infer
    from moe_replay.replay import build_plan

    probes = []
    real_probe = infer._probe
    monkeypatch.setattr(infer, "_probe", lambda *a, **k: probes.append(a[1]) or real_probe(*a, **k))
    model = coverage.build_tiny("mellum", _FAMILY)
    geometry = model_geometry(model)
    plan = build_plan(coverage._traces(model, geometry), geometry)
    for autocast in (False, True, False, True):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), replay(model, plan) as session:
            model(**session.model_inputs())
    layers = len(geometry.moe_layer_ids)
    assert len(probes) == 2 * layers  # per router: at attach (fp32) and on the first autocast forward
    assert {k[3] for k in probes} == {None, torch.bfloat16}


def test_families_are_found_by_their_router_classes():
    """DBRX, dots1 and HunYuan-V1-MoE default to one expert or none; their router classes make them families.
    A *Gate without a top_k (D-FINE's gated fusion) is no router."""
    import transformers

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    assert coverage._router_classes(os.path.join(root, "dbrx")) == ["DbrxRouter"]
    assert coverage._router_classes(os.path.join(root, "dots1")) == ["Dots1TopkRouter"]
    assert coverage._router_classes(os.path.join(root, "hunyuan_v1_moe")) == ["HunYuanMoEV1Gate"]
    assert coverage._router_classes(os.path.join(root, "d_fine")) == []
    rows = open(TABLE).read()
    for family in ("dbrx", "dots1", "hunyuan_v1_moe"):
        assert all(f"| {family} | " in line for line in rows.splitlines() if line.startswith(f"| {family} | ")), family
        assert sum(line.startswith(f"| {family} | ") for line in rows.splitlines()) == len(coverage.PRECISIONS)


def test_a_registered_rule_the_probe_cannot_run_is_refused(monkeypatch):
    """Registration is not trust: a registered adapter for a router whose output is not (logits, weights, ids)
    (Llama-4's returns 2 tensors) is refused at attach with what the probe found, not accepted unchecked."""
    from moe_replay.integrations.hf import routers

    wrong = routers.RouterAdapter("llama4_text", "transformers.models.llama4.modeling_llama4", "Llama4Router", "softmax_topk")
    monkeypatch.setattr(routers, "_DISPATCH_ORDER", [wrong, *routers._DISPATCH_ORDER])
    model = coverage.build_tiny("llama4_text", _FAMILY)
    with pytest.raises(UnsupportedRouterError, match=r"llama4_text: router .*Llama4Router.*returns 2 tensors"):
        find_routers(model)


def test_a_registered_rule_on_weights_that_tell_rules_apart_only_later_is_verified_at_the_first_forward():
    """Zero router weights (not loaded yet) cannot tell rules apart: the registered rule attaches unverified and is
    probed again, in the forward's own context, on the first forward after the weights are loaded."""
    from moe_replay.integrations.hf import infer
    from moe_replay.replay import build_plan

    model = coverage.build_tiny("qwen3_moe", _FAMILY)
    geometry = model_geometry(model)
    plan = build_plan(coverage._traces(model, geometry), geometry)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = coverage.build_tiny("qwen3_moe", _FAMILY)
    with torch.no_grad():
        for m in fresh.modules():
            if adapter_for(m) is not None:
                m.weight.zero_()
    sites = find_routers(fresh)  # attach: registered, nothing verified
    assert all(not infer._VERIFIED.get(s.module) for s in sites.values())
    fresh.load_state_dict(state)
    with torch.no_grad(), replay(fresh, plan) as session:
        fresh(**session.model_inputs())
    assert all(infer._VERIFIED.get(s.module) for s in sites.values())  # probed on the loaded weights


def test_readme_quotes_the_tables_counts_and_refusals():
    """The README's HF row says what docs/hf_coverage.md measured: replayed per mode, and the families refused by name
    in fp32 (each named once, the count matching)."""
    import re

    table = coverage.read_table(TABLE)
    replayed = {m: sum(r.status == "replayed" for r in rs) for m, rs in table.items()}
    refused = sorted(r.family for r in table["fp32"] if r.status == "refused")
    readme = open(os.path.join(os.path.dirname(TABLE), os.pardir, "README.md")).read()
    row = next(line for line in readme.splitlines() if line.startswith("| HF transformers |"))
    m = re.search(r"\*\*(\d+) of (\d+)\*\* MoE families replay bit for bit in fp32 and in bf16 weights, (\d+) under bf16 "
                  r"autocast, (\d+) and (\d+) on FSDP2-sharded models.*?; (\d+) are refused by name for their own "
                  r"structure \((.*?)\); the other cells", row)
    assert m, f"README's HF row changed its wording: {row[:300]}"
    quoted = dict(zip(("fp32", "total", "bf16", "autocast_bf16", "fsdp2_bf16", "fsdp2_autocast_bf16"),
                      (m.group(1), m.group(2), m.group(1), m.group(3), m.group(4), m.group(5))))
    assert int(quoted.pop("total")) == len(table["fp32"])
    assert {k: int(v) for k, v in quoted.items()} == replayed
    named = sorted(n.strip() for part in m.group(7).split(";") for n in part.split(":", 1)[1].split(","))
    assert (int(m.group(6)), named) == (len(refused), refused)
