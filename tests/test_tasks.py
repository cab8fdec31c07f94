"""Task registry and verifiable rewards."""
from __future__ import annotations

import random

import pytest

from streamrl.tasks import available_tasks, get_task
from streamrl.tasks.digits import format_score, positional_score
from streamrl.tasks.reasoning import ReasoningGym
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


# -- reasoning-gym ---------------------------------------------------------------------------

from streamrl.config import ConfigError, load_config  # noqa: E402
from streamrl.tasks.answers import extract_answer  # noqa: E402

# every dataset configs/smol-reasoning.yaml trains on, plus a non-numeric and an expression answer
RG_DATASETS = {
    "basic_arithmetic": {"max_digits": 3, "operators": ["+", "-", "*"], "allow_parentheses": False},
    "chain_sum": {"max_terms": 3, "max_digits": 3},
    "products": {"max_digits": 2},
    "leg_counting": {"max_animals": 3, "max_instances": 5},
    "time_intervals": 1.0,
    "countdown": 0.5,
}


@pytest.fixture(scope="module")
def rg_task():
    return get_task("reasoning_gym", datasets=RG_DATASETS)


@pytest.mark.parametrize("name", sorted(RG_DATASETS))
def test_reasoning_gym_each_dataset_scores_with_its_own_scorer(name):
    task = get_task("reasoning_gym", datasets={name: RG_DATASETS[name]})
    rng = random.Random(7)
    for _ in range(5):
        p = task.sample(rng)
        assert p.fields["source_dataset"] == name and p.prompt.endswith("Give only the final answer.")
        # the answer wrapped the ways a model writes it still scores 1; a wrong one does not
        assert task.reward(p, f"The answer is {p.answer}.") == 1.0
        assert task.reward(p, f"<answer>{p.answer}</answer>") == 1.0
        assert task.reward(p, "I am not sure.") < 1.0
        assert task.reward(p, "") == 0.0


def test_reasoning_gym_numeric_answers_take_the_last_number(rg_task):
    task = get_task("reasoning_gym", datasets={"products": {"max_digits": 2}})
    p = task.sample(random.Random(0))
    a, b = p.fields["metadata"]["expression"].split(" * ")
    assert task.reward(p, f"{a} * {b} = {p.answer}") == 1.0
    assert task.reward(p, f"{p.answer}0") == 0.0
    assert task.reward(p, f"{int(p.answer) + 1}") == 0.0
    lenient = get_task("reasoning_gym", datasets={"products": {"max_digits": 2}}, partial_credit=True)
    assert 0 < lenient.reward(p, f"{p.answer}0") < 1  # the scorer's own substring credit


def test_reasoning_gym_mix_follows_weights_and_held_out_items_are_never_trained(rg_task):
    stream = problem_stream(rg_task, seed=0, shard=0, num_shards=1)
    train = [next(stream) for _ in range(300)]
    counts = {n: sum(p.fields["source_dataset"] == n for p in train) for n in RG_DATASETS}
    assert all(c > 0 for c in counts.values()) and counts["countdown"] < counts["products"]
    held = eval_problems(rg_task, 0, 100)
    assert held == eval_problems(rg_task, 0, 100)  # reproducible
    train_items = {(p.fields["source_dataset"], p.fields["metadata"]["source_index"]) for p in train}
    held_items = {(p.fields["source_dataset"], p.fields["metadata"]["source_index"]) for p in held}
    assert all(i % 2 == 0 for _, i in train_items) and all(i % 2 == 1 for _, i in held_items)
    assert not train_items & held_items


@pytest.mark.parametrize("override,match", [
    ("task.datasets={nope: 1}", "task.datasets.nope: not a reasoning-gym dataset"),
    ("task.datasets={products: 0}", "task.datasets.products.weight = 0"),
    ("task.datasets={products: {max_digitz: 2}}", "task.datasets.products.*max_digitz"),
    ("task.datasets={products: {seed: 2}}", "task.datasets.products.seed"),
    ("task.answer_format=boxed", "task.answer_format"),
    ("task.datasets={word_sorting: {transformation: upper}}",
     r"task.datasets.word_sorting.*transformation = 'upper': one of \['lowercase', 'original'"),
])
def test_reasoning_gym_config_errors_name_the_field(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["task.name=reasoning_gym", override])


def test_reasoning_gym_enum_options_are_read_from_yaml_strings():
    # word_sorting's ``transformation`` is an enum in reasoning-gym: the YAML string becomes its member
    task = ReasoningGym({"word_sorting": {"transformation": "uppercase", "min_words": 3, "max_words": 4}})
    problem = task.sample(random.Random(0))
    words = problem.fields["metadata"]["transformed_words"]
    assert words and all(w == w.upper() for w in words)


def test_datasets_only_for_reasoning_gym():
    with pytest.raises(ConfigError, match="task.datasets"):
        load_config(None, ["task.datasets={products: 1}"])


