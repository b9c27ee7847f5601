"""Tiny random models of every MoE family of the installed transformers, built from config classes (no download).

`moe_families` lists the families: every model type whose modeling module defines a router class (*Router,
*Gating, or a *Gate that reads a top_k), and every one whose config has more than one expert by default (MoE
blocks that route inline). Left out, as not decoder MoE families: sub-configs of a vision or audio encoder
(`base_config_key` "vision_config" / "audio_config": their experts route image or audio patches, never the
decoder tokens a trace records) and model types that ship a config but no modeling module (transformers holds
no model to run; their checkpoints load remote code).

`build_tiny` builds one family's model: TINY's overrides for every attribute the config has, FAMILY_TINY's on
top where a family's defaults do not shrink on their own, router weights spread so probes do not tie. A tiny
model that cannot be built raises TinyBuildError: the builder's failure, not the family's (coverage reports it,
and a tiny model HF's own fp32 forward cannot run, as status "builder").
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
from typing import Any

import torch
from torch import nn

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok", "moe_topk",
                "top_k_experts")
"""Config attributes that name experts (a default above 1 makes a model type an MoE family even without a router
class)."""
_ROUTER_CLASS_RE = re.compile(r"^class (\w+(?:Router|Gating|Gate))\(", re.MULTILINE)
"""Router-shaped class definitions in a modeling module; a *Gate counts only where its body reads a top_k."""


class TinyBuildError(RuntimeError):
    """A family's tiny model could not be built: the builder's failure (its config overrides), not the family's."""


LAYERS = 3
"""Decoder layers of the tiny models: with DeepSeek's first dense layer still 2 MoE layers."""
TINY: dict[str, Any] = dict(
    vocab_size=96, unpadded_vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
    num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    tie_word_embeddings=False,
    num_experts=8, num_local_experts=8, n_routed_experts=8, moe_num_experts=8, num_experts_per_tok=2, moe_topk=2,
    top_k_experts=2, n_shared_experts=1, shared_expert_intermediate_size=32, moe_shared_expert_intermediate_size=32,
    first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=16,
    qk_nope_head_dim=16, v_head_dim=16, qk_head_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    mlp_only_layers=[], decoder_sparse_step=1, sliding_window=8, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
)
"""Overrides applied to every config that has the attribute: 8 experts, top-2, width 64 (`unpadded_vocab_size`:
Inkling 2's LM head width, 200058 by default, which replay samples tokens from)."""
FAMILY_TINY: dict[str, dict[str, Any]] = {
    "glm4v_moe_text": dict(head_dim=128),  # its default mrope sections [8, 12, 12] need a 64-wide rotary half
    "lfm2_moe": dict(layer_types=["full_attention", "conv", "full_attention"], num_dense_layers=1),
    "deepseek_ocr2_text": dict(mlp_layer_types=["dense", "sparse", "sparse"]),
    "granitemoehybrid": dict(layer_types=["attention", "linear_attention", "attention"]),
    "ernie4_5_vl_moe_text": dict(  # mrope sections sum to head_dim 16 / 2 (default [22, 22, 20] needs 128)
        moe_intermediate_size=[32, 32],
        rope_parameters=dict(rope_type="default", rope_theta=500000.0, mrope_section=[3, 3, 2])),
    "qwen3_omni_moe_talker_text": dict(shared_expert_intermediate_size=32),
    "dots3_note_text": dict(  # per-layer MLA widths: its sliding layers take theirs from swa_* keys (HF's own tiny test)
        head_dim=32, swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=16, swa_kv_lora_rank=16,
        swa_head_dim=32, swa_qk_nope_head_dim=16, swa_qk_rope_head_dim=16, swa_v_head_dim=16, index_n_heads=2,
        index_head_dim=32, index_topk=64, shared_experts_intermediate_size=32),
    "glm5_next_text": dict(qk_rope_head_dim=0, qk_nope_head_dim=32, index_head_dim=16, index_n_heads=2, index_topk=64,
                           index_kpool=16, linear_head_dim=16, linear_num_heads=2),  # its DSA layers are NoPE (rope 0)
    "hy_v4_vl_text": dict(  # mrope sections sum to qk_rope_head_dim 16 / 2 (default [12, 10, 10] needs 64)
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2])),
    "jamba": dict(  # by default 3 layers hold no attention layer (one in 8), which HF's forward needs, and 1 MoE layer
        attn_layer_period=3, attn_layer_offset=2, expert_layer_period=1, expert_layer_offset=0),
    "mistral4": dict(head_dim=32),  # its head_dim is qk_nope + qk_rope (16 + 16), not the rotary width MLA's rule sets
    "qwen4_exp_text": dict(  # its sparse-attention indexer has no defaults; n-gram tables default to 20M rows
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
        hc_lowrank=4, heads_per_ngram=2, ngram_vocab_size_base=17, make_ngram_vocab_size_divisible_by=4, split_ngram_parts=4),
    "doge": dict(is_moe=True, num_experts=16),  # MoE is off by default; product keys: experts a square (4 keys^2)
    "zaya": dict(num_experts_per_tok=1),  # ZAYA validates top-1 only
    "dbrx": dict(d_model=64, n_heads=4, n_layers=LAYERS, max_seq_len=64, ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8,
                 moe_top_k=2, hidden_size=64), attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0)),
    **{f: dict(enable_moe_block=True, global_head_dim=16, hidden_size_per_layer_input=16, vocab_size_per_layer_input=96,
               num_kv_shared_layers=0, layer_types=["sliding_attention", "sliding_attention", "full_attention"])
       for f in ("gemma4_text", "diffusion_gemma_text")},  # MoE blocks are off by default
}
"""Per-family overrides on top of TINY, where a family's defaults do not shrink on their own."""
FAMILY_INPUT_EMBEDDINGS: dict[str, tuple[str, str]] = {
    "qwen3_omni_moe_talker_text": ("codec_embedding", "Qwen3OmniMoeTalkerModel.forward embeds input_ids with "
                                   "embed_tokens, which it never defines: its parent passes inputs_embeds"),
}
"""{family: (the module its get_input_embeddings returns, why)}: families whose forward cannot embed input_ids by
itself; the tiny model gets `embed_tokens` as that same module, so replay's input_ids run."""


