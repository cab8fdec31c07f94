"""reasoning-gym as a task family: procedural generators with their own scorers.

``task.name: reasoning_gym`` draws every problem from a weighted mix of reasoning-gym datasets
(``task.datasets``), and scores a response with that dataset's own ``score_answer`` applied to
the answer :func:`~streamrl.tasks.answers.extract_answer` pulls out of the response text.

Config (YAML)::

    task:
      name: reasoning_gym
      answer_format: final          # final | think | tag | none: the instruction appended to each question
      datasets:
        products: 1.0               # a bare number is the weight
        basic_arithmetic:           # a mapping: optional weight + the dataset's own options
          weight: 2.0
          max_digits: 3
          operators: ["+", "-", "*"]
        leg_counting: {held_out: true}   # evaluation only: a task family training never sees

``answer_format: think`` asks for step-by-step reasoning and a last line ``Answer: X``; the reward
then reads only that line (:func:`~streamrl.tasks.answers.final_answer`), and a response cut at
the token limit scores 0 (:attr:`ReasoningGym.truncated_scores_zero`, applied by
:mod:`streamrl.tasks.truncation`): an unfinished chain of thought gave no answer.

``held_out: true`` on a dataset keeps it out of training (:meth:`ReasoningGym.sample` never draws
it) while the held-out set draws it at its weight, so evaluation reports the skill's transfer to
a family never trained on (``eval/accuracy/<dataset>`` and ``eval/accuracy/held_out_families``).

Seeds: each dataset is built once with a fixed seed (derived from its name, so two datasets of
the same kind do not draw the same operands in lock-step) over ``ITEMS`` virtual items. A
training problem takes an *even* item index drawn from the stream's ``rng``, a held-out problem
(:meth:`ReasoningGym.sample_held_out`, used by :func:`~streamrl.tasks.registry.eval_problems`)
an *odd* one: held-out items are never generated for training. (Distinct items can still
read alike when a dataset's space is small, e.g. one-digit sums.)

The full reasoning-gym entry (question, answer, metadata) travels in ``Problem.fields``, so
the score does not depend on the task instance that scores it.
"""
from __future__ import annotations

import enum
import functools
import math
import random
import typing
import zlib
from types import MappingProxyType
from typing import Any, Mapping

from streamrl.tasks.answers import extract_answer, final_answer
from streamrl.tasks.registry import Problem, register_task

# Virtual items per dataset. Some generators precompute a table of this size (gsm_symbolic:
# ~0.3 s for 2**20), others index a seed; 2**19 items per split is plenty for RL.
ITEMS = 2**20

ANSWER_FORMATS = {
    "final": "\nGive only the final answer.",
    "think": "\nThink step by step and show each calculation. Then write the final answer on the last line, "
             "as: Answer: <answer>",
    "tag": "\nPut only the final answer inside <answer></answer>.",
    "none": "",
}

DEFAULT_DATASETS = {"basic_arithmetic": 1.0, "chain_sum": 1.0, "products": 1.0}


def _rg():
    import reasoning_gym  # noqa: PLC0415 (heavy: sympy; only for runs that use this task)

    return reasoning_gym


def parse_datasets(datasets: Mapping[str, Any] | None, field: str = "task.datasets"
                   ) -> list[tuple[str, float, dict, bool]]:
    """``{name: weight | {weight, held_out, **options}}`` -> ``[(name, weight, options, held_out)]``, checked.

    Raises ValueError naming ``field``, the dataset and what is wrong: an unknown dataset (with
    the known names), a weight that is not a positive number, options the dataset rejects.
    """
    datasets = DEFAULT_DATASETS if datasets is None else datasets
    if not isinstance(datasets, Mapping) or not datasets:
        raise ValueError(f"{field} = {datasets!r}: expected a non-empty mapping of reasoning-gym dataset -> weight")
    known = _rg().factory.DATASETS
    out = []
    for name, spec in datasets.items():
        if name not in known or name == "composite":
            names = sorted(set(known) - {"composite"})
            raise ValueError(f"{field}.{name}: not a reasoning-gym dataset; known: {names}")
        options = dict(spec) if isinstance(spec, Mapping) else {"weight": spec}
        weight = options.pop("weight", 1.0)
        held_out = options.pop("held_out", False)
        if not isinstance(held_out, bool):
            raise ValueError(f"{field}.{name}.held_out = {held_out!r}: must be true or false")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"{field}.{name}.weight = {weight!r}: must be a number > 0")
        for reserved in ("seed", "size"):
            if reserved in options:
                raise ValueError(f"{field}.{name}.{reserved}: set by StreamRL (held-out items are kept apart), "
                                 "remove it")
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}  # YAML lists -> tuples
        try:  # the dataset's own config class checks the options (cheap: no generator is built)
            options = _enum_options(known[name][1], options)
            cfg = known[name][1](**options)
            if hasattr(cfg, "validate"):
                cfg.validate()
        except (TypeError, AssertionError, ValueError) as e:
            raise ValueError(f"{field}.{name} = {spec!r}: reasoning-gym refused the options ({e})") from None
        out.append((name, float(weight), options, held_out))
    if all(h for *_, h in out):
        raise ValueError(f"{field}: every dataset is held_out; training needs at least one")
    return out


