"""The long_sequence task: answer lengths in real SmolLM2 tokens, the graded prefix reward,
reproducible and varied problems, a held-out split disjoint from training, config errors."""
from __future__ import annotations

import doctest
import random
from pathlib import Path

import pytest

from streamrl.config import ConfigError, load_config
from streamrl.rollout.prompts import PromptEncoder
from streamrl.tasks import build_task, get_task, long_sequence
from streamrl.tasks.long_sequence import FAMILIES, estimate_tokens, terms
from streamrl.tasks.registry import eval_problems, problem_stream

REPO = Path(__file__).resolve().parents[1]
SMOL = REPO / "models" / "smol"
GPU_LONG = REPO / "configs" / "gpu-long.yaml"


@pytest.fixture(scope="module")
def smol_tok():
    if not (SMOL / "tokenizer.json").exists():
        pytest.skip("models/smol is not prepared")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SMOL))


def _problems(task, n: int, seed: int = 0):
    stream = problem_stream(task, seed, 0, 1)
    return [next(stream) for _ in range(n)]


def test_doctests():
    assert doctest.testmod(long_sequence).failed == 0


@pytest.mark.parametrize("lo,hi,digits", [(512, 1000, 3), (64, 128, 6), (1500, 2048, 4)])
def test_answer_tokens_in_range_with_smollm2_tokenizer(smol_tok, lo, hi, digits):
    """Every family's answer is lo..hi SmolLM2 tokens, exactly as estimate_tokens counts them."""
    task = get_task("long_sequence", num_digits=digits, min_answer_tokens=lo, max_answer_tokens=hi)
    problems = _problems(task, 60)
    assert {p.fields["source_dataset"] for p in problems} == set(FAMILIES)
    for p in problems:
        n = len(smol_tok.encode(p.answer, add_special_tokens=False))
        assert n == estimate_tokens(p.answer), p.answer[:80]
        assert lo <= n <= hi, (p.fields["source_dataset"], n)
    spread = [estimate_tokens(p.answer) for p in problems]
    assert max(spread) - min(spread) > (hi - lo) / 2   # lengths cover the range, not one size


def test_gpu_long_recipe_prompts_fit_the_model_length(smol_tok):
    """configs/gpu-long.yaml: chat-templated prompt + max_new_tokens fits max_model_len, and the
    answers (512-1,000 tokens) fit the response cap."""
    cfg = load_config(str(GPU_LONG), [])
    task = build_task(cfg.task)
    encode = PromptEncoder(smol_tok, chat_template=cfg.rollout.chat_template)
    for p in _problems(task, 60) + eval_problems(task, 0, 20):
        assert len(encode.problem(p)) + cfg.rollout.max_new_tokens <= cfg.rollout.max_model_len, p.prompt
        assert 512 <= len(smol_tok.encode(p.answer, add_special_tokens=False)) < cfg.rollout.max_new_tokens


def test_reward_exact_half_garbage_and_junk():
    task = get_task("long_sequence", num_digits=4, min_answer_tokens=512, max_answer_tokens=1024)
    for p in _problems(task, 12):
        want = terms(p.answer)
        n = len(want)
        assert task.reward(p, p.answer) == 1.0
        assert task.reward(p, p.answer.replace(", ", "\n")) == 1.0   # separators are not graded
        half = ", ".join(p.answer.split(", ")[: n // 2])
        assert task.reward(p, half) == pytest.approx(0.5, abs=1 / n)
        rng = random.Random(1)
        garbage = " ".join(rng.choice(["x", "7", "blue", "the", "-3"]) for _ in range(n))
        assert task.reward(p, garbage) < 0.02
        assert task.reward(p, "") == 0.0
        # trailing junk and a lead-in cost in proportion to their length
        assert task.reward(p, p.answer + ", 1, 2, 3") == pytest.approx(n / (n + 3))
        assert task.reward(p, "Sure, here it is: " + p.answer) == pytest.approx(n / (n + 4))
        # the whole answer written twice earns half
        assert task.reward(p, p.answer + ", " + p.answer) == pytest.approx(0.5)


def test_reward_is_monotone_in_the_correct_prefix():
    """Responses of the answer's length whose first k terms are right: reward k / n, rising in k,
    whatever follows the first wrong term."""
    task = get_task("long_sequence", min_answer_tokens=200, max_answer_tokens=300)
    for p in _problems(task, 6):
        parts = p.answer.split(", ")
        n = len(parts)
        scores = []
        for k in range(n + 1):
            wrong = [str(int(t) + 1) if t.lstrip("-").isdigit() else t + "s" for t in parts[k:]]
            r = task.reward(p, ", ".join(parts[:k] + wrong))
            assert r == pytest.approx(k / n)
            scores.append(r)
        assert all(a < b for a, b in zip(scores, scores[1:]))


def test_token_credit_sums_to_reward():
    task = get_task("long_sequence", min_answer_tokens=64, max_answer_tokens=128)
    p = _problems(task, 1)[0]
    cut = p.answer[: len(p.answer) // 3]
    for response in (p.answer, cut, "Here: " + cut + " 7 7", "nothing"):
        credit = task.token_credit(p, response)
        assert len(credit) == len(response)
        assert sum(credit) == pytest.approx(task.reward(p, response))


def test_problems_are_deterministic_per_seed_and_varied():
    task = get_task("long_sequence", min_answer_tokens=128, max_answer_tokens=256)
    assert _problems(task, 20, seed=3) == _problems(task, 20, seed=3)
    problems = _problems(task, 60, seed=3)
    assert len({p.prompt for p in problems}) == 60
    assert _problems(task, 20, seed=4) != problems[:20]
    # several phrasings, not one template per family: distinct prompt openings
    assert len({" ".join(p.prompt.split()[:2]) for p in problems}) >= 8


def test_held_out_problems_are_never_trained_on():
    task = get_task("long_sequence", num_digits=1, min_answer_tokens=64, max_answer_tokens=128)
    held = eval_problems(task, 0, 100)
    train = {p.answer for p in _problems(task, 1000)}
    assert len({p.answer for p in held}) > 50
    assert not train & {p.answer for p in held}
    assert {p.fields["source_dataset"] for p in held} == set(FAMILIES)


def test_config_selects_the_task_and_names_bad_fields():
    cfg = load_config(None, ["task.name=long_sequence", "task.min_answer_tokens=100", "task.max_answer_tokens=200"])
    task = build_task(cfg.task)
    assert (task.min_tokens, task.max_tokens) == (100, 200)
    with pytest.raises(ConfigError, match=r"task\.min_answer_tokens' = 0"):
        load_config(None, ["task.name=long_sequence", "task.min_answer_tokens=0"])
    with pytest.raises(ConfigError, match=r"task\.max_answer_tokens' = 530.*>= task\.min_answer_tokens \+ 32 = 544"):
        load_config(None, ["task.name=long_sequence", "task.max_answer_tokens=530"])
    with pytest.raises(ConfigError, match=r"task\.num_digits' = 13"):
        load_config(None, ["task.name=long_sequence", "task.num_digits=13"])
    with pytest.raises(ValueError, match="max_answer_tokens"):
        get_task("long_sequence", min_answer_tokens=100, max_answer_tokens=110)
