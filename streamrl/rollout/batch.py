"""Single-turn grouped sampling: ``prompts_per_batch`` problems x ``group_size`` samples per batch,
scored by the run's reward and packed for the learner (GRPO-style groups share a group id).

Redis-free: the rollout worker drives it through :class:`streamrl.rollout.base.Roller`, and the
rollout benchmark drives it directly.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from tensordict import TensorDict

from streamrl.config import Config
from streamrl.engines.base import BetweenSteps, Generation
from streamrl.rewards import CombinedReward, response_texts, token_rewards
from streamrl.rollout.prompts import PromptEncoder
from streamrl.tasks.truncation import apply_truncation_rule, stop_ids
from streamrl.trajectory import make_id, pack_trajectories


def _no_update() -> None:
    return None


class BatchRoller:
    """One batch per :meth:`rollout_batch` call.

    problems: an endless iterator of task problems (this worker's shard).
    reward: the run's reward (``score(problems, texts)``; ``credits`` for ``rollout.token_rewards``).
    next_id: () -> a unique 63-bit id for groups and trajectories (default: a local counter).
    truncated_scores_zero: the task's rule for a response cut at ``max_new_tokens`` (scores 0);
    truncated responses are counted either way (``rollout/truncated``: their share of the batch).
    """

    def __init__(self, cfg: Config, engine, tok, problems: Iterator[Any], reward: CombinedReward,
                 worker_id: int = 0, next_id: Callable[[], int] | None = None, truncated_scores_zero: bool = False):
        self.cfg, self.engine, self.tok, self.problems, self.wid = cfg, engine, tok, problems, worker_id
        self.encode = PromptEncoder(tok, cfg.rollout.chat_template)
        self.reward = reward
        self.truncated_scores_zero = truncated_scores_zero
        self._eos = stop_ids(tok)
        self.last_metrics: dict[str, float] = {}
        self._counter = 0
        self._next_id = next_id or self._local_id

    def _local_id(self) -> int:
        self._counter += 1
        return make_id(self.wid, self._counter)

    def rollout_batch(self, version: int, between_steps: BetweenSteps | None = None) -> TensorDict:
        """Generate, score and pack one batch; tokens are stamped with ``version``, or, with
        ``between_steps`` (in-flight updates), with the version the engine reports per token."""
        rc = self.cfg.rollout
        started = time.time()
        problems = [next(self.problems) for _ in range(rc.prompts_per_batch)]
        flat_prompts = [ids for ids in (self.encode.problem(p) for p in problems) for _ in range(rc.group_size)]
        gen = self._generate(flat_prompts, version, between_steps)
        texts = response_texts(self.tok, gen.tokens)
        flat_problems = [p for p in problems for _ in range(rc.group_size)]
        rewards, components = self.reward.score(flat_problems, texts)
        rewards, cut = apply_truncation_rule(rewards, gen.tokens, self._eos, rc.max_new_tokens,
                                             self.truncated_scores_zero)
        self.last_metrics = {"rollout/truncated": sum(cut) / max(len(cut), 1),
                             "rollout/reward_errors": float(sum(self.reward.errors.values()))}
        group_ids, traj_ids = self._ids(len(problems), rc.group_size)
        versions = gen.versions if gen.versions is not None else [[version] * len(t) for t in gen.tokens]
        per_token = self._token_rewards(flat_problems, texts, gen.tokens, rewards) if rc.token_rewards else None
        return pack_trajectories(flat_prompts, gen.tokens, gen.logprobs, versions, rewards, group_ids, traj_ids,
                                 self.wid, time.time(), started_at=started, reward_components=components,
                                 routed_experts=gen.routed_experts, token_rewards=per_token)

    def _generate(self, prompts: list[list[int]], version: int, between_steps: BetweenSteps | None) -> Generation:
        rc = self.cfg.rollout
        if between_steps is None and rc.inflight_updates:
            between_steps = _no_update  # same engine path as the worker's (the benchmark measures it)
        if between_steps is None:  # the plain call: every engine, no per-step hook
            return self.engine.generate(prompts, rc.max_new_tokens, rc.temperature)
        return self.engine.generate(prompts, rc.max_new_tokens, rc.temperature,
                                    between_steps=between_steps, version=version)

    def _ids(self, groups: int, group_size: int) -> tuple[list[int], list[int]]:
        """``(group_ids, traj_ids)`` of ``groups x group_size`` trajectories, drawn group by group."""
        group_ids, traj_ids = [], []
        for _ in range(groups):
            gid = self._next_id()
            for _ in range(group_size):
                group_ids.append(gid)
                traj_ids.append(self._next_id())
        return group_ids, traj_ids

    def _token_rewards(self, problems, texts, tokens, rewards) -> list[list[float]]:
        """Per-token rewards (``rollout.token_rewards``): the rewards' character credit mapped
        onto the sampled tokens, the rest of each reward on the last token (see streamrl.rewards)."""
        chars, terminal = self.reward.credits(problems, texts, rewards)
        return [token_rewards(self.tok, list(ids), c, t) for ids, c, t in zip(tokens, chars, terminal)]

    def close(self) -> None:
        """Nothing of its own to release (the engine and the reward are shared)."""
