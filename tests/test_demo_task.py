"""The demo's toy task: reward semantics and GRPO advantages (pure logic)."""

from __future__ import annotations

import numpy as np

from moe_replay.demo.task import group_advantages, problems_for_step, reward
from moe_replay.models import ArithmeticProblem


def test_reward_pays_correct_answers_and_only_a_little_for_format():
    p = ArithmeticProblem(3, "+", 4)
    assert reward(p, " 7") == 1.0 and reward(p, " 7 and more") == 1.0
    assert reward(p, " 8") == 0.2  # a number, wrong
    assert reward(p, " 77777777") == 0.2  # digits alone cannot saturate the reward
    assert reward(p, " cat 7") == 0.0  # the answer must come first
    assert reward(p, "") == 0.0


def test_group_advantages_normalise_within_each_group():
    adv = group_advantages(np.array([[1.0, 0.0, 0.0, 1.0], [0.2, 0.2, 0.2, 0.2]]))
    assert np.allclose(adv[0], [1, -1, -1, 1], atol=1e-4)
    assert np.all(adv[1] == 0)  # a flat group carries no signal


def test_every_arm_sees_the_same_problems_at_a_step():
    assert problems_for_step(3, 8, 0, 9) == problems_for_step(3, 8, 0, 9)
    assert problems_for_step(3, 8, 0, 9) != problems_for_step(4, 8, 0, 9)