def _router_classes(folder: str) -> list[str]:
    """Router-shaped classes defined in a model folder's modeling modules."""
    names = []
    for f in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not (f.startswith("modeling_") and f.endswith(".py")):
            continue
        src = open(os.path.join(folder, f)).read()
        for m in _ROUTER_CLASS_RE.finditer(src):
            body = src[m.end():].split("\nclass ", 1)[0]
            if not m.group(1).endswith("Gate") or "top_k" in body:
                names.append(m.group(1))
    return names


_ENCODER_KEYS = ("vision_config", "audio_config")
"""`base_config_key`s of encoder sub-configs (Dots3 Note's vision tower routes image patches through experts)."""


def _has_modeling_module(config_module: str) -> bool:
    """Whether transformers ships a modeling module beside this configuration module (`configuration_x` -> `modeling_x`)."""
    return importlib.util.find_spec(config_module.replace(".configuration_", ".modeling_")) is not None


def moe_families() -> dict[str, tuple[str, str]]:
    """{text model type: (config class name, its module)} for every model type whose modeling module defines
    a router class and whose text config names experts (DBRX: in its ffn_config), or whose text config has more
    than one expert by default (inline routing); not encoder sub-configs, nor configs without a modeling module
    (the module docstring says why)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    out: dict[str, tuple[str, str]] = {}
    for model_type in CONFIG_MAPPING_NAMES:
        folder = os.path.join(root, model_type_to_module_name(model_type))
        routers = _router_classes(folder)
        sources = [os.path.join(folder, f) for f in os.listdir(folder) if f.startswith("configuration_")] if os.path.isdir(folder) else []
        if not routers and not any(key in open(f).read() for f in sources for key in _EXPERT_KEYS):
            continue  # instantiating all ~450 configs costs a minute; only those with a router or naming experts can be MoE
        try:
            cfg = CONFIG_MAPPING[model_type]()
            text = cfg.get_text_config()
        except Exception:  # composite configs that need sub-configs or optional packages: not text MoE
            continue
        if getattr(text, "base_config_key", "") in _ENCODER_KEYS:
            continue  # a vision or audio encoder's own MoE: it routes patches or frames, not the decoder's tokens
        if not _has_modeling_module(type(text).__module__):
            continue  # a config without a modeling module: transformers holds no model to run
        if routers and not any(_has(text, k) for k in _EXPERT_KEYS + ("ffn_config",)):
            continue  # a vision or audio config of a model whose text half routes
        if not routers:
            experts = [_get(text, k) for k in _EXPERT_KEYS]
            if not any(isinstance(v, int) and v > 1 for v in experts) and not isinstance(_get(text, "num_experts"), list):
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


def _has(config: Any, name: str) -> bool:
    try:
        return hasattr(config, name)
    except Exception:  # per-layer attributes (Gemma 4's head_dim) raise on a global read: they exist
        return True


def _get(config: Any, name: str) -> Any:
    try:
        return getattr(config, name, None)
    except Exception:  # a per-layer attribute (transformers 5.24's heterogeneous configs) raises on a global read
        return None


def tiny_config(family: str, config_cls: type) -> Any:
    base = config_cls()
    kwargs = {k: v for k, v in TINY.items() if _has(base, k)}
    if _has(base, "kv_lora_rank"):  # multi-head latent attention: rotary width is qk_rope_head_dim, kv heads = heads
        kwargs.update(head_dim=kwargs["qk_rope_head_dim"], num_key_value_heads=kwargs["num_attention_heads"])
    kwargs.update(FAMILY_TINY.get(family, {}))
    for list_key in ("layer_types", "mlp_layer_types"):
        default = getattr(base, list_key, None) if _has(base, list_key) and not isinstance(getattr(config_cls, list_key, None), property) else None
        if isinstance(getattr(config_cls, list_key, None), property):
            continue  # derived from other fields (Jamba)
        if isinstance(default, list) and len(default) >= LAYERS:
            kwargs.setdefault(list_key, list(default[-LAYERS:]))
    if isinstance(getattr(base, "num_experts", None), list):
        kwargs["num_experts"], kwargs["moe_topk"] = [8] * LAYERS, [2] * LAYERS
    return config_cls(**kwargs)


def _spread_routers(model: nn.Module) -> None:
    """Router matrices N(0, 0.5) and selection biases N(0, 0.3): no ties, and the bias changes choices. A router
    that is a stack of matrices (ZAYA1's MLP router: four) gets N(0, 1.5 / sqrt(fan_in)) in each instead: four
    N(0, 0.5) layers give logits of spread ~180, a saturated softmax whose bf16 backward leaves the router no
    gradient even in HF's own forward."""
    from .infer import looks_like_router
    from .routers import adapter_for

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if adapter_for(module) is None and not looks_like_router(module):
                continue
            tensors = list(module.named_parameters()) + list(module.named_buffers())
            stacked = sum(p.is_floating_point() and p.dim() == 2 and min(p.shape) > 1 for _, p in tensors) > 1  # not a [1, E] bias
            for name, p in tensors:
                if p.is_floating_point() and p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / p.shape[1] ** 0.5 if stacked else 0.5))
                elif p.is_floating_point() and "bias" in name:
                    p.copy_(torch.randn(p.shape, generator=gen).view_as(p) * 0.3)


