"""Which MoE families of the installed transformers replay, measured on tiny random models.

For every model type whose (text) config names experts, `check_family` builds a tiny model from
the config class with small overrides (no download), spreads its router weights so probes do not
tie, and requires, in order:
  1. every router gets a registered or verified adapter (find_routers; a refusal is the reason);
  2. self-replay: replaying the routes HF itself chose gives bit-identical outputs;
  3. replaying other routes (each id shifted by one expert) changes the outputs, so the MoE block
     really consumes the replayed ids (a block that re-routes on its own would pass 2 and fail here);
  4. a backward under replay: every gradient finite, every router's weight gradient non-zero.
A family that fails any step, or errors while being built, is listed with its reason.

Legend: B batch rows, S tokens, T tokens of one sequence, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok", "moe_topk", "top_k_experts")
"""Config attributes that make a model type an MoE family."""

LAYERS = 3
"""Decoder layers of the tiny models: with DeepSeek's first dense layer still 2 MoE layers."""
TINY: dict[str, Any] = dict(
    vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=LAYERS,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
    num_experts=8, num_local_experts=8, n_routed_experts=8, moe_num_experts=8, num_experts_per_tok=2, moe_topk=2,
    top_k_experts=2, n_shared_experts=1, shared_expert_intermediate_size=32, moe_shared_expert_intermediate_size=32,
    first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=16,
    qk_nope_head_dim=16, v_head_dim=16, qk_head_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    mlp_only_layers=[], decoder_sparse_step=1, sliding_window=8, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
)
"""Overrides applied to every config that has the attribute: 8 experts, top-2, width 64."""
FAMILY_TINY: dict[str, dict[str, Any]] = {
    "glm4v_moe_text": dict(head_dim=128),  # its default mrope sections [8, 12, 12] need a 64-wide rotary half
    "lfm2_moe": dict(layer_types=["full_attention", "conv", "full_attention"], num_dense_layers=1),
    "deepseek_ocr2_text": dict(mlp_layer_types=["dense", "sparse", "sparse"]),
    "granitemoehybrid": dict(layer_types=["attention", "linear_attention", "attention"]),
    "ernie4_5_vl_moe_text": dict(moe_intermediate_size=[32, 32]),
    "qwen3_omni_moe_talker_text": dict(shared_expert_intermediate_size=32),
    "zaya": dict(num_experts_per_tok=1),  # ZAYA validates top-1 only
}
"""Per-family overrides on top of TINY, where a family's defaults do not shrink on their own."""

SEQ_LENS = (7, 5)
"""Two rows of different length: padding is part of what replay must line up."""


@dataclass
class FamilyResult:
    family: str
    status: str
    """"replayed", "refused" (by replay, before any forward) or "error" (failed elsewhere)."""
    rule: str = ""
    reason: str = ""
    router: str = ""
    model_class: str = ""
    seconds: float = 0.0
    layers: list[int] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in ("", [], None)}


def moe_families() -> dict[str, tuple[str, str]]:
    """{text model type: (config class name, its module)} for every model type whose text config names experts."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    out: dict[str, tuple[str, str]] = {}
    for model_type in CONFIG_MAPPING_NAMES:
        folder = os.path.join(root, model_type_to_module_name(model_type))
        sources = [os.path.join(folder, f) for f in os.listdir(folder) if f.startswith("configuration_")] if os.path.isdir(folder) else []
        if not any(key in open(f).read() for f in sources for key in _EXPERT_KEYS):
            continue  # instantiating all ~450 configs costs a minute; only those naming experts can be MoE
        try:
            cfg = CONFIG_MAPPING[model_type]()
            text = cfg.get_text_config()
        except Exception:  # composite configs that need sub-configs or optional packages: not text MoE
            continue
        experts = [getattr(text, k, None) for k in _EXPERT_KEYS]
        if not any(isinstance(v, int) and v > 1 for v in experts) and not isinstance(getattr(text, "num_experts", None), list):
            continue
        key = str(getattr(text, "model_type", "") or model_type)
        out.setdefault(key, (type(text).__name__, type(text).__module__))
    return dict(sorted(out.items()))


def _model_class(config_cls: type, config_module: str) -> type:
    """The causal LM for this config class, else its base text model, from the family's modeling module."""
    from transformers import PreTrainedModel

    modeling = importlib.import_module(config_module.replace(".configuration_", ".modeling_"))
    mine = [
        c for c in vars(modeling).values()
        if isinstance(c, type) and issubclass(c, PreTrainedModel) and getattr(c, "config_class", None) is config_cls
    ]
    for suffix in ("ForCausalLM", "Model"):
        for c in mine:
            if c.__name__.endswith(suffix) and "Pretrained" not in c.__name__ and "PreTrained" not in c.__name__:
                return c
    raise LookupError(f"no causal LM or base model class for {config_cls.__name__} in {modeling.__name__}")


