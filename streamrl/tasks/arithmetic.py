"""Integer arithmetic in natural language, for real pretrained models.

Reward is 1 when the first integer in the response equals the answer, else 0.
"""
from __future__ import annotations

import random
import re

from streamrl.tasks.registry import Problem, register_task

_INT = re.compile(r"-?\d+")


def first_integer(text: str) -> int | None:
    m = _INT.search(text.replace(",", ""))
    return int(m.group()) if m else None


@register_task("arithmetic")
class Arithmetic:
    """``"What is 12 + 35? Answer:"`` → ``"47"``."""

    def __init__(self, num_digits: int = 2, **_: object):
        self.num_digits = num_digits

    def sample(self, rng: random.Random) -> Problem:
        hi = 10**self.num_digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        op = rng.choice("+-")
        ans = a + b if op == "+" else a - b
        return Problem(prompt=f"What is {a} {op} {b}? Answer with the number only.", answer=str(ans))

    def reward(self, problem: Problem, response: str) -> float:
        got = first_integer(response)
        return float(got is not None and str(got) == problem.answer)
