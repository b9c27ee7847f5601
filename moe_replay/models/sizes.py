"""Size presets: family-neutral shapes that each family maps onto its own HF config keys."""

from __future__ import annotations

from dataclasses import dataclass

from ..registry import Registry

# head dims vLLM's CPU attention accepts (see shared notes: vllm-cpu.md)
VLLM_CPU_HEAD_DIMS = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})


@dataclass(frozen=True)
class SizePreset:
    """Shape of a model before a family adds its own structure (dense layers, shared experts)."""

    num_moe_layers: int
    """MoE decoder layers; families with dense layers add those on top."""
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """Must be one of VLLM_CPU_HEAD_DIMS so the model also runs in vLLM-CPU."""
    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    expert_ffn: int
    """Intermediate size of one routed (or shared) expert."""
    dense_ffn: int
    """Intermediate size of a dense MLP layer."""
    vocab_size: int = 512
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SizePreset.{name} must be a positive int, got {value!r}")
        if self.head_dim not in VLLM_CPU_HEAD_DIMS:
            raise ValueError(f"SizePreset.head_dim ({self.head_dim}) must be one of {sorted(VLLM_CPU_HEAD_DIMS)} for vLLM-CPU")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"SizePreset.num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if self.top_k > self.num_experts:
            raise ValueError(f"SizePreset.top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")


SIZES: Registry[SizePreset] = Registry("model size")
SIZES.add(
    "tiny",  # the test fixture: builds in ~1 s, ~2.5 MB of fp32 weights
    SizePreset(num_moe_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
               num_experts=8, top_k=2, expert_ffn=128, dense_ffn=256),
)
SIZES.add(
    "bench",  # MoE compute, not Python overhead, dominates a step; ~230 MB fp32, builds in ~5 s
    SizePreset(num_moe_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, head_dim=64,
               num_experts=32, top_k=4, expert_ffn=128, dense_ffn=1024),
)
