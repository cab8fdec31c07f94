"""Reward registry: built-ins, weights, plug-ins by module:function, reward-model hook."""
from __future__ import annotations

import pytest

from streamrl.config import ConfigError, load_config
from streamrl.rewards import RewardSpecError, build_reward, exact_answer, format_reward, parse_reward_spec
from streamrl.tasks import get_task
from streamrl.tasks.registry import Problem

P = Problem("What is 12 + 35? Answer with the number only.", "47")


def test_exact_answer_integer_and_text():
    assert exact_answer(P, "47") == 1.0
    assert exact_answer(P, " The answer is 47.") == 1.0
    assert exact_answer(P, "48") == 0.0
    assert exact_answer(P, "") == 0.0
    assert exact_answer(Problem("q", "-3"), "-3") == 1.0
    assert exact_answer(Problem("q", "paris"), "paris\nmore") == 1.0
    assert exact_answer(Problem("q", "paris"), "london") == 0.0


def test_format_reward():
    assert format_reward(P, "47") == 1.0
    assert format_reward(P, " 12. ") == 1.0  # wrong but well-formed
    assert format_reward(P, "The answer is 47") == 0.0
    assert format_reward(Problem("q", "abc"), "one line") == 1.0


def test_weighted_combination_and_components():
    fn = build_reward("exact_answer=1.0,format=0.25")
    total, comps = fn.score([P, P, P], ["47", "answer: 47", "9"])
    assert comps == [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]]
    assert total == [1.25, 1.0, 0.25]


def test_task_reward_by_name():
    task = get_task("arithmetic", num_digits=2)
    fn = build_reward("task", task)
    assert fn.score([P], ["47"])[0] == [task.reward(P, "47")]
    with pytest.raises(RewardSpecError):
        build_reward("task")


def test_plugin_by_module_function():
    fn = build_reward("streamrl.rewards:exact_answer=2")
    assert fn.score([P], ["47"])[0] == [2.0]


@pytest.mark.parametrize("spec", ["nope", "no_such_module_xyz:fn", "streamrl.rewards:missing", "exact_answer=abc", ""])
def test_bad_specs_name_the_problem(spec):
    with pytest.raises(RewardSpecError) as e:
        build_reward(spec)
    assert "rollout." in str(e.value)


def make_length_model(device):
    """A stand-in reward model factory: scores by response length, remembers its device."""
    assert device == "cpu"
    return lambda prompts, responses: [len(r) / 10 for r in responses]


def test_reward_model_hook_adds_a_component():
    fn = build_reward("exact_answer", reward_model="test_rewards:make_length_model", reward_model_weight=0.5)
    total, comps = fn.score([P, P], ["47", "1234567890"])
    assert fn.names == ["exact_answer", "reward_model"]
    assert comps == [[1.0, 0.2], [0.0, 1.0]]
    assert total == [1.1, 0.5]


def test_parse_and_config_validation():
    assert parse_reward_spec("a=1,b") == [("a", 1.0), ("b", 1.0)]
    with pytest.raises(ConfigError, match="rollout.rewards"):
        load_config(None, ["rollout.rewards=exact_answer=x"])


@pytest.mark.parametrize("gold,response", [
    ("1/2", "The answer is 0.5"),
    ("0.5", "$\\frac{1}{2}$"),
    ("\\frac{1}{2}", "so the result is \\boxed{0.5}"),
    ("$\\frac{755}{961}$", "755/961"),
    ("47", "12 + 35 = 47"),
    ("1010", "1,010"),
    ("\\boxed{3}", "x = 3"),
])
def test_math_verify_accepts_equivalent_forms(gold, response):
    fn = build_reward("math_verify")
    assert fn.score([Problem("q", gold)], [response])[0] == [1.0]


@pytest.mark.parametrize("gold,response", [("1/2", "0.25"), ("47", "48"), ("\\frac{1}{3}", "\\boxed{0.5}"), ("2", "")])
def test_math_verify_rejects_wrong_answers(gold, response):
    assert build_reward("math_verify").score([Problem("q", gold)], [response])[0] == [0.0]


def test_math_verify_works_off_the_main_thread():
    # math-verify's own timeout needs the main thread (signal.alarm); the reward must not crash elsewhere
    import threading

    out = []
    fn = build_reward("math_verify")
    t = threading.Thread(target=lambda: out.append(fn.score([Problem("q", "1/2")], ["0.5"])[0]))
    t.start()
    t.join(60)
    assert out == [[1.0]]
