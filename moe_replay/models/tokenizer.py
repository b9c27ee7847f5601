"""Byte-level BPE tokenizer for the tiny models, trained locally on `corpus.py` text.

Why not a hub tokenizer: nothing may be downloaded at run time, and the demo's arithmetic task
needs a tokenizer that has seen its format. Digits are split one per token (as Llama/Qwen do) so
"19" is always ["1", "9"] and answers tokenize the same wherever they appear. The tokenizer
prepends BOS (HF and vLLM both encode prompts with `add_special_tokens=True`, so they agree) and
always has exactly `vocab_size` tokens, padded with reserved specials if the corpus runs out of
merges, so every logit index decodes.

`transformers` and `tokenizers` are imported lazily: `import moe_replay.models` stays torch-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .corpus import corpus_lines

if TYPE_CHECKING:  # pragma: no cover
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)
"""Ids 0, 1, 2 in that order."""
BYTE_ALPHABET_SIZE = 256


@dataclass(frozen=True)
class TokenizerSpec:
    """What determines the tokenizer files: same spec -> byte-identical files."""

    vocab_size: int = 512
    """Total tokens including specials; must cover the 256-byte alphabet plus the specials."""
    seed: int = 0
    """Seed of the generated corpus."""
    corpus_lines: int = 6000
    """Lines of generated corpus to train on (more lines, more stable merge counts)."""

    def __post_init__(self) -> None:
        minimum = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
        if self.vocab_size < minimum:
            raise ValueError(f"TokenizerSpec.vocab_size must be >= {minimum} (bytes + specials), got {self.vocab_size}")
        if self.corpus_lines < 1:
            raise ValueError(f"TokenizerSpec.corpus_lines must be >= 1, got {self.corpus_lines}")


def train_tokenizer(spec: TokenizerSpec = TokenizerSpec()) -> "Tokenizer":
    """Train the raw `tokenizers.Tokenizer` (single-threaded work, deterministic for a spec)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus_lines(spec.seed, spec.corpus_lines)), trainer=trainer)
    short = spec.vocab_size - tok.get_vocab_size()
    if short > 0:  # corpus ran out of merges: fill up so every logit index is a real token
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(short)])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    if tok.get_vocab_size() != spec.vocab_size:
        raise ValueError(f"trained tokenizer has {tok.get_vocab_size()} tokens, expected {spec.vocab_size}")
    return tok


def build_tokenizer(spec: TokenizerSpec = TokenizerSpec()) -> "PreTrainedTokenizerFast":
    """The HF wrapper with bos/eos/pad set, ready for `save_pretrained`."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(spec),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",  # batched generation with a causal LM pads on the left
        model_max_length=1 << 16,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(out_dir: str | Path, spec: TokenizerSpec = TokenizerSpec()) -> "PreTrainedTokenizerFast":
    """Train, wrap and save next to the weights; returns the wrapper."""
    tok = build_tokenizer(spec)
    tok.save_pretrained(str(out_dir))
    return tok
