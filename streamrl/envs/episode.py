"""The multi-turn episode driver: any engine, turn by turn, one trajectory per episode.

The live episodes of a lane generate their next turn in one ``engine.generate`` call over the
whole conversation so far (prompt + every earlier turn, as tokens). Each model turn is decoded
and handed to its environment; the environments step concurrently in a thread pool. The reply
is rendered to tokens and appended, and the next turn starts.

* **KV across turns**: each turn's prompt is exactly the previous prompt + response + reply, so
  an engine that keeps sessions (hf_fast, :mod:`streamrl.engines.kv_sessions`) prefills only the
  reply; the episode's session is released when it ends. vLLM gets the same from its prefix
  cache (``rollout.enable_prefix_caching``); the plain ``hf`` engine re-prefills every turn.
* **Tools overlap generation** (``lanes > 1``): the batch is split into lanes that take turns at
  the engine; while one lane's tools run, the next lane generates. ``lanes = 1``: all episodes
  generate, then all tools run (the largest batches; best when tools are fast).

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

import itertools
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

from streamrl.envs.base import Environment, StepResult
from streamrl.envs.render import Renderer
from streamrl.trajectory import pack_trajectories

_SESSION_IDS = itertools.count()  # engine session ids, unique for the process (an engine outlives a batch)


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
    prompt_tokens: int = 0  # conversation tokens sent to the engine as prompts, all turns
    cached_tokens: int = 0  # of those, tokens whose KV the engine reused (kept session / prefix cache)

    def add(self, tokens: list[int], is_model: bool, logprobs: list[float] | None, versions: list[int]) -> None:
        self.response += tokens
        self.mask += [is_model] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.versions += versions


def run_episodes(engine, envs: list[Environment], problems: list[Any], renderer: Renderer, decode: Callable,
                 eos_id: int, limits: EpisodeLimits = EpisodeLimits(), temperature: float = 1.0,
                 before_turn: Callable[[], int] = lambda: 0, pool: ThreadPoolExecutor | None = None,
                 lanes: int = 1, reuse_kv: bool = True, **generate_kwargs) -> list[Episode]:
    """Play one episode per ``(env, problem)`` to the end; returns them in order.

    ``decode(tokens) -> str`` turns a model turn (without its end-of-turn token) into the text the
    environment reads. ``lanes``: contiguous parts of the batch that take turns at the engine, so
    one lane's tools run while another generates (1 = no overlap). ``reuse_kv``: name each
    episode's session to an engine that keeps them (has ``release``). ``generate_kwargs`` go to
    every ``engine.generate`` call (e.g. the in-flight ``between_steps`` hook of hf_fast/vllm).
    """
    if len(envs) != len(problems):
        raise ValueError(f"{len(envs)} environments for {len(problems)} problems")
    if lanes < 1:
        raise ValueError(f"lanes = {lanes}: must be >= 1")
    play = _EpisodePlay(engine, envs, problems, renderer, decode, eos_id, limits, temperature, before_turn,
                        reuse_kv, generate_kwargs)
    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=max(1, min(16, len(envs))), thread_name_prefix="streamrl-env")
    try:
        play.run(pool, lanes)
    finally:
        if play.release is not None:
            play.release(play.sessions)
        if own_pool:
            pool.shutdown(wait=True)
    return play.episodes


class _EpisodePlay:
    """The episodes of one :func:`run_episodes` call, played turn by turn, lane by lane."""

    def __init__(self, engine, envs, problems, renderer: Renderer, decode: Callable, eos_id: int,
                 limits: EpisodeLimits, temperature: float, before_turn: Callable[[], int], reuse_kv: bool,
                 generate_kwargs: dict):
        self.engine, self.envs, self.renderer, self.decode, self.eos_id = engine, envs, renderer, decode, eos_id
        self.limits, self.temperature, self.before_turn = limits, temperature, before_turn
        self.generate_kwargs = generate_kwargs
        now = time.time()
        self.episodes = [Episode(prompt=renderer.prompt_tokens(env.reset(p)), started_at=now)
                         for env, p in zip(envs, problems)]
        # kept KV sessions are an optional engine feature (hf_fast has ``release``, see streamrl.engines.base)
        self.release = getattr(engine, "release", None) if reuse_kv else None
        self.sessions = [next(_SESSION_IDS) for _ in self.episodes]

    def run(self, pool: ThreadPoolExecutor, lanes: int) -> None:
        """Alternate lanes between the engine and their tools (run on ``pool``) until every episode stops."""
        n = len(self.episodes)
        cuts = [n * k // lanes for k in range(lanes + 1)]
        ready = deque(list(range(cuts[k], cuts[k + 1])) for k in range(lanes) if cuts[k + 1] > cuts[k])
        running: deque[tuple[list[int], dict[int, Future], dict]] = deque()  # lanes whose tools run
        while ready or running:
            while running and all(f.done() for f in running[0][1].values()):
                still = self.finish(*running.popleft())
                if still:
                    ready.append(still)
            if ready:
                live = ready.popleft()
                turns = self.generate(live)
                running.append((live, {i: pool.submit(self.envs[i].step, turns[i][0]) for i in live}, turns))
            elif running:  # nothing to generate: wait for the lane whose tools started first
                wait(running[0][1].values())

    def generate(self, live: list[int]) -> dict[int, tuple[str, bool]]:
        """One model turn for ``live``: per episode, the turn's text and whether it ended with the
        end-of-turn token."""
        episodes, limits = self.episodes, self.limits
        budget = {i: min(limits.max_turn_tokens, limits.max_response_tokens - len(episodes[i].response)) for i in live}
        version = self.before_turn()
        kwargs = self.generate_kwargs
        extra = {**kwargs, "version": version} if "between_steps" in kwargs else kwargs
        if self.release is not None:
            extra = {**extra, "sessions": [self.sessions[i] for i in live]}
        prompts = [episodes[i].prompt + episodes[i].response for i in live]
        gen = self.engine.generate(prompts, max(budget.values()), self.temperature, **extra)
        turns = {}
        for j, i in enumerate(live):
            ep, cap = episodes[i], budget[i]
            toks, lps = gen.tokens[j][:cap], gen.logprobs[j][:cap]
            vers = gen.versions[j][:cap] if gen.versions is not None else [version] * len(toks)
            ep.prompt_tokens += len(prompts[j])
            ep.cached_tokens += gen.cached_tokens[j] if gen.cached_tokens is not None else 0
            ep.add(toks, True, lps, vers)
            ep.turns += 1
            ended = bool(toks) and toks[-1] == self.eos_id
            turns[i] = (self.decode(toks[:-1] if ended else toks), ended)
        return turns

    def finish(self, live: list[int], steps: dict[int, Future], turns: dict[int, tuple[str, bool]]) -> list[int]:
        """Apply the lane's environment steps; returns the episodes that play another turn."""
        limits, still = self.limits, []
        for i in live:
            ep, res = self.episodes[i], steps[i].result()
            ep.reward += float(res.reward)
            for k, v in res.info.items():
                ep.info[k] = ep.info.get(k, 0.0) + v
            reply = [] if res.done or ep.turns >= limits.max_turns else \
                self.renderer.env_tokens(res.messages, model_ended=turns[i][1])
            # The reply must leave room for at least one model token, else the turn is pointless.
            ep.stop = "done" if res.done else "max_turns" if ep.turns >= limits.max_turns else \
                "max_tokens" if len(ep.response) + len(reply) >= limits.max_response_tokens else ""
            if ep.stop:
                if self.release is not None:
                    self.release([self.sessions[i]])
                continue
            ep.add(reply, False, None, [ep.versions[-1]] * len(reply))
            still.append(i)
        return still


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
    (the reward without the tool-call shaping term, ``env.call_reward``), ``env/stop_*``, and the
    prompt tokens of all turns the engine ran (``env/prefill_tokens``) or took from its KV of
    earlier turns (``env/prefill_tokens_saved``)."""
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
        "env/prefill_tokens": float(sum(ep.prompt_tokens - ep.cached_tokens for ep in episodes)),
        "env/prefill_tokens_saved": float(sum(ep.cached_tokens for ep in episodes)),
    }
    for reason in ("done", "max_turns", "max_tokens"):
        out[f"env/stop_{reason}"] = float(sum(ep.stop == reason for ep in episodes))
    return out
