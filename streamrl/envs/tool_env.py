"""An environment where the model may call tools before it answers.

Each model turn is parsed for tool calls (:class:`~streamrl.envs.tools.HermesToolParser` by
default). With calls, the tools run (bounded, concurrently, :class:`~streamrl.envs.tools.ToolRunner`)
and their results come back as ``tool`` messages; without, the turn is the final answer and
``reward_fn(problem, answer_text)`` scores it. The episode driver limits turns and tokens.
"""
from __future__ import annotations

from typing import Any, Callable

from streamrl.envs.base import Message, StepResult
from streamrl.envs.tools import HermesToolParser, ToolResult, ToolRunner


class ToolEnv:
    """:class:`~streamrl.envs.base.Environment` with tools; one instance per concurrent episode.

    prompt_fn: problem -> opening messages (say there which tools exist and how to call them).
    reward_fn: (problem, final answer text) -> reward.
    runner: shared by all episodes of a worker (its counters are the worker's tool metrics).
    max_calls_per_turn: calls beyond it are answered with an error, not run (a model that
        emits a hundred calls must not occupy the pool).
    format_result: ToolResult -> the tool message's text (default: ``content``, the service's
        dict as JSON or the error text).
    call_reward: reward of the episode's first turn whose calls all succeed (a shaping term that
        pays for finding the tool before the answer it enables is learned; 0 = off).
    """

    def __init__(self, prompt_fn: Callable[[Any], list[Message]], reward_fn: Callable[[Any, str], float],
                 runner: ToolRunner, parser: Callable[[str], dict] | None = None, max_calls_per_turn: int = 4,
                 format_result: Callable[[ToolResult], str] | None = None, call_reward: float = 0.0):
        if max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn = {max_calls_per_turn}: must be >= 1")
        self.prompt_fn, self.reward_fn, self.runner = prompt_fn, reward_fn, runner
        self.parser = parser or HermesToolParser()
        self.max_calls_per_turn = max_calls_per_turn
        self.format_result = format_result or (lambda r: r.content)
        self.call_reward = call_reward
        self.problem: Any = None
        self._paid = False

    def reset(self, problem: Any) -> list[Message]:
        self.problem, self._paid = problem, False
        return list(self.prompt_fn(problem))

    def step(self, model_text: str) -> StepResult:
        parsed = self.parser(model_text)
        calls = parsed["calls"]
        if not calls:
            return StepResult([], float(self.reward_fn(self.problem, model_text)), True, {"tool_calls": 0.0})
        run, refused = calls[: self.max_calls_per_turn], calls[self.max_calls_per_turn:]
        results = self.runner.run(run)
        messages = [{"role": "tool", "content": self.format_result(r)} for r in results]
        messages += [{"role": "tool", "content": f"error: more than {self.max_calls_per_turn} calls in one turn"}
                     for _ in refused]
        errors = sum(r.status != "ok" for r in results) + len(refused)
        info = {"tool_calls": float(len(calls)), "tool_errors": float(errors),
                "tool_latency_s": sum(r.latency_s for r in results)}
        if errors == 0 and not self._paid and self.call_reward:
            self._paid = True
            info["call_reward"] = self.call_reward  # the monitor separates it from the answer's reward
            return StepResult(messages, self.call_reward, False, info)
        return StepResult(messages, 0.0, False, info)
