"""What the single-turn rollers share: problems -> prompts, then samples -> rewards, ids, packed batch.

:class:`~streamrl.rollout.batch.BatchRoller` scores a whole batch after one generate call,
:class:`~streamrl.rollout.stream.StreamingRoller` each group as soon as its last sample is in;
both go through :class:`GroupScorer`, so a trajectory is encoded, rewarded, judged truncated, given
ids and packed the same way whichever roller produced it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Sequence

import torch
from tensordict import TensorDict

from streamrl.config import Config
from streamrl.rewards import CombinedReward, response_texts, token_rewards
from streamrl.rollout.metrics import task_rewards
from streamrl.rollout.prompts import PromptEncoder
from streamrl.tasks.truncation import apply_truncation_rule, stop_ids
from streamrl.trajectory import make_id, pack_trajectories


@dataclass
class ScoredSamples:
    """Scored samples of whole groups, one entry per sample in every list (a group's samples adjacent).

    versions[i]: the policy version of each token of ``tokens[i]``; routed[i]: int16
    ``[len(tokens[i]), L, k]`` or None for all; token_rewards[i]: ``len(tokens[i])`` floats or None
    for all; started_at[i]: when the sample's group was admitted (wall clock).
    """

    problems: list[Any]
    prompts: list[list[int]]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    rewards: list[float]
    components: list[list[float]]
    truncated: list[bool]
    group_ids: list[int]
    traj_ids: list[int]
    started_at: list[float]
    routed: list[torch.Tensor] | None = None
    token_rewards: list[list[float]] | None = None

    @classmethod
    def concat(cls, parts: Sequence[ScoredSamples]) -> ScoredSamples:
        """The samples of ``parts`` in order (optional fields kept only when every part has them)."""
        out = {}
        for f in fields(cls):
            values = [getattr(p, f.name) for p in parts]
            out[f.name] = None if any(v is None for v in values) else [x for v in values for x in v]
        return cls(**out)

    def __len__(self) -> int:
        return len(self.tokens)


class GroupScorer:
    """Prompt encoding, rewards with the task's truncation rule, ids and packing of sampled groups.

    reward: the run's reward (``score(problems, texts)``; ``credits`` for ``rollout.token_rewards``).
    next_id: () -> a unique 63-bit id for groups and trajectories (default: a local counter).
    truncated_scores_zero: the task's rule for a response cut at ``max_new_tokens`` (scores 0);
    truncated responses are counted either way (``rollout/truncated``).
    """

    def __init__(self, cfg: Config, tok, reward: CombinedReward, worker_id: int = 0,
                 next_id: Callable[[], int] | None = None, truncated_scores_zero: bool = False):
        self.cfg, self.tok, self.reward, self.wid = cfg, tok, reward, worker_id
        self.encode = PromptEncoder(tok, cfg.rollout.chat_template)
        self.truncated_scores_zero = truncated_scores_zero
        self._eos = stop_ids(tok)
        self._counter = 0
        self._next_id = next_id or self._local_id

    def _local_id(self) -> int:
        self._counter += 1
        return make_id(self.wid, self._counter)

    def prompts(self, problems: Sequence[Any]) -> list[list[int]]:
        """``group_size`` copies of each problem's prompt ids, group by group."""
        g = self.cfg.rollout.group_size
        return [ids for ids in (self.encode.problem(p) for p in problems) for _ in range(g)]

    def score(self, problems: list[Any], prompts: list[list[int]], tokens: list[list[int]],
              logprobs: list[list[float]], versions: list[list[int]], started_at: list[float],
              routed: list[torch.Tensor] | None = None) -> ScoredSamples:
        """Reward whole groups (``problems``: one per sample, ``group_size`` in a row) and draw their
        ids, group by group: the group id, then its samples' ids."""
        rc = self.cfg.rollout
        texts = response_texts(self.tok, tokens)
        rewards, components = self.reward.score(problems, texts)
        rewards, cut = apply_truncation_rule(rewards, tokens, self._eos, rc.max_new_tokens,
                                             self.truncated_scores_zero)
        group_ids, traj_ids = [], []
        for _ in range(len(tokens) // rc.group_size):
            gid = self._next_id()
            for _ in range(rc.group_size):
                group_ids.append(gid)
                traj_ids.append(self._next_id())
        per_token = self._token_rewards(problems, texts, tokens, rewards) if rc.token_rewards else None
        return ScoredSamples(problems, prompts, tokens, logprobs, versions, rewards, components, cut,
                             group_ids, traj_ids, started_at, routed, per_token)

    def pack(self, s: ScoredSamples) -> TensorDict:
        """One trajectory message (:func:`streamrl.trajectory.pack_trajectories`) of ``s``."""
        return pack_trajectories(s.prompts, s.tokens, s.logprobs, s.versions, s.rewards, s.group_ids, s.traj_ids,
                                 self.wid, time.time(), started_at=s.started_at, reward_components=s.components,
                                 routed_experts=s.routed, token_rewards=s.token_rewards)

    def metrics(self, s: ScoredSamples) -> dict[str, float]:
        """``rollout/truncated`` (share of ``s``), ``rollout/reward_errors``, per-task reward means."""
        return {"rollout/truncated": sum(s.truncated) / max(len(s.truncated), 1),
                "rollout/reward_errors": float(sum(self.reward.errors.values())),
                **task_rewards(s.problems, s.rewards, self.cfg.task.name)}

    def _token_rewards(self, problems, texts, tokens, rewards) -> list[list[float]]:
        """Per-token rewards (``rollout.token_rewards``): the rewards' character credit mapped
        onto the sampled tokens, the rest of each reward on the last token (see streamrl.rewards)."""
        chars, terminal = self.reward.credits(problems, texts, rewards)
        return [token_rewards(self.tok, list(ids), c, t) for ids, c, t in zip(tokens, chars, terminal)]
