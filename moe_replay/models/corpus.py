"""Deterministic generated training text for the tiny tokenizer (no downloads at run time).

Three kinds of line, so the BPE learns useful merges for what the project feeds it: simple
English-like sentences, the arithmetic task format of `prompts.py`, and digit strings.
"""

from __future__ import annotations

import random
from typing import Iterator

from .prompts import sample_problem

_SUBJECTS = (
    "the cat", "a dog", "the small bird", "my friend", "the old man", "a young girl", "the teacher",
    "the farmer", "a robot", "the children", "our team", "the doctor", "a student", "the king",
    "the queen", "a little fox", "the river", "the wind", "she", "he", "we", "they", "you", "I",
)
_VERBS = (
    "sees", "likes", "finds", "takes", "makes", "wants", "helps", "reads", "writes", "counts",
    "opens", "closes", "moves", "holds", "brings", "follows", "builds", "paints", "calls", "knows",
    "eats", "drinks", "loves", "keeps", "gives", "shows", "learns", "plays with", "looks at",
)
_ADJECTIVES = (
    "red", "blue", "green", "big", "small", "old", "new", "happy", "quiet", "bright", "dark", "warm",
    "cold", "long", "short", "round", "soft", "heavy", "light", "good", "strange", "simple",
)
_OBJECTS = (
    "ball", "book", "apple", "house", "tree", "door", "box", "road", "letter", "number", "answer",
    "question", "table", "window", "garden", "city", "song", "story", "river", "stone", "cup",
    "picture", "problem", "machine", "model", "expert", "token", "game", "water", "bread",
)
_ENDINGS = (".", ".", ".", "!", "?")
_CONNECTORS = ("and then", "because", "but", "so", "while", "after", "before", "when")


def _sentence(rng: random.Random) -> str:
    def clause() -> str:
        det = rng.choice(("the", "a", "one", "every", "this", "that"))
        return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {det} {rng.choice(_ADJECTIVES)} {rng.choice(_OBJECTS)}"

    text = clause()
    if rng.random() < 0.3:
        text = f"{text} {rng.choice(_CONNECTORS)} {clause()}"
    if rng.random() < 0.2:
        text = f"{text} {rng.randint(0, 99)} times"
    return text[0].upper() + text[1:] + rng.choice(_ENDINGS)


def _digits(rng: random.Random) -> str:
    groups = [str(rng.randint(0, 10 ** rng.randint(1, 6) - 1)) for _ in range(rng.randint(1, 4))]
    return rng.choice((" ", ", ", " + ")).join(groups)


def corpus_lines(seed: int = 0, n_lines: int = 6000) -> Iterator[str]:
    """`n_lines` lines, identical for the same seed: 50% sentences, 35% arithmetic, 15% digits."""
    if n_lines < 1:
        raise ValueError(f"n_lines must be >= 1, got {n_lines}")
    rng = random.Random(seed)
    for _ in range(n_lines):
        r = rng.random()
        if r < 0.5:
            yield _sentence(rng)
        elif r < 0.85:
            yield sample_problem(rng, max_operand=rng.choice((9, 20, 99))).text
        else:
            yield _digits(rng)
