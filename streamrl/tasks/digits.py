"""Digit-string tasks a tiny random model learns by RL on CPU in a minute.

The reward gives per-position credit (fraction of positions right), so early policies
get a graded signal long before they solve the task exactly.
"""
from __future__ import annotations

import random

from streamrl.tasks.registry import Problem, register_task


def positional_score(answer: str, response: str) -> float:
    """Fraction of answer positions reproduced; extra characters count as errors.

    Examples:
        >>> positional_score("1234", "1234")
        1.0
        >>> positional_score("1234", "1299")
        0.5
        >>> positional_score("12", "1234")
        0.5
    """
    response = response.strip()
    hits = sum(a == b for a, b in zip(answer, response))
    return hits / max(len(answer), len(response), 1)


def position_credit(answer: str, response: str, weight_pos: float = 0.8, weight_fmt: float = 0.2) -> list[float]:
    """Per-character credit of the raw ``response`` summing to the digit reward.

    Mirrors :func:`positional_score` and :func:`format_score` on the stripped response: the
    stripped character ``j`` earns ``weight_pos / n`` when it equals ``answer[j]`` and
    ``weight_fmt / n`` when it is a digit within the answer's length (``n`` is their common
    denominator). Leading/trailing whitespace and extra characters earn 0 (they only count
    through ``n``).

    Returns:
        one float per character of ``response`` (not of the stripped text).

    Examples:
        >>> position_credit("12", " 13")
        [0.0, 0.5, 0.1]
    """
    credit = [0.0] * len(response)
    stripped = response.strip()
    lead = len(response) - len(response.lstrip())
    n = max(len(answer), len(stripped), 1)
    for j, ch in enumerate(stripped[: len(answer)]):
        c = weight_pos / n if ch == answer[j] else 0.0
        if ch.isdigit():
            c += weight_fmt / n
        credit[lead + j] = c
    return credit


def format_score(answer: str, response: str) -> float:
    """Fraction of the expected length filled with digits; extra characters count against.

    Examples:
        >>> format_score("1234", "9876")
        1.0
        >>> format_score("1234", "98a")
        0.5
    """
    response = response.strip()
    digits = sum(c.isdigit() for c in response[: len(answer)])
    return digits / max(len(answer), len(response), 1)


class _DigitTask:
    def __init__(self, num_digits: int = 4, **_: object):
        self.num_digits = num_digits

    def _digits(self, rng: random.Random) -> str:
        return "".join(rng.choice("0123456789") for _ in range(self.num_digits))

    def reward(self, problem: Problem, response: str) -> float:
        """0.8 x per-position credit + 0.2 x format credit (digits only, right length).

        The format part gives a random policy a graded signal on its first steps, before
        any position is right by chance (1/vocab per position).
        """
        return 0.8 * positional_score(problem.answer, response) + 0.2 * format_score(problem.answer, response)

    def token_credit(self, problem: Problem, response: str) -> list[float]:
        """The reward spread over the response's characters (see :func:`position_credit`).

        Sums to :meth:`reward` (up to float rounding): position ``j`` right -> ``0.8 / n`` at
        character ``j``, a digit there -> ``0.2 / n``; used by ``rollout.token_rewards``.
        """
        return position_credit(problem.answer, response)


@register_task("copy_digits")
class CopyDigits(_DigitTask):
    """``"3141="`` → ``"3141"``."""

    def sample(self, rng: random.Random) -> Problem:
        d = self._digits(rng)
        return Problem(prompt=f"{d}=", answer=d)


@register_task("reverse_digits")
class ReverseDigits(_DigitTask):
    """``"3141="`` → ``"1413"``."""

    def sample(self, rng: random.Random) -> Problem:
        d = self._digits(rng)
        return Problem(prompt=f"{d}=", answer=d[::-1])


@register_task("sort_digits")
class SortDigits(_DigitTask):
    """``"3141="`` → ``"1134"``."""

    def sample(self, rng: random.Random) -> Problem:
        d = self._digits(rng)
        return Problem(prompt=f"{d}=", answer="".join(sorted(d)))
