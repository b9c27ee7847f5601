"""Tiny local MoE models: the project's embedded default model and test fixture.

    from moe_replay.models import build_tiny_model, geometry_of
    path = build_tiny_model("qwen3_moe", "runs/m", seed=0)   # HF + vLLM loadable, no downloads
    geometry_of(path)  # ModelGeometry(num_layers=2, moe_layer_ids=(0, 1), num_experts=8, top_k=2, ...)

Importing this package needs torch only; transformers/tokenizers load inside the build calls.
"""

from .factory import DEFAULT_FAMILY, build_tiny_model, tiny_model_config
from .families import FAMILIES, Family
from .init import InitSpec
from .layout import LAYOUTS, geometry_of
from .prompts import ArithmeticProblem, parse_answer, sample_problems
from .sizes import SIZES, SizePreset
from .tokenizer import TokenizerSpec, build_tokenizer

__all__ = [
    "DEFAULT_FAMILY",
    "FAMILIES",
    "LAYOUTS",
    "SIZES",
    "ArithmeticProblem",
    "Family",
    "InitSpec",
    "SizePreset",
    "TokenizerSpec",
    "build_tiny_model",
    "build_tokenizer",
    "geometry_of",
    "parse_answer",
    "sample_problems",
    "tiny_model_config",
]
