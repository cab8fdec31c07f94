"""Arithmetic on large numbers with a calculator tool: a task a tiny model can learn only by
calling the tool and copying its result, and that a real model benefits from.

Two tool formats, one per tokenizer family:

* tiny (character tokenizer, which has no ``<``, ``{`` or quotes): a turn ``c:123*456`` is a
  calculator call (:class:`PrefixToolParser`); the reply is rendered ``=56088 ``;
* chat models: Hermes ``<tool_call>{"name": "calculator", "arguments": {...}}</tool_call>``,
  announced in a system message (:data:`HERMES_SYSTEM_PROMPT`).

Any other turn is the answer: reward 1 when its first integer equals the true result.
"""
from __future__ import annotations

import random
from typing import Any

from torchrl.envs.llm.transforms.tools import ParseResult, ToolCall

from streamrl.envs.base import Message
from streamrl.envs.tool_env import ToolEnv
from streamrl.envs.tools import Calculator, HermesToolParser, ToolRegistry, ToolResult, ToolRunner
from streamrl.tasks.arithmetic import first_integer
from streamrl.tasks.registry import Problem

HERMES_SYSTEM_PROMPT = (
    "You can use a calculator. To call it, write exactly\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "<arithmetic>"}}</tool_call>\n'
    "and stop; its result comes back in a tool message. When you know the answer, reply with the number only."
)


class PrefixToolParser:
    """A torchrl ``LLMToolParser`` for vocabularies without brackets: a turn that starts with
    ``prefix`` calls ``tool`` with the rest of the turn as its one argument ``arg``.

    Examples:
        >>> PrefixToolParser()("c:12*34")["calls"][0].args
        {'expression': '12*34'}
        >>> PrefixToolParser()("408")["calls"]
        []
    """

    def __init__(self, prefix: str = "c:", tool: str = "calculator", arg: str = "expression"):
        if not prefix:
            raise ValueError("PrefixToolParser prefix must not be empty")
        self.prefix, self.tool, self.arg = prefix, tool, arg

    def __call__(self, response: str | dict[str, Any]) -> ParseResult:
        text = (response if isinstance(response, str) else response.get("text", "")).strip()
        result = ParseResult()
        if text.startswith(self.prefix):
            result["text"], result["calls"] = "", [ToolCall(tool=self.tool, args={self.arg: text[len(self.prefix):]})]
        else:
            result["text"], result["calls"] = text, []
        result["meta"] = {"count": len(result["calls"])}
        return result


class LargeArithmetic:
    """Problems ``a op b`` with ``digits``-digit operands, op in ``ops`` (answers up to 2x digits).

    ``prompt`` is ``"123456*789012="`` (tiny model) and ``fields["question"]`` the same in words
    for chat models. Task-protocol compatible (``sample``, ``reward``).
    """

    name = "large_arithmetic"

    def __init__(self, digits: int = 6, ops: str = "*+"):
        if digits < 1:
            raise ValueError(f"LargeArithmetic digits = {digits}: must be >= 1")
        if not ops or set(ops) - set("+-*"):
            raise ValueError(f"LargeArithmetic ops = {ops!r}: must be a non-empty subset of '+-*'")
        self.digits, self.ops = digits, ops

    def sample(self, rng: random.Random) -> Problem:
        lo, hi = 10 ** (self.digits - 1), 10 ** self.digits - 1
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(self.ops)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Problem(prompt=f"{a}{op}{b}=", answer=str(answer),
                       fields={"question": f"What is {a} {op} {b}?", "expression": f"{a}{op}{b}"})

    def reward(self, problem: Problem, response: str) -> float:
        got = first_integer(response)
        return float(got is not None and str(got) == problem.answer)


TINY_REPLY = "={content} "
"""Plain-text template of a tool reply for the tiny model: ``c:123*456`` is answered ``=56088 ``."""


def tiny_result(result: ToolResult) -> str:
    """The calculator's number alone, or ``error``: all the character tokenizer can spell."""
    return result.output["result"] if result.status == "ok" else "error"


def tiny_calculator_env(task: LargeArithmetic, runner: ToolRunner, max_calls_per_turn: int = 1) -> ToolEnv:
    """The character-tokenizer episode: prompt ``"123*456="``, calls ``c:...``; render with
    ``PlainTextRenderer(tok, template=TINY_REPLY)``."""
    return ToolEnv(lambda p: [{"role": "user", "content": p.prompt}], task.reward, runner,
                   parser=PrefixToolParser(), max_calls_per_turn=max_calls_per_turn, format_result=tiny_result)


def chat_calculator_env(task: LargeArithmetic, runner: ToolRunner, max_calls_per_turn: int = 2) -> ToolEnv:
    """The chat-model episode: a system message teaching the Hermes format, the question as user."""
    def prompt(p: Problem) -> list[Message]:
        return [{"role": "system", "content": HERMES_SYSTEM_PROMPT}, {"role": "user", "content": p.fields["question"]}]
    return ToolEnv(prompt, task.reward, runner, parser=HermesToolParser(), max_calls_per_turn=max_calls_per_turn)


def calculator_runner(timeout_s: float = 2.0, max_workers: int = 8) -> ToolRunner:
    """A runner with the calculator only (the tool of both formats)."""
    return ToolRunner(ToolRegistry([Calculator()]), timeout_s=timeout_s, max_workers=max_workers)
