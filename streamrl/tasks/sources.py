"""Prompt sources sharded across rollout workers: task generators and dataset files.

Either source yields :class:`Problem` objects forever. Shard ``s`` of ``n`` sees a disjoint
part of the prompt space: generator problem ``i*n + s`` (see
:func:`streamrl.tasks.registry.problem_stream`), or dataset rows ``s, s+n, s+2n, ...``,
reshuffled every epoch with a seed shared by all shards so epochs stay disjoint too.

Files: JSONL, Parquet or a ``datasets`` folder (:mod:`streamrl.tasks.datasets`), with a
prompt and an answer column (``data.prompt_key`` / ``data.answer_key``; every other column
reaches the rewards in ``Problem.fields``).
"""
from __future__ import annotations

import random
from typing import Iterator

from streamrl.tasks.datasets import load_problems
from streamrl.tasks.registry import Problem, problem_stream


def jsonl_stream(problems: list[Problem], seed: int, shard: int, num_shards: int) -> Iterator[Problem]:
    """Endless sharded stream over a fixed problem list (one shuffle per epoch)."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is outside [0, {num_shards})")
    epoch = 0
    while True:
        order = list(range(len(problems)))
        random.Random(f"{seed}:epoch:{epoch}").shuffle(order)
        mine = order[shard::num_shards] or order[shard % len(order)::len(order)]
        for i in mine:
            yield problems[i]
        epoch += 1


def build_prompt_source(cfg, task, seed: int, shard: int, num_shards: int) -> Iterator[Problem]:
    """The problem stream a :class:`~streamrl.config.Config` asks for: ``data.path`` with its
    field mapping, else the task generator."""
    d = cfg.data
    if d.path:
        problems = load_problems(d.path, d.prompt_key, d.answer_key, d.split, field="data.path")
        return jsonl_stream(problems, seed, shard, num_shards)
    return problem_stream(task, seed, shard, num_shards)
