"""Reward functions from a registry: verifiable rewards and ``module:function`` plug-ins.

A reward function maps ``(problem, response_text) -> float``. A *reward spec* (config
``rollout.rewards``) combines several with weights: ``"exact_answer=1.0,format=0.1"``.
Names resolve in this order: the built-ins below (``task`` = the task's own reward),
then ``package.module:function`` imported on first use. An optional *reward model* is a
hook ``package.module:factory`` called once as ``factory(device)``; it returns a callable
``(prompts: list[str], responses: list[str]) -> list[float]`` scored batch-wise, so a
learned reward model can live on its own device.

Examples:
    >>> from streamrl.tasks.registry import Problem
    >>> fn = build_reward("exact_answer=1.0,format=0.5")
    >>> fn.score([Problem("What is 2 + 3?", "5")], ["5"])[1]
    [[1.0, 1.0]]
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Callable

from streamrl.tasks.registry import Problem

RewardFn = Callable[[Problem, str], float]
_INT = re.compile(r"-?\d+")
_REGISTRY: dict[str, RewardFn] = {}


class RewardSpecError(ValueError):
    """A reward spec names an unknown reward, a bad weight or an unimportable plug-in."""


def register_reward(name: str):
    """Decorator: ``@register_reward("my_reward")`` on ``fn(problem, response) -> float``."""

    def wrap(fn: RewardFn) -> RewardFn:
        _REGISTRY[name] = fn
        return fn

    return wrap


def available_rewards() -> list[str]:
    return sorted(_REGISTRY) + ["task"]


def _answer_text(response: str) -> str:
    """The answer part of a response: text before the first newline, stripped."""
    return response.strip().split("\n", 1)[0].strip()


@register_reward("exact_answer")
def exact_answer(problem: Problem, response: str) -> float:
    """1 when the response's answer equals ``problem.answer``.

    Integers compare by value of the first integer ("The answer is 47." == "47");
    other answers by exact text of the first line.
    """
    if _INT.fullmatch(problem.answer.strip()):
        m = _INT.search(response.replace(",", ""))
        return float(m is not None and int(m.group()) == int(problem.answer))
    return float(_answer_text(response) == problem.answer.strip())


@register_reward("format")
def format_reward(problem: Problem, response: str) -> float:
    """1 when the response is *only* the answer's kind of token (an integer for integer
    answers, a single non-empty line otherwise): rewards following "answer with the number only"."""
    text = response.strip()
    if _INT.fullmatch(problem.answer.strip()):
        return float(_INT.fullmatch(text.rstrip(".")) is not None)
    return float(bool(text) and "\n" not in text)


def _import(target: str, field: str):
    mod_name, _, attr = target.partition(":")
    if not mod_name or not attr:
        raise RewardSpecError(f"{field} = {target!r}: a plug-in is 'package.module:function'")
    try:
        obj = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise RewardSpecError(f"{field} = {target!r}: cannot import ({e})") from e
    if not callable(obj):
        raise RewardSpecError(f"{field} = {target!r}: is not callable")
    return obj


def parse_reward_spec(spec: str) -> list[tuple[str, float]]:
    """``"a=1.0,b=0.1"`` -> ``[("a", 1.0), ("b", 0.1)]``; a bare name weighs 1."""
    items = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, w = part.rpartition("=") if "=" in part else (part, "", "1")
        try:
            weight = float(w)
        except ValueError:
            raise RewardSpecError(f"rollout.rewards = {spec!r}: weight {w!r} of {name!r} is not a number") from None
        items.append((name.strip(), weight))
    if not items:
        raise RewardSpecError(f"rollout.rewards = {spec!r}: names no reward")
    return items


@dataclass
class CombinedReward:
    """Weighted sum of reward functions, plus an optional batch reward model."""

    names: list[str]
    weights: list[float]
    fns: list[RewardFn]
    model: Callable[[list[str], list[str]], list[float]] | None = None
    model_weight: float = 1.0

    def score(self, problems: list[Problem], responses: list[str]) -> tuple[list[float], list[list[float]]]:
        """Returns ``(total [B], components [B][C])``; components follow ``names`` (+ ``reward_model``)."""
        comps = [[float(fn(p, r)) for fn in self.fns] for p, r in zip(problems, responses)]
        if self.model is not None:
            extra = self.model([p.prompt for p in problems], responses)
            if len(extra) != len(responses):
                raise RuntimeError(f"reward model returned {len(extra)} scores for {len(responses)} responses")
            for row, x in zip(comps, extra):
                row.append(float(x))
        ws = self.weights + ([self.model_weight] if self.model is not None else [])
        return [sum(w * c for w, c in zip(ws, row)) for row in comps], comps


def build_reward(spec: str = "task", task=None, reward_model: str = "", reward_model_device: str = "cpu",
                 reward_model_weight: float = 1.0) -> CombinedReward:
    """Resolve a reward spec (see module doc); ``task`` is needed for the name ``task``."""
    names, weights, fns = [], [], []
    for name, w in parse_reward_spec(spec):
        if name == "task":
            if task is None:
                raise RewardSpecError("rollout.rewards names 'task' but no task was given")
            fn = task.reward
        elif name in _REGISTRY:
            fn = _REGISTRY[name]
        elif ":" in name:
            fn = _import(name, "rollout.rewards")
        else:
            raise RewardSpecError(f"rollout.rewards names {name!r}: unknown; known {available_rewards()} "
                                  "or 'package.module:function'")
        names.append(name)
        weights.append(w)
        fns.append(fn)
    model = None
    if reward_model:
        model = _import(reward_model, "rollout.reward_model")(reward_model_device)
        names.append("reward_model")
    return CombinedReward(names, weights, fns, model, reward_model_weight)
