"""Every MoE family's tiny model builds and runs HF's own forward, or replay refuses its structure by name at attach.

The coverage table (docs/hf_coverage.md) measures replay on these tiny models; a family whose tiny model does not
build or run would be reported as the builder's failure ("builder"), never as replay's refusal. Here every family
tiny.moe_families() lists is built from its config class (no download) and run once in fp32, with its output
finite, unless structure.py refuses the model (encoder-decoder models, inline-routing MoE blocks): those must be
refused by find_routers, before any forward, with the family and the reason in the message.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_replay.integrations.hf import capture_routes, coverage, find_routers, tiny
from moe_replay.integrations.hf.replay import output_tensor
from moe_replay.integrations.hf.structure import refuse_structure
from moe_replay.replay import UnsupportedRouterError

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = tiny.moe_families()
STRUCTURE = {
    "doge": "DogeCDMoE",
    "switch_transformers": "encoder-decoder",
    "nllb-moe": "encoder-decoder",
}
"""Families structure.py refuses on this transformers, and a word their refusal must name."""


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls on a shared CPU run 10-20x faster on one thread than fighting over several."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _structure_refusal(model: torch.nn.Module, family: str) -> str | None:
    try:
        refuse_structure(model, dict(model.named_modules()), family)
    except UnsupportedRouterError as e:
        return str(e)
    return None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_model_builds_and_runs_or_structure_is_refused(family):
    notes: list[str] = []
    model = tiny.build_tiny(family, FAMILIES, notes=notes)
    refusal = _structure_refusal(model, family)
    if refusal is not None:
        assert family in STRUCTURE, f"{family} refused by structure.py but not expected: {refusal}"
        assert refusal.startswith(f"{family}: ") and STRUCTURE[family] in refusal, refusal
        return
    assert family not in STRUCTURE, f"{family}: structure.py should refuse it ({STRUCTURE[family]})"
    with torch.no_grad():
        out_BSV = output_tensor(model(input_ids=torch.arange(3, 3 + coverage.SEQ_LENS[0]).view(1, -1)))
    assert out_BSV.shape[:2] == (1, coverage.SEQ_LENS[0])
    assert torch.isfinite(out_BSV).all(), f"{family}: HF's own forward of the tiny model is not finite ({notes})"


@pytest.mark.parametrize("family", sorted(f for f in STRUCTURE if f in FAMILIES))
def test_structural_refusal_is_raised_by_name_at_attach(family):
    """find_routers (every attach: replay, capture, geometry) refuses before any forward, naming the family and
    the reason; check_family reports it as "refused" with that reason, not as the builder's failure."""
    model = tiny.build_tiny(family, FAMILIES)
    with pytest.raises(UnsupportedRouterError, match=rf"^{family}: .*{STRUCTURE[family]}"):
        find_routers(model)
    with pytest.raises(UnsupportedRouterError, match=STRUCTURE[family]):
        with capture_routes(model):
            pass
    result = coverage.check_family(family, FAMILIES)
    assert (result.status, result.router) == ("refused", "")
    assert STRUCTURE[family] in result.reason


def test_doge_refusal_says_why_its_routes_depend_on_the_batch():
    """Doge's routing is the structure's, not a missing adapter: the reason names the token mixing."""
    if "doge" not in FAMILIES:
        pytest.skip("this transformers has no doge")
    with pytest.raises(UnsupportedRouterError, match=r"different tokens of the batch.*keys\^2 experts"):
        find_routers(tiny.build_tiny("doge", FAMILIES))


def test_jamba_replays_through_its_router_module():
    """Jamba's MoE block routes through a JambaTopKRouter module on this transformers, so the inline-routing rule
    for its older block does not fire and every MoE layer gets a router site."""
    jamba = importlib.import_module("transformers.models.jamba.modeling_jamba")
    if not hasattr(jamba, "JambaTopKRouter"):
        pytest.skip("this transformers' Jamba routes inline (structure.py refuses it)")
    sites = find_routers(tiny.build_tiny("jamba", FAMILIES))
    assert {type(s.module).__name__ for s in sites.values()} == {"JambaTopKRouter"}
    assert sorted(sites) == list(range(tiny.LAYERS))


