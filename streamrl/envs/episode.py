"""The multi-turn episode driver: any engine, turn by turn, one trajectory per episode.

All live episodes of a batch generate their next turn in one ``engine.generate`` call over the
whole conversation so far (prompt + every earlier turn, as tokens; reusing the KV of earlier
turns is left to the engines). Each model turn is decoded and handed to its environment; the
environments step concurrently in a thread pool (their tools run while the other episodes'
environments do). The reply is rendered to tokens and appended, and the next turn starts.

The trajectory of an episode keeps the opening prompt as ``prompt_tokens`` and everything after
it as ``response_tokens``, model and environment tokens interleaved:

=================  =========================  =========================================
per response token model token                environment / tool token
=================  =========================  =========================================
response_mask      True (trained)             False (never in the loss)
behaviour_logprob  from the engine            0.0
policy_version     from the engine / turn     version of the model token before it
=================  =========================  =========================================

So the existing ``response_mask`` field of the trajectory contract is the loss mask; the learner
needs no new key. Versions: an engine that reports per-token versions (in-flight updates) gives
them; otherwise each turn is stamped with the version ``before_turn()`` returns when the turn starts
(the worker's hook that loads pending weights between turns), so a weight update between turns
shows as a version change inside the trajectory.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from streamrl.envs.base import Environment, StepResult
from streamrl.envs.render import Renderer
from streamrl.trajectory import pack_trajectories


@dataclass(frozen=True)
class EpisodeLimits:
    """max_turns: model turns per episode. max_turn_tokens: new tokens per model turn.
    max_response_tokens: model + environment tokens after the prompt, per episode."""

    max_turns: int = 4
    max_turn_tokens: int = 64
    max_response_tokens: int = 256

    def __post_init__(self):
        for name in ("max_turns", "max_turn_tokens", "max_response_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EpisodeLimits.{name} = {getattr(self, name)}: must be >= 1")


@dataclass
class Episode:
    """One finished episode.

    prompt: [P] opening tokens. response: [R] everything after, model and env tokens.
    mask: [R] True on model tokens. logprobs: [R] behaviour log mu (0 on env tokens).
    versions: [R] policy version per token. reward: summed over turns.
    stop: "done" (environment ended it), "max_turns" or "max_tokens".
    """

    prompt: list[int]
    response: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    stop: str = ""
    info: dict[str, float] = field(default_factory=dict)
    started_at: float = 0.0

    def add(self, tokens: list[int], is_model: bool, logprobs: list[float] | None, versions: list[int]) -> None:
        self.response += tokens
        self.mask += [is_model] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.versions += versions


def run_episodes(engine, envs: list[Environment], problems: list[Any], renderer: Renderer, decode: Callable,
                 eos_id: int, limits: EpisodeLimits = EpisodeLimits(), temperature: float = 1.0,
                 before_turn: Callable[[], int] = lambda: 0, pool: ThreadPoolExecutor | None = None,
                 **generate_kwargs) -> list[Episode]:
    """Play one episode per ``(env, problem)`` to the end; returns them in order.

    ``decode(tokens) -> str`` turns a model turn (without its end-of-turn token) into the text the
    environment reads. ``generate_kwargs`` go to every ``engine.generate`` call (e.g. the in-flight
    ``between_steps`` hook of hf_fast/vllm).
    """
    if len(envs) != len(problems):
        raise ValueError(f"{len(envs)} environments for {len(problems)} problems")
    now = time.time()
    episodes = [Episode(prompt=renderer.prompt_tokens(env.reset(p)), started_at=now) for env, p in zip(envs, problems)]
    live = list(range(len(episodes)))
    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=max(1, min(16, len(envs))), thread_name_prefix="streamrl-env")
    try:
        while live:
            budget = {i: min(limits.max_turn_tokens, limits.max_response_tokens - len(episodes[i].response))
                      for i in live}
            version = before_turn()
            extra = {**generate_kwargs, "version": version} if "between_steps" in generate_kwargs else generate_kwargs
            gen = engine.generate([episodes[i].prompt + episodes[i].response for i in live],
                                  max(budget.values()), temperature, **extra)
            texts = {}
            for j, i in enumerate(live):
                ep, n = episodes[i], budget[i]
                toks, lps = gen.tokens[j][:n], gen.logprobs[j][:n]
                vers = gen.versions[j][:n] if gen.versions is not None else [version] * len(toks)
                ep.add(toks, True, lps, vers)
                ep.turns += 1
                ended = bool(toks) and toks[-1] == eos_id
                texts[i] = (decode(toks[:-1] if ended else toks), ended)
            steps: dict[int, StepResult] = dict(zip(live, pool.map(lambda i: envs[i].step(texts[i][0]), live)))
            still = []
            for i in live:
                ep, res = episodes[i], steps[i]
                ep.reward += float(res.reward)
                for k, v in res.info.items():
                    ep.info[k] = ep.info.get(k, 0.0) + v
                if res.done:
                    ep.stop = "done"
                    continue
                if ep.turns >= limits.max_turns:
                    ep.stop = "max_turns"
                    continue
                reply = renderer.env_tokens(res.messages, model_ended=texts[i][1])
                # The reply must leave room for at least one model token, else the turn is pointless.
                if len(ep.response) + len(reply) >= limits.max_response_tokens:
                    ep.stop = "max_tokens"
                    continue
                ep.add(reply, False, None, [ep.versions[-1]] * len(reply))
                still.append(i)
            live = still
    finally:
        if own_pool:
            pool.shutdown(wait=True)
    return episodes


def episodes_to_trajectories(episodes: list[Episode], group_ids: list[int], traj_ids: list[int],
                             worker_id: int) -> "TensorDict":  # noqa: F821
    """A packed trajectory batch (:mod:`streamrl.trajectory`), one trajectory per episode, with
    ``response_mask`` False on environment tokens."""
    if any(not ep.response for ep in episodes):
        raise ValueError("an episode without response tokens cannot be a trajectory")
    return pack_trajectories(
        [ep.prompt for ep in episodes], [ep.response for ep in episodes], [ep.logprobs for ep in episodes],
        [ep.versions for ep in episodes], [ep.reward for ep in episodes], group_ids, traj_ids, worker_id,
        time.time(), started_at=[ep.started_at for ep in episodes], response_masks=[ep.mask for ep in episodes])


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Monitor figures of a batch of episodes (worker metrics, shown by ``streamrl-monitor``):
    ``env/turns_mean``, ``env/tool_calls`` and ``env/tool_errors`` (this batch),
    ``env/tool_call_rate`` (episodes with at least one call), ``env/tool_latency_s`` (mean per
    call), ``env/env_token_frac`` (tool tokens among response tokens), ``env/answer_reward_mean``
    (the reward without the tool-call shaping term, ``env.call_reward``) and ``env/stop_*``."""
    n = max(1, len(episodes))
    tokens = sum(len(ep.response) for ep in episodes)
    calls = sum(ep.info.get("tool_calls", 0.0) for ep in episodes)
    out = {
        "env/turns_mean": sum(ep.turns for ep in episodes) / n,
        "env/tool_calls": calls,
        "env/tool_errors": sum(ep.info.get("tool_errors", 0.0) for ep in episodes),
        "env/tool_call_rate": sum(ep.info.get("tool_calls", 0.0) > 0 for ep in episodes) / n,
        "env/tool_latency_s": sum(ep.info.get("tool_latency_s", 0.0) for ep in episodes) / max(1.0, calls),
        "env/env_token_frac": sum(len(ep.mask) - sum(ep.mask) for ep in episodes) / max(1, tokens),
        "env/answer_reward_mean": sum(ep.reward - ep.info.get("call_reward", 0.0) for ep in episodes) / n,
    }
    for reason in ("done", "max_turns", "max_tokens"):
        out[f"env/stop_{reason}"] = float(sum(ep.stop == reason for ep in episodes))
    return out