def _enum_options(config_cls, options: dict) -> dict:
    """YAML strings -> the enum members a dataset's config field is typed with (word_sorting's
    ``transformation: lowercase``), by value or by name; ValueError names the choices."""
    try:
        hints = typing.get_type_hints(config_cls)
    except (NameError, TypeError):  # a hint that does not resolve: pass the options on as they are
        return options
    out = dict(options)
    for key, value in options.items():
        kind = hints.get(key)
        if not (isinstance(value, str) and isinstance(kind, type) and issubclass(kind, enum.Enum)):
            continue
        by_value = {str(m.value): m for m in kind}
        member = by_value.get(value) or kind.__members__.get(value)
        if member is None:
            raise ValueError(f"{key} = {value!r}: one of {sorted(by_value)}")
        out[key] = member
    return out


def _build_dataset(name: str, options: dict):
    return _rg().create_dataset(name, seed=zlib.crc32(name.encode()), size=ITEMS, **options)


@functools.lru_cache(maxsize=None)
def _scorer(dataset: str):
    return _rg().get_score_answer_fn(dataset)


@register_task("reasoning_gym")
class ReasoningGym:
    """A weighted mix of reasoning-gym datasets (see the module doc)."""

    def __init__(self, datasets: Mapping[str, Any] | None = None, answer_format: str = "final",
                 partial_credit: bool = False, **_: object):
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"task.answer_format = {answer_format!r}: must be one of {sorted(ANSWER_FORMATS)}")
        self.suffix = ANSWER_FORMATS[answer_format]
        self.partial_credit = partial_credit
        # a worked answer that hits the token limit never reached its final line
        self.truncated_scores_zero = answer_format == "think"
        self.extract = final_answer if answer_format == "think" else extract_answer
        specs = parse_datasets(datasets)
        self.names = [n for n, *_ in specs]
        self.weights = [w for _, w, _, _ in specs]
        self.held_out_families = frozenset(n for n, _, _, h in specs if h)
        self.train_weights = [0.0 if n in self.held_out_families else w for n, w in zip(self.names, self.weights)]
        self.sets = {n: _build_dataset(n, opts) for n, _, opts, _ in specs}

    def _problem(self, rng: random.Random, parity: int) -> Problem:
        name = rng.choices(self.names, weights=self.weights if parity else self.train_weights)[0]
        entry = self.sets[name][2 * rng.randrange(ITEMS // 2) + parity]
        fields = {"source_dataset": name, "question": entry["question"],
                  "metadata": MappingProxyType(dict(entry.get("metadata") or {})),
                  "held_out_family": name in self.held_out_families}
        return Problem(prompt=entry["question"].rstrip() + self.suffix, answer=str(entry["answer"]),
                       fields=MappingProxyType(fields))

    def sample(self, rng: random.Random) -> Problem:
        """A training problem (an even item of a dataset drawn by weight)."""
        return self._problem(rng, 0)

    def sample_held_out(self, rng: random.Random) -> Problem:
        """A held-out problem (an odd item): never produced by :meth:`sample`."""
        return self._problem(rng, 1)

    def reward(self, problem: Problem, response: str) -> float:
        """The dataset's own ``score_answer`` of the extracted answer, in [0, 1]; 0 when the
        response gives no answer or the scorer fails on it. Without ``partial_credit`` a score
        below 1 counts 0: many scorers pay ``len(answer) / len(given)`` when the answer is a
        substring of what was given, e.g. 0.8 for ``63700`` when ``6370`` is right."""
        score = score_reasoning_gym(problem, response, self.extract)
        return score if self.partial_credit or score >= 1.0 else 0.0


def score_reasoning_gym(problem: Problem, response: str, extract=extract_answer) -> float:
    """Score ``response`` with the reasoning-gym scorer named in ``problem.fields`` (partial credit
    kept); ``extract`` pulls the answer out of the response (:func:`final_answer` for ``think``)."""
    name = problem.fields.get("source_dataset")
    if name is None:
        raise ValueError("reasoning-gym reward: the problem carries no 'source_dataset' field "
                         "(it did not come from task.name = reasoning_gym)")
    answer = extract(response, problem.answer)
    if answer is None:
        return 0.0
    entry = {"question": problem.fields.get("question", problem.prompt), "answer": problem.answer,
             "metadata": dict(problem.fields.get("metadata") or {})}
    try:
        score = float(_scorer(name)(answer, entry))
    except Exception:  # a scorer choking on a malformed answer: the answer is wrong, not the run
        return 0.0
    return min(max(score, 0.0), 1.0) if math.isfinite(score) else 0.0