def cast_as_loaded(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` in `dtype` as `from_pretrained(dtype=dtype)` loads it: the tensors its dtype plan keeps in fp32
    (`_keep_in_fp32_modules_strict`, e.g. ERNIE-4.5's router weight and DeepSeek-V3's correction bias) stay fp32."""
    model = model.to(dtype)
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    keep = [re.compile(k.replace("*", ".*")) for k, v in plan.items() if v == torch.float32]
    if keep and dtype != torch.float32:
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point() and any(k.search(name) for k in keep):
                t.data = t.data.float()
    return model


def _first_line(e: BaseException, limit: int = 160) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:limit] if str(e) else ''}"


@contextlib.contextmanager
def _nan_for_uninitialised():
    """Model construction with every `torch.empty` float tensor NaN (deterministic mode's
    `fill_uninitialized_memory`), so a tensor HF's init never writes is found, not left holding whatever the
    allocator last held (Qwen3-Omni's talker experts: finite in one process, NaN after other models were built)."""
    import torch.utils.deterministic as deterministic

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        deterministic.fill_uninitialized_memory = before[2]


def _init_left_uninitialised(model: nn.Module, std: float) -> list[str]:
    """Names of the floating tensors HF's init left NaN, each drawn N(0, std) from a fixed seed instead."""
    gen = torch.Generator().manual_seed(2)
    left = []
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point() and t.numel() and bool(torch.isnan(t).any()):
                t.copy_(torch.randn(t.shape, generator=gen) * std)
                left.append(name)
    return left


def build_tiny(family: str, families: dict[str, tuple[str, str]] | None = None, dtype: torch.dtype = torch.float32,
               as_loaded: bool = True, notes: list[str] | None = None) -> nn.Module:
    """The family's tiny random model, router weights spread, in `dtype` as from_pretrained would load it
    (`as_loaded=False`: every tensor in `dtype`). Raises TinyBuildError where the config or model cannot be made.
    `notes` (when given) gets a line for each way the tiny model departs from HF's own construction."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    families = families or moe_families()
    cls_name, module = families[family]
    try:
        config_cls = getattr(importlib.import_module(module), cls_name)
        config = tiny_config(family, config_cls)
        torch.manual_seed(0)
        with _nan_for_uninitialised():
            model = _model_class(config_cls, module)(config).float().eval()
    except Exception as e:
        raise TinyBuildError(f"{family}: tiny model does not build: {_first_line(e)}") from e
    left = _init_left_uninitialised(model, float(_get(config, "initializer_range") or 0.02))
    if left and notes is not None:
        notes.append(f"HF's init leaves {left[0]}{f' and {len(left) - 1} more' if len(left) > 1 else ''} uninitialised "
                     "(a checkpoint fills them); the tiny model draws them N(0, initializer_range)")
    if family in FAMILY_INPUT_EMBEDDINGS:
        embeddings, why = FAMILY_INPUT_EMBEDDINGS[family]
        model.embed_tokens = getattr(model, embeddings)
        if notes is not None:
            notes.append(f"the tiny model's embed_tokens is its {embeddings} ({why})")
    for parent in model.modules():  # selection biases that live on the MoE block, not the router
        for name, b in parent.named_buffers(recurse=False):
            if name in ("e_score_correction_bias", "expert_bias") and b.is_floating_point():
                with torch.no_grad():
                    b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    _spread_routers(model)
    return cast_as_loaded(model, dtype) if as_loaded else model.to(dtype)