_OLDEST_JAMBA = """
import json, warnings
warnings.filterwarnings("ignore")
import transformers
transformers.logging.set_verbosity_error()
from moe_replay.integrations.hf import find_routers, tiny
from moe_replay.replay import UnsupportedRouterError
try:
    find_routers(tiny.build_tiny("jamba"))
    refusal = None
except UnsupportedRouterError as e:
    refusal = str(e)
print(json.dumps({"transformers": transformers.__version__, "refusal": refusal}))
"""


@pytest.mark.slow
def test_jamba_inline_block_of_the_oldest_transformers_is_refused_by_name():
    """transformers 5.19 (the oldest claimed, beside the venv) computes Jamba's top-k inline in its MoE block:
    refused at attach with the block and the reason, not listed as a missing router."""
    spec = importlib.util.spec_from_file_location("_bootstrap", ROOT / "scripts" / "bootstrap.py")
    boot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(boot)
    folder = boot.compat_dir(Path(sys.prefix))
    if not (folder / "transformers").is_dir():
        pytest.fail(f"transformers {boot.TRANSFORMERS_OLDEST} expected in {folder} (scripts/bootstrap.py installs it)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _OLDEST_JAMBA], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["transformers"] == boot.TRANSFORMERS_OLDEST
    jamba = importlib.import_module("transformers.models.jamba.modeling_jamba")
    if hasattr(jamba, "JambaTopKRouter") and out["refusal"] is None:
        return  # the oldest release routes through a router module too: nothing inline to refuse
    assert out["refusal"] and "JambaSparseMoeBlock" in out["refusal"] and "routes inline" in out["refusal"], out


def test_a_model_the_builder_cannot_make_is_the_builders_failure():
    """A config-only model type (transformers ships its config, no modeling module) is no family; asked for anyway,
    its tiny model cannot be built, and check_family says so as status "builder", not as replay's refusal."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config_only = [t for t in ("sarvam_moe", "sarvam_mla") if t in CONFIG_MAPPING_NAMES]
    if not config_only:
        pytest.skip("this transformers ships no config-only MoE model type")
    family = config_only[0]
    config_cls = importlib.import_module("transformers").CONFIG_MAPPING[family]
    families = {family: (config_cls.__name__, config_cls.__module__)}
    assert family not in FAMILIES
    with pytest.raises(tiny.TinyBuildError, match=rf"^{family}: tiny model does not build: ModuleNotFoundError"):
        tiny.build_tiny(family, families)
    result = coverage.check_family(family, families)
    assert result.status == "builder" and result.reason.startswith("tiny model does not build"), result


def test_families_are_decoder_models_with_a_modeling_module():
    """Encoder sub-configs (a vision tower's experts route image patches) and config-only model types are no
    families; every listed family's config class has a modeling module holding a model for it."""
    from transformers import CONFIG_MAPPING

    for family, (cls_name, module) in FAMILIES.items():
        config_cls = getattr(importlib.import_module(module), cls_name)
        assert getattr(config_cls, "base_config_key", "") not in ("vision_config", "audio_config"), family
        assert tiny._model_class(config_cls, module) is not None
    encoders = [t for t in ("dots3_note_vision_encoder",) if t in CONFIG_MAPPING]
    assert not set(encoders) & set(FAMILIES)


def test_tensors_hf_leaves_uninitialised_are_drawn_not_inherited():
    """Qwen3-Omni's talker experts are torch.empty that HF's init never writes: without the builder's draw their
    values are whatever the allocator held (NaN after other models were built). Built twice, with other models in
    between, the tiny model is the same, finite, and the note says which tensors were drawn."""
    family = "qwen3_omni_moe_talker_text"
    if family not in FAMILIES:
        pytest.skip(f"this transformers has no {family}")
    notes: list[str] = []
    first = tiny.build_tiny(family, FAMILIES, notes=notes)
    for other in ("qwen3_moe", "mixtral", "olmoe"):
        tiny.build_tiny(other, FAMILIES)
    second = tiny.build_tiny(family, FAMILIES)
    state = second.state_dict()
    assert all(torch.equal(t, state[k]) for k, t in first.state_dict().items())
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())
    assert any("experts.gate_up_proj" in n and "uninitialised" in n for n in notes), notes
    assert not torch.are_deterministic_algorithms_enabled()
