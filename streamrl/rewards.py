"""Reward functions from a registry: verifiable rewards and ``module:function`` plug-ins.

A reward function maps ``(problem, response_text) -> float``. Everything else known about the
problem reaches it in ``problem.fields``: the other columns of a dataset row
(:mod:`streamrl.tasks.datasets`) or a generator's metadata (reasoning-gym). Built-ins:
``exact_answer``, ``format``, ``math_verify`` (answer equivalence with math-verify). A *reward spec* (config
``rollout.rewards``) combines several with weights: ``"exact_answer=1.0,format=0.1"``.
Names resolve in this order: the built-ins below (``task`` = the task's own reward),
then ``package.module:function`` imported on first use. An optional *reward model*
(``rollout.reward_model``) is a callable ``(prompts: list[str], responses: list[str]) ->
list[float]`` scored batch-wise, weighted by ``reward_model_weight``; it is either an HF folder
(sequence-classification or causal LM, :mod:`streamrl.roles.reward_model`) or a hook
``package.module:factory`` called once as ``factory(device)``; its weight can sit in the spec
next to the rule rewards: ``"exact_answer=1.0,reward_model=0.5"``. When the reward-model role runs
as its own process (``placement.reward``), pass its endpoint and the worker scores through a
:class:`~streamrl.roles.reward_client.RewardClient` instead of loading the model itself.

Token-level credit (``rollout.token_rewards``): a reward function may carry credit per
response character, ``token_credit(problem, response) -> list[float]`` summing to its score
(the task's method for the name ``task``; a ``token_credit`` attribute on a plug-in function).
:meth:`CombinedReward.credits` spreads each trajectory's total reward into such character
credits plus a *terminal* remainder (components without credit, the reward model, rounding),
and :func:`token_rewards` maps them onto the sampled tokens: a character's credit goes to the
token whose decoded text holds it, the terminal remainder to the last response token (the EOS
when there is one). So ``sum(token_rewards) == reward`` for every trajectory, and a reward with
no character credit at all lands entirely on the last token.

Examples:
    >>> from streamrl.tasks.registry import Problem
    >>> fn = build_reward("exact_answer=1.0,format=0.5")
    >>> fn.score([Problem("What is 2 + 3?", "5")], ["5"])[1]
    [[1.0, 1.0]]
"""
from __future__ import annotations

import importlib
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Callable

from streamrl.tasks.registry import Problem

RewardFn = Callable[[Problem, str], float]
log = logging.getLogger(__name__)
_INT = re.compile(r"-?\d+")
_REGISTRY: dict[str, RewardFn] = {}


class RewardSpecError(ValueError):
    """A reward spec names an unknown reward, a bad weight or an unimportable plug-in."""


def register_reward(name: str):
    """Decorator: ``@register_reward("my_reward")`` on ``fn(problem, response) -> float``."""

    def wrap(fn: RewardFn) -> RewardFn:
        _REGISTRY[name] = fn
        return fn

    return wrap


def available_rewards() -> list[str]:
    return sorted(_REGISTRY) + ["task"]


def _answer_text(response: str) -> str:
    """The answer part of a response: text before the first newline, stripped."""
    return response.strip().split("\n", 1)[0].strip()


@register_reward("exact_answer")
def exact_answer(problem: Problem, response: str) -> float:
    """1 when the response's answer equals ``problem.answer``.

    Integers compare by value of the first integer ("The answer is 47." == "47");
    other answers by exact text of the first line.
    """
    if _INT.fullmatch(problem.answer.strip()):
        m = _INT.search(response.replace(",", ""))
        return float(m is not None and int(m.group()) == int(problem.answer))
    return float(_answer_text(response) == problem.answer.strip())


@register_reward("format")
def format_reward(problem: Problem, response: str) -> float:
    """1 when the response is *only* the answer's kind of token (an integer for integer
    answers, a single non-empty line otherwise): rewards following "answer with the number only"."""
    text = response.strip()
    if _INT.fullmatch(problem.answer.strip()):
        return float(_INT.fullmatch(text.rstrip(".")) is not None)
    return float(bool(text) and "\n" not in text)


# math-verify bounds parse/verify time with signal.alarm, which only the main thread may use.
MATH_VERIFY_TIMEOUT_S = 5


@register_reward("math_verify")
def math_verify_reward(problem: Problem, response: str) -> float:
    """1 when the response's final answer is mathematically equal to ``problem.answer``
    (math-verify: ``1/2`` == ``0.5`` == ``\\frac{1}{2}`` == ``\\boxed{0.5}``; LaTeX or plain).

    The reference is parsed as written (``$...$`` and ``\\boxed{}`` work too). Outside the
    main thread the parse runs without math-verify's alarm-based timeout (it cannot set one).
    """
    from math_verify import parse, verify  # noqa: PLC0415 (sympy: paid only by runs that use it)

    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(problem.answer, parsing_timeout=timeout)
    if not gold:  # a bad reference in the data: say so, score 0, keep the run going
        log.warning("math_verify reward: the reference answer %r parses to nothing; scored 0", problem.answer)
        return 0.0
    pred = parse(response, parsing_timeout=timeout)
    return float(bool(pred) and verify(gold, pred, timeout_seconds=timeout))


