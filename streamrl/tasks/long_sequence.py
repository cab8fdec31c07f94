"""``long_sequence``: short prompts whose correct answers are hundreds of tokens long.

The model writes out a deterministic sequence: count from A to B by k (up or down), the
first n multiples of k, the odd or even numbers between two bounds, the squares of a range,
or a word pattern repeated to a given length. Several rule families and phrasings, so a run
trains "follow a rule for many steps" rather than one template. The answer's length is
drawn per problem from ``[min_answer_tokens, max_answer_tokens]``, counted the way
SmolLM2's tokenizer splits the answer (:func:`estimate_tokens`), while the prompt stays
under ~35 tokens (no long list to copy), so prompt + answer fits a 1k-token response cap.

Reward (:func:`prefix_score`): the fraction of the sequence written correctly, in order,
from the start; stopping early, drifting, trailing junk and a lead-in all cost in
proportion. Terms are read as integers and words, so the separator is not graded.

Held-out problems (:meth:`LongSequence.sample_held_out`) are sequences whose hash is odd;
training draws only even ones, so no evaluated sequence is ever trained on. Each problem's
family travels as ``fields["source_dataset"]``, so evaluation reports accuracy per family.
"""
from __future__ import annotations

import math
import random
import re
import zlib
from itertools import count
from typing import Callable, Iterator

from streamrl.tasks.registry import Problem, register_task

# Integers (with their sign) and words.
_TERM = re.compile(r"-?\d+|[^\W\d_]+")
# SmolLM2 splits numbers into digits, keeps the space before a number as its own token
# (" -" fuses with a sign) and makes " red"-like words one token (see estimate_tokens).
_TOKEN = re.compile(r"\d|[^\W\d_]+|[^\w\s]| (?=\d)")
# Common words that SmolLM2 encodes as one token with or without a leading space.
WORDS = ("red", "green", "blue", "cat", "dog", "sun", "moon", "tree", "fish", "bird", "one", "two")
# Leading terms searched for the start of the sequence (a lead-in such as "Sure, here it is:").
MAX_LEAD_TERMS = 32


def terms(text: str) -> list[str]:
    """The integers and (lower-cased) words of ``text``, in order.

    Examples:
        >>> terms("Sure: 12, 5, -3 and Red")
        ['sure', '12', '5', '-3', 'and', 'red']
    """
    return [m.group().lower() for m in _TERM.finditer(text)]


def estimate_tokens(text: str) -> int:
    """Tokens of ``text`` as SmolLM2 counts them for these answers: one per digit, word and
    punctuation mark, plus one for the space before a number.

    Examples:
        >>> estimate_tokens("998, 1005, -3")   # 3 + (',' ' ' 4) + (',' ' -' '3')
        12
        >>> estimate_tokens("red, green")
        3
    """
    return len(_TOKEN.findall(text))


def _alignment(answer: list[str], got: list[str]) -> tuple[int, int, int]:
    """(start, matched, denominator): the lead-in length, the correct prefix from there and
    the length the score divides by (the longer of answer + lead-in and the response)."""
    best = (0, 0, max(len(answer), len(got), 1))
    for start in range(min(len(got), MAX_LEAD_TERMS + 1)):
        k = 0
        while k < len(answer) and start + k < len(got) and got[start + k] == answer[k]:
            k += 1
        denom = max(len(answer) + start, len(got), 1)
        if k * best[2] > best[1] * denom:
            best = (start, k, denom)
    return best


def prefix_score(answer: str, response: str) -> float:
    """Correct terms in order from the sequence's start, over the longer of the answer and
    the response: in [0, 1], 1 only for the exact sequence (separators are not graded).

    A lead-in of up to :data:`MAX_LEAD_TERMS` terms before the first one is skipped but counts
    in the length, as do terms after the end; a term off the rule ends the credit.

    Examples:
        >>> prefix_score("1, 2, 3, 4", "1, 2, 3, 4")
        1.0
        >>> prefix_score("1, 2, 3, 4", "1, 2")          # stopped halfway
        0.5
        >>> prefix_score("1, 2, 3, 4", "1, 2, 7, 4")    # drifted at the third term
        0.5
        >>> prefix_score("1, 2, 3, 4", "1 2 3 4 5 6 7 8")   # twice as long as asked
        0.5
        >>> prefix_score("1, 2, 3, 4", "Here: 1, 2, 3, 4")  # a one-word lead-in
        0.8
        >>> prefix_score("1, 2, 3, 4", "no idea")
        0.0
    """
    _, k, denom = _alignment(terms(answer), terms(response))
    return k / denom


def prefix_credit(answer: str, response: str) -> list[float]:
    """Per-character credit of ``response`` summing to :func:`prefix_score`: ``1 / denominator``
    on the last character of every correctly placed term, 0 elsewhere.

    Examples:
        >>> prefix_credit("1, 2", "1, 27")
        [0.5, 0.0, 0.0, 0.0, 0.0]
    """
    want = terms(answer)
    spans = [m.span() for m in _TERM.finditer(response)]
    start, k, denom = _alignment(want, [response[a:b].lower() for a, b in spans])
    credit = [0.0] * len(response)
    for a, b in spans[start:start + k]:
        credit[b - 1] = 1.0 / denom
    return credit


