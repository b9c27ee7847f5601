"""The toy arithmetic task format, shared by the tokenizer corpus and the GRPO demo.

One format everywhere ("Q: 12+7=? A: 19") so the tokenizer has seen exactly the strings the demo
prompts with and rewards on. No chat template: the tiny models are plain causal LMs.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal

Op = Literal["+", "-", "*"]
OPS: tuple[Op, ...] = ("+", "-", "*")

_ANSWER_RE = re.compile(r"-?\d+")


@dataclass(frozen=True)
class ArithmeticProblem:
    """One binary arithmetic question with a non-negative integer answer."""

    a: int
    op: Op
    b: int

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"ArithmeticProblem.op must be one of {OPS}, got {self.op!r}")
        if self.a < 0 or self.b < 0:
            raise ValueError(f"ArithmeticProblem operands must be >= 0, got a={self.a}, b={self.b}")

    @property
    def answer(self) -> int:
        return {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]

    @property
    def prompt(self) -> str:
        """What the policy is given; the completion should start with ' <answer>'."""
        return f"Q: {self.a}{self.op}{self.b}=? A:"

    @property
    def text(self) -> str:
        """Prompt plus the correct completion (what the tokenizer corpus contains)."""
        return f"{self.prompt} {self.answer}"


def sample_problem(rng: random.Random, max_operand: int = 20, ops: tuple[Op, ...] = OPS) -> ArithmeticProblem:
    """Draw one problem; subtraction is ordered so answers stay non-negative."""
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    op = rng.choice(ops)
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if op == "-" and b > a:
        a, b = b, a
    return ArithmeticProblem(a, op, b)


def sample_problems(n: int, seed: int = 0, max_operand: int = 20, ops: tuple[Op, ...] = OPS) -> list[ArithmeticProblem]:
    """`n` deterministic problems for a given seed."""
    rng = random.Random(seed)
    return [sample_problem(rng, max_operand, ops) for _ in range(n)]


def parse_answer(completion: str) -> int | None:
    """First integer in a completion, or None: the reward's reading of what the model answered."""
    m = _ANSWER_RE.search(completion)
    return int(m.group()) if m else None