def _import(target: str, field: str):
    mod_name, _, attr = target.partition(":")
    if not mod_name or not attr:
        raise RewardSpecError(f"{field} = {target!r}: a plug-in is 'package.module:function'")
    try:
        obj = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise RewardSpecError(f"{field} = {target!r}: cannot import ({e})") from e
    if not callable(obj):
        raise RewardSpecError(f"{field} = {target!r}: is not callable")
    return obj


def parse_reward_spec(spec: str) -> list[tuple[str, float]]:
    """``"a=1.0,b=0.1"`` -> ``[("a", 1.0), ("b", 0.1)]``; a bare name weighs 1."""
    items = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, _, w = part.rpartition("=") if "=" in part else (part, "", "1")
        try:
            weight = float(w)
        except ValueError:
            raise RewardSpecError(f"rollout.rewards = {spec!r}: weight {w!r} of {name!r} is not a number") from None
        items.append((name.strip(), weight))
    if not items:
        raise RewardSpecError(f"rollout.rewards = {spec!r}: names no reward")
    return items


@dataclass
class CombinedReward:
    """Weighted sum of reward functions, plus an optional batch reward model."""

    names: list[str]
    weights: list[float]
    fns: list[RewardFn]
    model: Callable[[list[str], list[str]], list[float]] | None = None
    model_weight: float = 1.0
    credit_fns: list[Callable[[Problem, str], list[float]] | None] | None = None
    """Per-component character-credit functions (None where a component has none)."""
    errors: dict[str, int] = field(default_factory=dict)
    """Per-component count of calls that raised (they scored 0)."""

    def score(self, problems: list[Problem], responses: list[str]) -> tuple[list[float], list[list[float]]]:
        """Returns ``(total [B], components [B][C])``; components follow ``names`` (+ ``reward_model``)."""
        comps = [[self._call(name, fn, p, r) for name, fn in zip(self.names, self.fns)]
                 for p, r in zip(problems, responses)]
        if self.model is not None:
            extra = self.model([p.prompt for p in problems], responses)
            if len(extra) != len(responses):
                raise RuntimeError(f"reward model returned {len(extra)} scores for {len(responses)} responses")
            for row, x in zip(comps, extra):
                row.append(float(x))
        ws = self.weights + ([self.model_weight] if self.model is not None else [])
        return [sum(w * c for w, c in zip(ws, row)) for row in comps], comps

    def _call(self, name: str, fn: RewardFn, problem: Problem, response: str) -> float:
        """One component's score; a plug-in that raises scores 0 and is counted in ``errors``
        (logged on its first failure): one bad response must not stop the run."""
        try:
            return float(fn(problem, response))
        except Exception as e:  # a user plug-in's bug: any type
            self.errors[name] = self.errors.get(name, 0) + 1
            if self.errors[name] == 1:
                log.warning("reward %r raised %s: %s; it scores 0 (counted in reward errors)", name,
                            type(e).__name__, e)
            return 0.0

    def credits(self, problems: list[Problem], responses: list[str], totals: list[float]
                ) -> tuple[list[list[float]], list[float]]:
        """Spread each total reward into character credits and a terminal remainder.

        Args:
            problems, responses: as given to :meth:`score` ([B] each).
            totals: [B] the totals :meth:`score` returned for them.
        Returns:
            ``(char_credit [B][len(response_i)], terminal [B])`` with
            ``sum(char_credit[i]) + terminal[i] == totals[i]`` (the remainder absorbs
            components without credit, the reward model and float rounding).
        """
        credit_fns = self.credit_fns or [None] * len(self.fns)
        chars, terminal = [], []
        for p, r, total in zip(problems, responses, totals):
            row = [0.0] * len(r)
            for w, fn in zip(self.weights, credit_fns):
                if fn is None or w == 0:
                    continue
                c = fn(p, r)
                if len(c) != len(r):
                    raise RuntimeError(f"token_credit returned {len(c)} credits for a response of {len(r)} characters")
                for j, x in enumerate(c):
                    row[j] += w * float(x)
            chars.append(row)
            terminal.append(float(total) - sum(row))
        return chars, terminal


