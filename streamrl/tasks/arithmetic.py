"""Integer arithmetic in natural language, for real pretrained models.

Reward is 1 when the first integer in the response equals the answer, else 0.
"""
from __future__ import annotations

import random
import re

from streamrl.tasks.digits import format_score, positional_score
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


@register_task("large_arithmetic")
class LargeArithmetic:
    """``"123456*789012="`` -> ``"97408265472"``: operands of ``num_digits`` digits, op in ``ops``.

    Too hard to compute in the head for a small model: the multi-turn tool task
    (:mod:`streamrl.envs.calculator_task`), where the model learns to call a calculator and copy
    its result. ``fields["question"]`` asks the same in words (chat models), and
    ``fields["expression"]`` is what a calculator evaluates.
    """

    def __init__(self, num_digits: int = 6, ops: str = "*", **_: object):
        if num_digits < 1:
            raise ValueError(f"large_arithmetic num_digits = {num_digits}: must be >= 1")
        if not ops or set(ops) - set("+-*"):
            raise ValueError(f"large_arithmetic ops = {ops!r}: must be a non-empty subset of '+-*'")
        self.num_digits, self.ops = num_digits, ops

    def sample(self, rng: random.Random) -> Problem:
        lo, hi = 10 ** (self.num_digits - 1), 10 ** self.num_digits - 1
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(self.ops)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Problem(prompt=f"{a}{op}{b}=", answer=str(answer),
                       fields={"question": f"What is {a} {op} {b}? Answer with the number only.",
                               "expression": f"{a}{op}{b}"})

    def reward(self, problem: Problem, response: str) -> float:
        """0.8 x per-position credit + 0.2 x format credit on the answer, as the digit tasks:
        graded, so a policy that copies most of a tool's result already earns most of it, and
        a turn of digits earns more than one that calls the tool again."""
        return 0.8 * positional_score(problem.answer, response) + 0.2 * format_score(problem.answer, response)
