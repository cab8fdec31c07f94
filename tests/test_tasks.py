"""Task registry and verifiable rewards."""
from __future__ import annotations

import random

import pytest

from streamrl.tasks import available_tasks, get_task
from streamrl.tasks.digits import format_score, positional_score
from streamrl.tasks.registry import eval_problems, problem_stream


def test_registry_lists_tasks():
    assert {"copy_digits", "reverse_digits", "sort_digits", "arithmetic"} <= set(available_tasks())
    with pytest.raises(ValueError, match="unknown"):
        get_task("nope")


def test_digit_rewards_give_per_position_credit():
    task = get_task("copy_digits", num_digits=4)
    p = task.sample(random.Random(0))
    assert p.prompt == p.answer + "="
    assert task.reward(p, p.answer) == pytest.approx(1.0)
    wrong_two = p.answer[:2] + "".join("0" if c != "0" else "1" for c in p.answer[2:])
    assert task.reward(p, wrong_two) == pytest.approx(0.8 * 0.5 + 0.2)
    assert task.reward(p, "") == 0.0
    assert positional_score("1234", "123456") == pytest.approx(4 / 6)
    assert format_score("1234", "12ab") == pytest.approx(0.5)


def test_reverse_and_sort_answers():
    r = get_task("reverse_digits", num_digits=5).sample(random.Random(3))
    assert r.answer == r.prompt[:-1][::-1]
    s = get_task("sort_digits", num_digits=5).sample(random.Random(3))
    assert s.answer == "".join(sorted(s.prompt[:-1]))


def test_arithmetic_reward_checks_first_integer():
    task = get_task("arithmetic", num_digits=2)
    p = task.sample(random.Random(1))
    assert task.reward(p, f" {p.answer}.") == 1.0
    assert task.reward(p, "I think 999999") == 0.0
    assert task.reward(p, "no number") == 0.0


def test_problem_streams_are_sharded_and_reproducible():
    task = get_task("copy_digits", num_digits=6)
    a = problem_stream(task, seed=1, shard=0, num_shards=2)
    b = problem_stream(task, seed=1, shard=1, num_shards=2)
    a_items = [next(a) for _ in range(20)]
    b_items = [next(b) for _ in range(20)]
    assert not set(a_items) & set(b_items)
    again = problem_stream(task, seed=1, shard=0, num_shards=2)
    assert [next(again) for _ in range(20)] == a_items
    assert eval_problems(task, 1, 5) == eval_problems(task, 1, 5)
