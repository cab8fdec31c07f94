"""Task registry: a task makes prompts with known answers and scores responses.

Tasks speak text, not token ids, so the same task serves the tiny character-level model
and a real pretrained model with its own tokenizer.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Protocol


@dataclass(frozen=True)
class Problem:
    """One prompt and the answer its reward is checked against.

    ``fields`` carries everything else known about the problem, for reward functions: the
    other columns of a dataset row, or a generator's metadata (a reasoning-gym entry). It is
    left out of equality and hashing, so two problems with the same prompt and answer are equal.
    ``messages`` holds a dataset's chat messages (``[{"role", "content"}, ...]``) when the row
    came as a conversation; ``prompt`` is then the last user message's text.
    """

    prompt: str
    answer: str
    fields: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), compare=False, hash=False)
    messages: tuple[Mapping[str, str], ...] | None = field(default=None, compare=False, hash=False)


class Task(Protocol):
    name: str

    def sample(self, rng: random.Random) -> Problem:
        """Draw one problem using only ``rng`` (so prompt streams are reproducible)."""

    def reward(self, problem: Problem, response: str) -> float:
        """Score a decoded response in [0, 1]."""

    # Optional (not part of the protocol's required surface):
    # ``sample_held_out(rng) -> Problem`` draws from a part of the generator's seed space that
    # ``sample`` never reaches (see :func:`eval_problems`).
    # ``token_credit(problem, response) -> list[float]``, one credit per character of
    # ``response`` summing to ``reward(problem, response)``. Tasks that define it let
    # ``rollout.token_rewards`` place reward on the tokens that earned it; the others get
    # their scalar reward on the last response token.


_REGISTRY: dict[str, Callable[..., Task]] = {}


def register_task(name: str):
    """Class decorator: ``@register_task("copy_digits")``."""

    def wrap(cls):
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return wrap


def available_tasks() -> list[str]:
    return sorted(_REGISTRY)


def get_task(name: str, **kwargs) -> Task:
    """Instantiate a registered task; unknown names raise naming the known ones."""
    if name not in _REGISTRY:
        raise ValueError(f"task.name = {name!r} is unknown; known tasks: {available_tasks()}")
    return _REGISTRY[name](**kwargs)


def build_task(task_cfg) -> Task:
    """The task a :class:`~streamrl.config.TaskConfig` describes (every task gets every task
    option; each takes the ones it knows)."""
    return get_task(task_cfg.name, num_digits=task_cfg.num_digits, datasets=task_cfg.datasets,
                    answer_format=task_cfg.answer_format, partial_credit=task_cfg.partial_credit,
                    min_answer_tokens=task_cfg.min_answer_tokens, max_answer_tokens=task_cfg.max_answer_tokens)


def problem_stream(task: Task, seed: int, shard: int, num_shards: int):
    """Endless, reproducible problems for one shard of the prompt space.

    Shard ``s`` of ``n`` draws problem ``i`` from a generator seeded by (seed, i*n + s), so
    shards never overlap and a restarted worker can resume from a cursor.
    """
    i = 0
    while True:
        rng = random.Random(f"{seed}:{i * num_shards + shard}")
        yield task.sample(rng)
        i += 1


def eval_problems(task: Task, seed: int, count: int) -> list[Problem]:
    """A held-out evaluation set, disjoint in seed space from training streams.

    Generators are seeded from ``"eval:..."`` strings, which training streams never use; a task
    with ``sample_held_out`` (reasoning-gym: odd item indices, training draws even ones) keeps
    its held-out items out of the training stream's reach as well.
    """
    draw = getattr(task, "sample_held_out", task.sample)
    return [draw(random.Random(f"eval:{seed}:{i}")) for i in range(count)]
