"""Prompt sources sharded across rollout workers: task generators and JSONL files.

Either source yields :class:`Problem` objects forever. Shard ``s`` of ``n`` sees a disjoint
part of the prompt space: generator problem ``i*n + s`` (see
:func:`streamrl.tasks.registry.problem_stream`), or JSONL lines ``s, s+n, s+2n, ...``,
reshuffled every epoch with a seed shared by all shards so epochs stay disjoint too.

JSONL format: one object per line with ``"prompt"`` and ``"answer"`` (strings; a number
answer is turned into its string).
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterator

from streamrl.tasks.registry import Problem, problem_stream


def read_jsonl_problems(path: str | Path) -> list[Problem]:
    """All problems of a JSONL file; errors name the file and line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"rollout.prompt_file = {str(path)!r} does not exist")
    out = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{lineno}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or "answer" not in obj:
            raise ValueError(f"{p}:{lineno}: needs a string 'prompt' and an 'answer'")
        out.append(Problem(prompt=obj["prompt"], answer=str(obj["answer"])))
    if not out:
        raise ValueError(f"rollout.prompt_file = {str(path)!r} holds no problems")
    return out


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


def prompt_source(task, prompt_file: str, seed: int, shard: int, num_shards: int) -> Iterator[Problem]:
    """The worker's problem stream: the JSONL file when given, else the task generator."""
    if prompt_file:
        return jsonl_stream(read_jsonl_problems(prompt_file), seed, shard, num_shards)
    return problem_stream(task, seed, shard, num_shards)