@pytest.mark.parametrize("response,expected,got", [
    ("12 + 35 = 47.", "47", "47"),
    ("The total is 1,010 legs", "1010", "1010"),
    ("-3", "-3", "-3"),
    ("about 1.378.", "1.378", "1.378"),
    ("<answer> 7 </answer> and then 9", "7", "7"),
    ("so \\boxed{\\frac{1}{2}}", "0.5", "\\frac{1}{2}"),
    ("Answer: 03:30:57.", "03:30:57", "03:30:57"),
    ("work\n**53*58/53 + 53**", "53*58/53 + 53", "53*58/53 + 53"),
    ("no digits", "5", None),
    ("", "x", None),
])
def test_extract_answer(response, expected, got):
    assert extract_answer(response, expected) == got


def test_smol_reasoning_recipe_mixes_its_datasets_on_held_out_items():
    from streamrl.tasks import build_task

    cfg = load_config("configs/smol-reasoning.yaml")
    held = eval_problems(build_task(cfg.task), cfg.run.seed, cfg.eval.size)  # what streamrl-eval scores
    assert len(held) == cfg.eval.size
    assert {p.fields["source_dataset"] for p in held} == set(cfg.task.datasets)
    assert all(p.fields["metadata"]["source_index"] % 2 == 1 for p in held)
    assert any(len(str(abs(int(p.answer)))) >= 3 for p in held)  # 3-digit operands
    assert any("*" in p.prompt for p in held)  # multiplication


@pytest.mark.parametrize("response,expected,got", [
    ("7 * 3 = 21, 21 + 4 = 25.\nAnswer: 25", "25", "25"),
    ("first 12, then 14\n**Answer:** 14.", "14", "14"),
    ("Answer: 3 cats and 2 ducks have 16 legs\nFinal answer: 16 legs", "16", "16"),
    ("So, the answer is: 564.", "564", "564"),
    ("To find the answer, add 3 and 4: 7", "7", None),  # "answer" without "is" / ":" states nothing
    ("7 * 3 = 21, 21 + 4 = 25.", "25", None),  # no answer line: no answer, whatever the numbers
    ("Answer:", "5", None),
])
def test_final_answer_reads_only_the_answer_line(response, expected, got):
    from streamrl.tasks.answers import final_answer

    assert final_answer(response, expected) == got


def test_think_format_asks_for_reasoning_and_pays_only_the_final_line():
    task = get_task("reasoning_gym", datasets={"products": {"max_digits": 2}}, answer_format="think")
    p = task.sample(random.Random(0))
    assert "Think step by step" in p.prompt and p.prompt.endswith("Answer: <answer>")
    assert task.reward(p, f"Let me multiply.\nAnswer: {p.answer}") == 1.0
    assert task.reward(p, f"Let me multiply: {p.answer}") == 0.0  # the right number, but no answer line
    assert task.truncated_scores_zero
    assert not get_task("reasoning_gym", datasets={"products": 1}).truncated_scores_zero


def test_held_out_family_is_never_trained_but_evaluated():
    task = get_task("reasoning_gym", datasets={"products": 1.0, "chain_sum": {"held_out": True, "weight": 1.0}})
    stream = problem_stream(task, seed=0, shard=0, num_shards=1)
    assert {next(stream).fields["source_dataset"] for _ in range(200)} == {"products"}
    held = eval_problems(task, 0, 60)
    assert {p.fields["source_dataset"] for p in held} == {"products", "chain_sum"}
    assert all(p.fields["held_out_family"] == (p.fields["source_dataset"] == "chain_sum") for p in held)


@pytest.mark.parametrize("override,match", [
    ("task.datasets={products: 1, chain_sum: {held_out: 1}}", "task.datasets.chain_sum.held_out = 1"),
    ("task.datasets={chain_sum: {held_out: true}}", "every dataset is held_out"),
])
def test_held_out_option_errors_name_the_field(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["task.name=reasoning_gym", override])


def test_truncated_response_scores_zero_and_is_counted():
    from streamrl.tasks.truncation import apply_truncation_rule, is_truncated

    eos = frozenset({2})
    tokens = [[5, 6, 7, 8], [5, 6, 2], [5, 6, 7, 2], [5, 6]]  # cut, stopped, stopped at the limit, short
    assert [is_truncated(t, eos, 4) for t in tokens] == [True, False, False, False]
    rewards, cut = apply_truncation_rule([1.0, 1.0, 1.0, 0.5], tokens, eos, 4, True)
    assert rewards == [0.0, 1.0, 1.0, 0.5] and sum(cut) == 1
    assert apply_truncation_rule([1.0] * 4, tokens, eos, 4, False)[0] == [1.0] * 4
    with pytest.raises(ValueError, match="3 rewards for 4 responses"):
        apply_truncation_rule([1.0] * 3, tokens, eos, 4, True)


def test_gpu_reasoning_recipe_thinks_and_holds_out_a_family():
    from streamrl.tasks import build_task

    cfg = load_config("configs/gpu-reasoning.yaml")
    task = build_task(cfg.task)
    assert cfg.rollout.max_new_tokens == cfg.eval.max_new_tokens == 1024 and task.truncated_scores_zero
    held = eval_problems(task, cfg.run.seed, 80)
    assert {p.fields["source_dataset"] for p in held} == set(cfg.task.datasets)
    assert task.held_out_families == {"chain_sum"}
