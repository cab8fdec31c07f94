"""Environment plug-ins for the worker tests (``env.name = 'env_plugins:<function>'``).

Each is ``function(cfg, tokenizer, runner) -> Environment``, as streamrl.envs.factory calls it
once per episode. The random tiny model rarely writes a tool call, so turn 1 *is* a call here,
whatever the model wrote; the tools run for real through the worker's runner.
"""
from __future__ import annotations

import threading

from streamrl.envs.calculator_task import tiny_result
from streamrl.envs.tool_env import ToolEnv
from streamrl.envs.tools import ToolCall
from streamrl.tasks import build_task

RELEASE = threading.Event()
"""Set by a test when it ends: the hanging tool returns then."""
BETWEEN_TURNS: list = []
"""Callables a test adds; the ``learner_step`` tool runs and removes them (e.g. publish a new version)."""


class Hang:
    name = "hang"

    def __call__(self, **_):
        RELEASE.wait(120)
        return {"result": "late"}


class Boom:
    name = "boom"

    def __call__(self, **_):
        raise RuntimeError("tool exploded")


class LearnerStep:
    """Calls the test's hooks (the learner publishing) while the episode waits for the tool."""
    name = "learner_step"

    def __call__(self, **_):
        while BETWEEN_TURNS:
            BETWEEN_TURNS.pop(0)()
        return {"result": "0"}


def _first_turn_calls(cfg, runner, calls_of):
    task = build_task(cfg.task)
    turns: list[str] = []

    def parser(text):
        turns.append(text)
        return {"text": text, "calls": calls_of(env.problem) if len(turns) == 1 else [], "meta": {}}

    env = ToolEnv(lambda p: [{"role": "user", "content": p.prompt}], task.reward, runner, parser=parser,
                  max_calls_per_turn=cfg.env.max_tool_calls, format_result=tiny_result)
    return env


def calculator_then_answer(cfg, tok, runner):
    """Turn 1 calls the real calculator on the problem; turn 2 is the answer."""
    return _first_turn_calls(cfg, runner, lambda p: [ToolCall("calculator", {"expression": p.fields["expression"]})])


def flaky_tools(cfg, tok, runner):
    """Turn 1 calls a tool that hangs past the time limit and one that raises."""
    for tool in (Hang(), Boom()):
        if tool.name not in runner.registry:
            runner.registry.register(tool)
    return _first_turn_calls(cfg, runner, lambda p: [ToolCall("hang", {}), ToolCall("boom", {})])


def learner_step_between_turns(cfg, tok, runner):
    """Turn 1 calls a tool during which the test's learner publishes a new version."""
    if "learner_step" not in runner.registry:
        runner.registry.register(LearnerStep())
    return _first_turn_calls(cfg, runner, lambda p: [ToolCall("learner_step", {})])


NOT_A_FUNCTION = 3
