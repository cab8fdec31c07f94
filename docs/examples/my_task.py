"""A task: makes problems with known answers from a seeded ``random.Random`` and scores responses.

Run it: ``PYTHONPATH=docs/examples python docs/examples/my_task.py``.
"""
import random

from streamrl.tasks import Problem, get_task, register_task
from streamrl.tasks.registry import eval_problems, problem_stream


@register_task("count_letters")
class CountLetters:
    """How many times does a letter occur in a word."""

    def __init__(self, num_digits: int = 4, **_options):  # every task receives every task.* option
        self.length = num_digits + 4

    def sample(self, rng: random.Random) -> Problem:
        word = "".join(rng.choice("abcab") for _ in range(self.length))
        letter = rng.choice("abc")
        return Problem(f"How many '{letter}' in {word}? Answer with a number.", str(word.count(letter)),
                       fields={"word": word, "letter": letter})

    def reward(self, problem: Problem, response: str) -> float:
        return float(response.strip() == problem.answer)


if __name__ == "__main__":
    task = get_task("count_letters", num_digits=2)
    stream = problem_stream(task, seed=0, shard=0, num_shards=2)      # what rollout worker 0 of 2 draws
    first = next(stream)
    print(first.prompt, "->", first.answer)
    print("reward of the right answer:", task.reward(first, first.answer))
    held_out = eval_problems(task, seed=0, count=3)                    # the held-out set evaluation uses
    print("held-out:", [p.answer for p in held_out])
    assert task.reward(first, first.answer) == 1.0
