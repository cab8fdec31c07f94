"""Pulling the final answer out of a model's free-form response.

A policy rarely answers with the bare answer: it writes ``"12 + 35 = 47."``, ``"The answer is
**1,010**"`` or a worked solution ending in ``\\boxed{65}``. :func:`extract_answer` applies,
in order, the first rule that finds something:

1. the last ``<answer>...</answer>`` tag (the ``tag`` prompt format asks for it);
2. the last ``\\boxed{...}`` (math-style answers; nested braces are kept);
3. when the expected answer is a number: the last number in the text (thousands separators
   dropped, so ``1,010`` reads ``1010``; a trailing full stop is not a decimal point);
4. otherwise the last non-empty line, without an ``Answer:`` / ``The answer is`` lead-in,
   surrounding ``**`` / backticks / quotes, and a trailing full stop.

Why the *last* number and not the first: a response that restates the question
(``"81 + -78 = 3"``) or shows its steps puts the result last. The expected answer is only
used to decide whether a *number* is wanted (rule 3), never to search for its value.

Examples:
    >>> extract_answer("12 + 35 = 47.", "47")
    '47'
    >>> extract_answer("Total: 1,010 legs", "1010")
    '1010'
    >>> extract_answer("so <answer>03:30:57</answer>", "03:30:57")
    '03:30:57'
    >>> extract_answer("Answer: 53*58/53 + 53.", "53*58/53 + 53")
    '53*58/53 + 53'
"""
from __future__ import annotations

import re

_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_LEAD_IN = re.compile(r"^(?:(?:the\s+)?(?:final\s+)?answer(?:\s+is)?\s*[:=]?|result\s*[:=])\s*", re.IGNORECASE)


def is_number(text: str) -> bool:
    """True when ``text`` (stripped) is a plain integer or decimal, e.g. ``-3`` or ``1.378``."""
    return _NUMBER.fullmatch(text.strip()) is not None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def last_number(text: str) -> str | None:
    """The last integer or decimal in ``text`` (thousands separators removed), or None."""
    found = _NUMBER.findall(_THOUSANDS.sub("", text))
    return found[-1] if found else None


def _clean_line(line: str) -> str:
    line = _LEAD_IN.sub("", line.strip())
    line = line.strip().strip("*`\"'").strip()
    return line[:-1].rstrip() if line.endswith(".") else line


def extract_answer(response: str, expected: str) -> str | None:
    """The answer ``response`` gives (see the module doc for the rules); None when it gives none.

    Args:
        response: the decoded response text.
        expected: the reference answer; only its *kind* (number or not) is looked at.
    """
    tags = _TAG.findall(response)
    if tags:
        return tags[-1].strip()
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    if is_number(expected):
        return last_number(response)
    lines = [ln for ln in response.splitlines() if ln.strip()]
    if not lines:
        return None
    return _clean_line(lines[-1]) or None


# "Answer: X", "The final answer is X", "So, the answer is: X": "answer" then "is" or ":"/"="
_FINAL_MARKER = re.compile(r"\banswer\s*(?:is\b\s*[:=]?|[:=])\s*(.*)$", re.IGNORECASE | re.MULTILINE)


def final_answer(response: str, expected: str) -> str | None:
    """The answer after the last ``Answer: X`` (or ``the answer is X``) of a worked response, or
    None without one.

    A chain of thought holds many numbers; only the one the response commits to counts, so a
    response that never states its answer gives none (the ``think`` prompt format asks for an
    ``Answer:`` line; instruct models often write ``So, the answer is: X``, accepted too). The
    text after the marker, to the end of its line, goes through :func:`extract_answer`
    (``Answer: 47 legs`` reads ``47`` when a number is expected; ``**Answer:** 47`` is accepted).

    Examples:
        >>> final_answer("3 + 4 = 7, plus 5 is 12.\\nAnswer: 12", "12")
        '12'
        >>> final_answer("So, the final answer is 17.", "17")
        '17'
        >>> final_answer("3 + 4 = 7, plus 5 is 12.", "12") is None
        True
    """
    found = _FINAL_MARKER.findall(response.replace("**", ""))
    if not found:
        return None
    text = found[-1].strip()
    return extract_answer(text, expected) if text else None
