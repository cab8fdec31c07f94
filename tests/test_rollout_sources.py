"""Prompt sources: sharded task generators and JSONL files (``data.path``)."""
from __future__ import annotations

import itertools
import json

import pytest

from streamrl.config import ConfigError, load_config
from streamrl.tasks import get_task
from streamrl.tasks.datasets import load_problems
from streamrl.tasks.registry import problem_stream
from streamrl.tasks.sources import jsonl_stream


def read_jsonl_problems(path):
    """A JSONL file read the way ``data.path`` is (``prompt``/``answer`` columns)."""
    return load_problems(path, field="data.path")


def _write(tmp_path, rows):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_shards_are_disjoint_and_cover_the_file(tmp_path):
    path = _write(tmp_path, [{"prompt": f"q{i}", "answer": i} for i in range(10)])
    problems = read_jsonl_problems(path)
    assert problems[3].answer == "3"
    shards = [list(itertools.islice(jsonl_stream(problems, 0, s, 3), len(range(s, 10, 3)))) for s in range(3)]
    seen = [p.prompt for sh in shards for p in sh]
    assert sorted(seen) == sorted(f"q{i}" for i in range(10))  # one epoch: every line exactly once


def test_jsonl_stream_cycles_epochs(tmp_path):
    problems = read_jsonl_problems(_write(tmp_path, [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]))
    got = list(itertools.islice(jsonl_stream(problems, 0, 0, 1), 6))
    assert sorted(p.prompt for p in got) == ["a", "a", "a", "b", "b", "b"]


@pytest.mark.parametrize("text,match", [("{bad", "not JSON"), ('{"prompt": 1, "answer": 2}', "prompt"), ("", "no problems")])
def test_bad_jsonl_names_file_and_line(tmp_path, text, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_jsonl_problems(path)


def test_missing_file_names_the_field():
    with pytest.raises(ValueError, match="data.path"):
        read_jsonl_problems("/nonexistent.jsonl")


def test_old_prompt_file_key_names_its_replacement():
    with pytest.raises(ConfigError, match="'rollout.prompt_file' was replaced by 'data.path'"):
        load_config("configs/tiny.yaml", ["rollout.prompt_file=p.jsonl"])


def test_task_generator_shards_differ():
    task = get_task("arithmetic", num_digits=2)
    a = [p.prompt for p in itertools.islice(problem_stream(task, 0, 0, 2), 20)]
    b = [p.prompt for p in itertools.islice(problem_stream(task, 0, 1, 2), 20)]
    assert a != b and a == [p.prompt for p in itertools.islice(problem_stream(task, 0, 0, 2), 20)]
