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

    Mirrors :func:`positional_score` and :func:`format_score` on the stripped response, with
    the length penalty given to the characters that caused it:

    * stripped character ``j < len(answer)`` earns ``weight_pos / len(answer)`` when it equals
      ``answer[j]`` plus ``weight_fmt / len(answer)`` when it is a digit;
    * when the response is longer than the answer, the reward divides by the longer length
      instead; that shortfall (negative) is spread evenly over the extra characters, so the
      credit for "stop here" sits on the characters that did not stop;
    * surrounding whitespace earns 0.

    Returns:
        one float per character of ``response`` (not of the stripped text); the sum equals
        ``weight_pos * positional_score + weight_fmt * format_score`` up to float rounding.

    Examples:
        >>> position_credit("12", " 13")
        [0.0, 0.5, 0.1]
        >>> [round(c, 3) for c in position_credit("12", "123")]   # reward (0.8*2 + 0.2*2) / 3
        [0.5, 0.5, -0.333]
    """
    credit = [0.0] * len(response)
    stripped = response.strip()
    lead = len(response) - len(response.lstrip())
    n_ans = max(len(answer), 1)
    earned = 0.0
    for j, ch in enumerate(stripped[: len(answer)]):
        c = weight_pos / n_ans if ch == answer[j] else 0.0
        if ch.isdigit():
            c += weight_fmt / n_ans
        credit[lead + j] = c
        earned += c
    extra = len(stripped) - len(answer)
    if extra > 0:
        total = (weight_pos * positional_score(answer, response) + weight_fmt * format_score(answer, response))
        for j in range(len(answer), len(stripped)):
            credit[lead + j] = (total - earned) / extra
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
        character ``j``, a digit there -> ``0.2 / n`` (``n`` digits in the answer), the
        penalty of a too-long response on its extra characters; used by ``rollout.token_rewards``.
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