def tiny_config(family: str, config_cls: type) -> Any:
    base = config_cls()
    kwargs = {k: v for k, v in TINY.items() if hasattr(base, k)}
    if hasattr(base, "kv_lora_rank"):  # multi-head latent attention: rotary width is qk_rope_head_dim, kv heads = heads
        kwargs.update(head_dim=kwargs["qk_rope_head_dim"], num_key_value_heads=kwargs["num_attention_heads"])
    kwargs.update(FAMILY_TINY.get(family, {}))
    for list_key in ("layer_types", "mlp_layer_types"):
        default = getattr(base, list_key, None)
        if isinstance(getattr(config_cls, list_key, None), property):
            continue  # derived from other fields (Jamba)
        if isinstance(default, list) and len(default) >= LAYERS:
            kwargs.setdefault(list_key, list(default[-LAYERS:]))
    if isinstance(getattr(base, "num_experts", None), list):
        kwargs["num_experts"], kwargs["moe_topk"] = [8] * LAYERS, [2] * LAYERS
    return config_cls(**kwargs)


def _spread_routers(model: nn.Module) -> None:
    """Router matrices N(0, 0.5) and selection biases N(0, 0.3): no ties, and the bias changes choices."""
    from .infer import looks_like_router
    from .routers import adapter_for

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if adapter_for(module) is None and not looks_like_router(module):
                continue
            for name, p in list(module.named_parameters()) + list(module.named_buffers()):
                if p.is_floating_point() and p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
                elif p.is_floating_point() and "bias" in name:
                    p.copy_(torch.randn(p.shape, generator=gen).view_as(p) * 0.3)


def build_tiny(family: str, families: dict[str, tuple[str, str]] | None = None) -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    families = families or moe_families()
    cls_name, module = families[family]
    config_cls = getattr(importlib.import_module(module), cls_name)
    config = tiny_config(family, config_cls)
    torch.manual_seed(0)
    model = _model_class(config_cls, module)(config).float().eval()
    for parent in model.modules():  # selection biases that live on the MoE block, not the router
        for name, b in parent.named_buffers(recurse=False):
            if name in ("e_score_correction_bias", "expert_bias") and b.is_floating_point():
                with torch.no_grad():
                    b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    _spread_routers(model)
    return model


def _outputs(out) -> torch.Tensor:
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _traces(model: nn.Module, geometry) -> list:
    """Traces of HF's own free routes, each sequence run alone (as an engine would)."""
    from .replay import self_routed_trace

    rng = np.random.default_rng(0)
    return [self_routed_trace(model, rng.integers(3, geometry.vocab_size, s), 2, f"req-{i}")
            for i, s in enumerate(SEQ_LENS)]


def _shifted(traces: list, geometry) -> list:
    """The same sets moved by one expert: mostly experts HF would not pick."""
    from dataclasses import replace

    return [replace(t, routes_TLK=(t.routes_TLK + 1) % geometry.num_experts) for t in traces]


