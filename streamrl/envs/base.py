"""The environment interface of multi-turn rollouts, and an adapter for plain Python functions.

An episode is a conversation: :meth:`Environment.reset` gives the opening messages for a
problem, the model answers, and :meth:`Environment.step` turns the model's text into the
environment's reply (tool results, a judge's remark, ...), a reward and whether the episode is
over. Messages are the chat-template dicts ``{"role": ..., "content": ...}`` so that any
tokenizer's template (or a plain text renderer, for the character tokenizer) can turn them into
tokens; the episode driver (:mod:`streamrl.envs.episode`) owns the tokens.

Why not torchrl's ``ChatEnv`` directly: it keeps the conversation as a ``History`` and
re-applies the chat template to the whole history every step, so the tokens the learner trains
on are a re-tokenisation of the text, not the tokens the engine sampled (BPE merges across the
turn boundary change them, and the behaviour log-probs then no longer belong to the trained
tokens); and its transforms step a whole batch in lock-step. Here an environment sees one
episode's text and the driver appends the *sampled* tokens verbatim. The tool side does reuse
torchrl's data types (:class:`torchrl.envs.llm.transforms.tools.ToolCall`, its ``ToolService``
protocol and ``ToolRegistry``), see :mod:`streamrl.envs.tools`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

Message = dict[str, str]
"""One chat message, ``{"role": "user" | "assistant" | "tool" | ..., "content": text}``."""


@dataclass
class StepResult:
    """The environment's answer to one model turn.

    messages: what the environment says next (empty when ``done``); rendered as env tokens.
    reward: reward earned by this turn (the episode's reward is the sum over turns).
    done: the episode is over; no further model turn.
    info: counters of this step for monitoring (``tool_calls``, ``tool_errors``, ...).
    """

    messages: list[Message]
    reward: float
    done: bool
    info: dict[str, float] = field(default_factory=dict)


class Environment(Protocol):
    """One episode at a time; an instance per concurrent episode (state lives in the instance)."""

    def reset(self, problem: Any) -> list[Message]:
        """Start an episode on ``problem``; returns the opening messages (system/user)."""

    def step(self, model_text: str) -> StepResult:
        """React to the model's latest turn (decoded text, without the end-of-turn token)."""


class FunctionEnv:
    """An :class:`Environment` from two plain functions.

    ``prompt_fn(problem) -> list[Message]`` opens the episode;
    ``step_fn(problem, turns) -> StepResult`` sees the problem and the model's turns so far
    (``turns[-1]`` is the latest) and decides what happens next.

    Examples:
        >>> env = FunctionEnv(lambda p: [{"role": "user", "content": p}],
        ...                   lambda p, turns: StepResult([], float(turns[-1] == "4"), True))
        >>> env.reset("2+2=")
        [{'role': 'user', 'content': '2+2='}]
        >>> env.step("4").reward
        1.0
    """

    def __init__(self, prompt_fn: Callable[[Any], list[Message]],
                 step_fn: Callable[[Any, list[str]], StepResult]):
        self.prompt_fn, self.step_fn = prompt_fn, step_fn
        self.problem: Any = None
        self.turns: list[str] = []

    def reset(self, problem: Any) -> list[Message]:
        self.problem, self.turns = problem, []
        return list(self.prompt_fn(problem))

    def step(self, model_text: str) -> StepResult:
        self.turns.append(model_text)
        return self.step_fn(self.problem, list(self.turns))
