"""Arithmetic on large numbers with a calculator tool: a task a tiny model can learn only by
calling the tool and copying its result, and that a real model benefits from.

Two tool formats, one per tokenizer family:

* tiny (character tokenizer, which has no ``<``, ``{`` or quotes): a turn ``c:123*456`` is a
  calculator call (:class:`PrefixToolParser`), and so is a turn that merely starts with ``c``:
  the calculator then evaluates the problem at hand (a tool without arguments, as "run the
  tests" is). Why: a random tiny model starts a turn with ``c`` about once in 64 samples, so it
  finds the tool within a few batches, while copying a 7-character expression behind ``c:`` is
  a second skill it would have to find first, by chance (copying is what ``copy_digits``
  teaches on its own). The reply is rendered ``=56088 ``;
* chat models: Hermes ``<tool_call>{"name": "calculator", "arguments": {...}}</tool_call>``,
  announced in a system message (:data:`HERMES_SYSTEM_PROMPT`).

Any other turn is the answer, scored by the worker's reward (``rollout.rewards``; the task's
own is per-digit credit, :class:`~streamrl.tasks.arithmetic.LargeArithmetic`).
"""
from __future__ import annotations

from typing import Any, Callable

from torchrl.envs.llm.transforms.tools import ParseResult, ToolCall

from streamrl.envs.base import Message
from streamrl.envs.tool_env import ToolEnv
from streamrl.envs.tools import Calculator, HermesToolParser, ToolRegistry, ToolResult, ToolRunner
from streamrl.tasks.arithmetic import LargeArithmetic
from streamrl.tasks.registry import Problem

__all__ = ["HERMES_SYSTEM_PROMPT", "LargeArithmetic", "PrefixToolParser", "TINY_REPLY", "calculator_runner",
           "chat_calculator_env", "tiny_calculator_env", "tiny_result"]

HERMES_SYSTEM_PROMPT = (
    "You can use a calculator. To call it, write exactly\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "<arithmetic>"}}</tool_call>\n'
    "and stop; its result comes back in a tool message. When you know the answer, reply with the number only."
)


class PrefixToolParser:
    """A torchrl ``LLMToolParser`` for vocabularies without brackets: a turn that starts with
    ``prefix + sep`` calls ``tool`` with the rest of the turn as its one argument ``arg``.

    With ``default_arg`` (a function returning the argument), a turn that starts with ``prefix``
    but not ``sep`` is a call too, with that default argument (the rest of the turn is ignored).

    Examples:
        >>> PrefixToolParser()("c:12*34")["calls"][0].args
        {'expression': '12*34'}
        >>> PrefixToolParser()("408")["calls"], PrefixToolParser()("c12")["calls"]
        ([], [])
        >>> PrefixToolParser(default_arg=lambda: "5*6")("c")["calls"][0].args
        {'expression': '5*6'}
    """

    def __init__(self, prefix: str = "c", sep: str = ":", tool: str = "calculator", arg: str = "expression",
                 default_arg: Callable[[], str] | None = None):
        if not prefix:
            raise ValueError("PrefixToolParser prefix must not be empty")
        self.prefix, self.sep, self.tool, self.arg, self.default_arg = prefix, sep, tool, arg, default_arg

    def __call__(self, response: str | dict[str, Any]) -> ParseResult:
        text = (response if isinstance(response, str) else response.get("text", "")).strip()
        result = ParseResult()
        head = self.prefix + self.sep
        if text.startswith(head):
            result["text"], result["calls"] = "", [ToolCall(tool=self.tool, args={self.arg: text[len(head):]})]
        elif text.startswith(self.prefix) and self.default_arg is not None:
            result["text"], result["calls"] = "", [ToolCall(tool=self.tool, args={self.arg: self.default_arg()})]
        else:
            result["text"], result["calls"] = text, []
        result["meta"] = {"count": len(result["calls"])}
        return result


TINY_REPLY = "={content} "
"""Plain-text template of a tool reply for the tiny model: ``c:123*456`` is answered ``=56088 ``."""


def tiny_result(result: ToolResult) -> str:
    """The calculator's number alone, or ``error``: all the character tokenizer can spell."""
    return result.output["result"] if result.status == "ok" else "error"


RewardFn = Callable[[Problem, str], float]


def tiny_calculator_env(task: LargeArithmetic, runner: ToolRunner, max_calls_per_turn: int = 1,
                        reward_fn: RewardFn | None = None, call_reward: float = 0.0) -> ToolEnv:
    """The character-tokenizer episode: prompt ``"123*456="``, calls ``c:...`` or a bare ``c``
    (the problem's own expression); render with ``PlainTextRenderer(tok, template=TINY_REPLY)``.
    ``reward_fn`` scores the final answer (default ``task.reward``)."""
    env = ToolEnv(lambda p: [{"role": "user", "content": p.prompt}], reward_fn or task.reward, runner,
                  max_calls_per_turn=max_calls_per_turn, format_result=tiny_result, call_reward=call_reward)
    env.parser = PrefixToolParser(default_arg=lambda: env.problem.fields["expression"])
    return env


def chat_calculator_env(task: LargeArithmetic, runner: ToolRunner, max_calls_per_turn: int = 2,
                        reward_fn: RewardFn | None = None, call_reward: float = 0.0) -> ToolEnv:
    """The chat-model episode: a system message teaching the Hermes format, the question as user."""
    def prompt(p: Problem) -> list[Message]:
        return [{"role": "system", "content": HERMES_SYSTEM_PROMPT}, {"role": "user", "content": p.fields["question"]}]
    return ToolEnv(prompt, reward_fn or task.reward, runner, parser=HermesToolParser(),
                   max_calls_per_turn=max_calls_per_turn, call_reward=call_reward)


def calculator_runner(timeout_s: float = 2.0, max_workers: int = 8) -> ToolRunner:
    """A runner with the calculator only (the tool of both formats)."""
    return ToolRunner(ToolRegistry([Calculator()]), timeout_s=timeout_s, max_workers=max_workers)