def check_family(family: str, families: dict[str, tuple[str, str]] | None = None) -> FamilyResult:
    """Build, self-replay, shifted replay and backward one family; never raises."""
    from moe_replay.replay import build_plan
    from moe_replay.replay.errors import UnsupportedRouterError

    from .replay import model_geometry, replay
    from .routers import find_routers

    t0 = time.perf_counter()
    result = FamilyResult(family, "error")
    try:
        model = build_tiny(family, families)
        result.model_class = type(model).__name__
    except Exception as e:
        result.reason = f"tiny model does not build: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        return result
    try:
        sites = find_routers(model)
        first = next(iter(sites.values()))
        result.router = type(first.module).__name__
        result.layers = list(sites)
        rules = {getattr(s.adapter, "describe", lambda: f"{s.adapter.rule} (registered {s.adapter.family})")() for s in sites.values()}
        result.rule = "; ".join(sorted(rules))
        geometry = model_geometry(model)
        traces = _traces(model, geometry)
        plan = build_plan(traces, geometry)
        with torch.no_grad():
            ref = _outputs(model(**plan.model_inputs()))
            with replay(model, plan) as session:
                out = _outputs(model(**session.model_inputs()))
        mask_BS = plan.attention_mask_BS.bool()
        if not torch.equal(out[mask_BS], ref[mask_BS]):
            result.reason = f"self-replay differs from HF by {(out[mask_BS] - ref[mask_BS]).abs().max().item():.3g}"
            return result
        shifted = build_plan(_shifted(traces, geometry), geometry)
        model.zero_grad()
        with replay(model, shifted) as session:
            out2 = _outputs(model(**session.model_inputs()))
            out2[mask_BS].float().pow(2).mean().backward()
        if torch.equal(out2[mask_BS].detach(), ref[mask_BS]):
            result.reason = "replaying other experts leaves the outputs unchanged: the MoE block does not use the router's ids"
            return result
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        if bad:
            result.reason = f"non-finite gradients in {bad[:3]}"
            return result
        for lid, site in sites.items():
            grads = [p.grad for p in site.module.parameters() if p.dim() == 2]
            if not grads or grads[0] is None or grads[0].abs().sum() == 0:
                result.reason = f"router of layer {lid} ({site.name}) gets no gradient"
                return result
        result.status = "replayed"
    except UnsupportedRouterError as e:
        result.status, result.reason = "refused", str(e)
        if result.reason.startswith("no MoE router"):  # the registry listing says nothing about this family
            result.reason = "no router module: the MoE block computes its routing inline, so there is no router output to replace"
    except Exception as e:
        result.reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    finally:
        result.seconds = round(time.perf_counter() - t0, 2)
    return result


def run_all(families: dict[str, tuple[str, str]] | None = None, threads: int = 1) -> list[FamilyResult]:
    """check_family over every MoE family; one torch thread (tiny matmuls drown in threading on a shared CPU)."""
    families = families or moe_families()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return [check_family(f, families) for f in families]
    finally:
        torch.set_num_threads(before)


def summary(results: list[FamilyResult]) -> dict[str, Any]:
    """The JSON the coverage script prints."""
    import transformers

    return {
        "transformers": transformers.__version__,
        "families_total": len(results),
        "families_replayed": sum(r.status == "replayed" for r in results),
        "families_refused": {r.family: r.reason for r in results if r.status != "replayed"},
        "replayed": sorted(r.family for r in results if r.status == "replayed"),
        "seconds": round(sum(r.seconds for r in results), 1),
    }


TABLE_HEAD = "| family | config class | model built | router | rule (verified) | status | reason |"


def markdown(results: list[FamilyResult], families: dict[str, tuple[str, str]]) -> str:
    """docs/hf_coverage.md: the table the tests read back (family and config class identify what to rebuild)."""
    import transformers

    s = summary(results)
    lines = [
        "# HF transformers MoE coverage (generated)",
        "",
        f"Generated by `python benchmarks/hf_coverage.py --write` on transformers {transformers.__version__}: "
        f"{s['families_replayed']} of {s['families_total']} MoE families replay. Do not edit by hand.",
        "",
        "A family is *replayed* when, on a tiny random model built from its config class (3 layers, 8 experts, "
        "top-2, width 64, no download), every router gets a registered or a verified inferred gate rule, replaying "
        "HF's own routes gives bit-identical outputs, replaying other experts changes them, and a backward "
        "under replay is finite with a non-zero gradient on every router. *refused* is replay refusing the "
        "model by name before any forward; *error* is the tiny model failing elsewhere (building, running). "
        "`tests/test_hf_coverage.py` re-runs every replayed row.",
        "",
        "Rule notation: `softmax_topk` softmax over all experts then gather; `topk_softmax` softmax over the "
        "top-k logits; `sigmoid_bias_group` per-expert score (sigmoid or sqrtsoftplus) then gather; `renorm` "
        "divide by the K-sum (`eps` added); `scale` a multiplier; `bias` a selection-only bias; `groups=G/k` "
        "group-limited selection.",
        "",
        TABLE_HEAD,
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cls_name, module = families[r.family]
        reason = r.reason.replace("|", "/").replace("\n", " ")
        lines.append(f"| {r.family} | `{module}.{cls_name}` | {r.model_class} | {r.router} | {r.rule} | {r.status} | {reason} |")
    return "\n".join(lines) + "\n"


def claimed(path: str) -> dict[str, tuple[str, str]]:
    """{family: (config class name, module)} of the rows a generated table marks replayed."""
    out: dict[str, tuple[str, str]] = {}
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[5] == "replayed":
            module, _, cls_name = cells[1].strip("`").rpartition(".")
            out[cells[0]] = (cls_name, module)
    return out
