"""The toy verifiable task and GRPO's group-normalised advantages.

Reward: 1 for the right answer (the first integer of the completion, as `parse_answer` reads
it, which must open the completion); 0.2 for a wrong number in that place, so a
random tiny model gets a learning signal inside each GRPO group early, but cannot saturate the
reward by emitting digits: past the format, only correct answers pay.
"""

from __future__ import annotations

import numpy as np

from ..models.prompts import ArithmeticProblem, parse_answer, sample_problems


def reward(problem: ArithmeticProblem, completion: str) -> float:
    text = completion.lstrip()
    if not text[:1].isdigit():  # the answer must come first
        return 0.0
    return 1.0 if parse_answer(text) == problem.answer else 0.2


def problems_for_step(step: int, count: int, seed: int, max_operand: int) -> list[ArithmeticProblem]:
    """The same problems at the same step in every arm, so arms differ only by the fix."""
    return sample_problems(count, seed=seed * 100_003 + step, max_operand=max_operand)


def group_advantages(rewards_PN: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO: (r - mean of its group) / (std of its group + eps); a flat group gets zeros."""
    r = np.asarray(rewards_PN, dtype=np.float64)
    return (r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + eps)