# A family draws its parameters from (rng, num_digits) and returns (endless term generator,
# prompt maker); the prompt maker gets the terms written so it can name the last one or the count.
Family = Callable[[random.Random, int], tuple[Iterator[str], Callable[[list[str]], str]]]


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def _count_up(rng: random.Random, digits: int):
    a, k = _number(rng, digits), rng.randint(1, 9)
    phrasings = (
        lambda t: f"Count from {a} to {t[-1]} in steps of {k}, separated by commas.",
        lambda t: f"List the numbers {a}, {a + k}, {a + 2 * k}, ... up to {t[-1]}.",
        lambda t: f"Start at {a} and keep adding {k}. Write the first {len(t)} numbers, comma-separated.",
    )
    return (str(a + i * k) for i in count()), rng.choice(phrasings)


def _count_down(rng: random.Random, digits: int):
    a, k = _number(rng, digits), rng.randint(1, 9)
    phrasings = (
        lambda t: f"Count down from {a} to {t[-1]} in steps of {k}, separated by commas.",
        lambda t: f"List the numbers {a}, {a - k}, {a - 2 * k}, ... down to {t[-1]}.",
    )
    return (str(a - i * k) for i in count()), rng.choice(phrasings)


def _multiples(rng: random.Random, digits: int):
    k = max(2, _number(rng, digits))
    return (str(k * i) for i in count(1)), (
        lambda t: f"Write the first {len(t)} multiples of {k}, separated by commas.")


def _parity(rng: random.Random, digits: int):
    odd = rng.random() < 0.5
    a = _number(rng, digits)
    a += (a % 2 == 0) == odd   # first term of the asked parity
    kind = "odd" if odd else "even"
    return (str(a + 2 * i) for i in count()), (
        lambda t: f"List the {kind} numbers from {a} to {t[-1]}, separated by commas.")


def _squares(rng: random.Random, digits: int):
    a = _number(rng, max(1, math.ceil(digits / 2)))
    phrasings = (
        lambda t: f"List the squares of the whole numbers from {a} to {a + len(t) - 1}, separated by commas.",
        lambda t: f"Write n*n for every n from {a} to {a + len(t) - 1}, comma-separated.",
    )
    return (str((a + i) ** 2) for i in count()), rng.choice(phrasings)


def _repeat(rng: random.Random, digits: int):
    pattern = rng.sample(WORDS, rng.randint(2, 4))
    shown = " ".join(pattern)
    phrasings = (
        lambda t: f"Repeat the words '{shown}' in order until you have written {len(t)} words, separated by commas.",
        lambda t: f"Write {len(t)} words, comma-separated, cycling through: {', '.join(pattern)}.",
    )
    return (pattern[i % len(pattern)] for i in count()), rng.choice(phrasings)


FAMILIES: dict[str, Family] = {
    "count_up": _count_up, "count_down": _count_down, "multiples": _multiples,
    "parity": _parity, "squares": _squares, "repeat": _repeat,
}


@register_task("long_sequence")
class LongSequence:
    """``"Count from 512 to 1548 in steps of 7, separated by commas."`` -> ``"512, 519, ..., 1548"``.

    Args:
        num_digits: digits of the first number (of the step for multiples, of the base for
            squares: about half, so the squares have about this many digits).
        min_answer_tokens, max_answer_tokens: each answer's length is drawn uniformly from this
            range (counted by :func:`estimate_tokens`); the range must exceed the longest term.
    """

    def __init__(self, num_digits: int = 4, min_answer_tokens: int = 512, max_answer_tokens: int = 1024,
                 **_: object):
        if not 1 <= num_digits <= 12:
            raise ValueError(f"long_sequence num_digits = {num_digits}: must be in [1, 12]")
        if min_answer_tokens < 1 or max_answer_tokens < min_answer_tokens + 32:
            raise ValueError(f"long_sequence answer tokens [{min_answer_tokens}, {max_answer_tokens}]: need "
                             "min_answer_tokens >= 1 and max_answer_tokens >= min_answer_tokens + 32")
        self.num_digits, self.min_tokens, self.max_tokens = num_digits, min_answer_tokens, max_answer_tokens

    def _draw(self, rng: random.Random) -> tuple[Problem, bool]:
        """One problem and whether it belongs to the held-out half (odd CRC of its sequence)."""
        family = rng.choice(sorted(FAMILIES))
        gen, prompt = FAMILIES[family](rng, self.num_digits)
        target = rng.randint(self.min_tokens, self.max_tokens)
        written, tokens = [], 0
        for term in gen:   # stop at the first length >= target; drop that term if it overshoots
            tokens += estimate_tokens(", " + term if written else term)
            written.append(term)
            if tokens >= target:
                break
        if tokens > self.max_tokens:
            written.pop()
        answer = ", ".join(written)
        held_out = zlib.crc32(answer.encode()) % 2 == 1
        return Problem(prompt=prompt(written), answer=answer, fields={"source_dataset": family}), held_out

    def sample(self, rng: random.Random) -> Problem:
        """A training problem (even half of the sequence space); uses only ``rng``."""
        while True:
            problem, held_out = self._draw(rng)
            if not held_out:
                return problem

    def sample_held_out(self, rng: random.Random) -> Problem:
        """A held-out problem: its sequence is never one :meth:`sample` returns."""
        while True:
            problem, held_out = self._draw(rng)
            if held_out:
                return problem

    def reward(self, problem: Problem, response: str) -> float:
        """:func:`prefix_score`: the fraction of the sequence right from its start."""
        return prefix_score(problem.answer, response)

    def token_credit(self, problem: Problem, response: str) -> list[float]:
        """:func:`prefix_credit`: the reward on the characters ending each correct term."""
        return prefix_credit(problem.answer, response)