def load_reward_model(reward_model: str, device: str = "cpu",
                      endpoint: str | Callable[[], str | None] | None = None) -> Callable[[list[str], list[str]], list[float]]:
    """The batch reward model named by ``rollout.reward_model``: a client of the reward-model role
    when ``endpoint`` is given (a string or a function reading it, e.g. from Redis), else the HF
    folder loaded on ``device``, else the ``package.module:factory`` hook called with ``device``."""
    if endpoint:
        from streamrl.roles.reward_client import RewardClient  # noqa: PLC0415 (zmq: only RM users pay)

        return RewardClient(endpoint)
    # torch: only runs with a reward model pay for it
    from streamrl.roles.reward_model import HFRewardModel, is_reward_model_folder  # noqa: PLC0415

    if is_reward_model_folder(reward_model):
        return HFRewardModel(reward_model, device)
    return _import(reward_model, "rollout.reward_model")(device)


def build_reward(spec: str = "task", task=None, reward_model: str = "", reward_model_device: str = "cpu",
                 reward_model_weight: float = 1.0,
                 reward_endpoint: str | Callable[[], str | None] | None = None) -> CombinedReward:
    """Resolve a reward spec (see module doc); ``task`` is needed for the name ``task``;
    ``reward_endpoint`` (the reward-model role's, see :func:`load_reward_model`) replaces loading
    ``reward_model`` here."""
    names, weights, fns, credit_fns = [], [], [], []
    for name, w in parse_reward_spec(spec):
        if name == "reward_model":  # the model's weight given in the spec, next to the rule rewards'
            if not reward_model:
                raise RewardSpecError("rollout.rewards names 'reward_model' but rollout.reward_model is not set")
            reward_model_weight = w
            continue
        if name == "task":
            if task is None:
                raise RewardSpecError("rollout.rewards names 'task' but no task was given")
            fn = task.reward
        elif name in _REGISTRY:
            fn = _REGISTRY[name]
        elif ":" in name:
            fn = _import(name, "rollout.rewards")
        else:
            raise RewardSpecError(f"rollout.rewards names {name!r}: unknown; known {available_rewards()} "
                                  "or 'package.module:function'")
        credit_fns.append(getattr(task if name == "task" else fn, "token_credit", None))
        names.append(name)
        weights.append(w)
        fns.append(fn)
    model = None
    if reward_model:
        model = load_reward_model(reward_model, reward_model_device, reward_endpoint)
        names.append("reward_model")
    return CombinedReward(names, weights, fns, model, reward_model_weight, credit_fns)


def _until_eos(tok, ids: list[int]) -> list[int]:
    eos = getattr(tok, "eos_token_id", None)
    ids = list(ids)
    return ids[: ids.index(eos)] if eos is not None and eos in ids else ids


def response_texts(tok, token_lists: list[list[int]]) -> list[str]:
    """The texts rewards score: each response up to (not including) its first EOS, with every
    other special token *visible* (``<pad>``, ``<bos>``, chat markers).

    Why visible: with ``skip_special_tokens=True`` the pad / bos tokens a policy samples between
    its digits would vanish (``'9<pad>5'`` scored as ``'95'``), so the reward would pay for text
    the model never wrote in that form, and positions in the text would not match positions in
    the response.
    """
    return tok.batch_decode([_until_eos(tok, ids) for ids in token_lists], skip_special_tokens=False)


def decoded_prefix_lengths(tok, ids: list[int]) -> list[int]:
    """``[len(response_texts([ids[:k + 1]])[0])]`` for every k: where each token's text ends in the
    scored response (special tokens visible, nothing from the EOS on).

    Decoding prefixes (rather than tokens one by one) is what stays right for byte-level BPE
    (a character split over tokens appears once complete) and SentencePiece (a leading space
    shows only mid-text). Cost: O(n^2) characters decoded per response of n tokens, in the
    tokenizer's native batch decode; only paid for responses that carry character credit.
    """
    texts = response_texts(tok, [ids[: k + 1] for k in range(len(ids))])
    return [len(t) for t in texts]


def token_rewards(tok, ids: list[int], char_credit: list[float], terminal: float) -> list[float]:
    """Map one response's character credits and terminal remainder onto its tokens.

    Args:
        tok: the tokenizer that decoded ``ids`` (:func:`response_texts`) into the text the
            credits index.
        ids: [n] sampled response token ids.
        char_credit: credit per character of the decoded response text.
        terminal: the remainder; goes to the first EOS token, else the last token.
    Returns:
        [n] per-token rewards summing to ``sum(char_credit) + terminal``. A character's credit
        goes to the first token whose decoded prefix covers it; the EOS and anything after it
        decode to nothing and get 0 besides the terminal remainder.
    """
    n = len(ids)
    out = [0.0] * n
    if n == 0:
        return out
    eos = getattr(tok, "eos_token_id", None)
    last = ids.index(eos) if eos is not None and eos in ids else n - 1
    if any(char_credit):
        # prefixes past the EOS decode to the same text: their credit is clamped to ``last``
        ends = decoded_prefix_lengths(tok, ids[: last + 1])
        k = 0
        for c_idx, c in enumerate(char_credit):
            while k < len(ends) and ends[k] <= c_idx:  # first token whose decoded prefix covers c_idx
                k += 1
            out[min(k, last)] += c
    out[last] += terminal
    return out
