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
from streamrl.rewards import CombinedReward
from streamrl.rollout.scoring import GroupScorer


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
        self.scorer = GroupScorer(cfg, tok, reward, worker_id, next_id, truncated_scores_zero)
        self.encode = self.scorer.encode
        self.reward = reward
        self.last_metrics: dict[str, float] = {}

    def rollout_batch(self, version: int, between_steps: BetweenSteps | None = None) -> TensorDict:
        """Generate, score and pack one batch; tokens are stamped with ``version``, or, with
        ``between_steps`` (in-flight updates), with the version the engine reports per token."""
        rc = self.cfg.rollout
        started = time.time()
        problems = [next(self.problems) for _ in range(rc.prompts_per_batch)]
        flat_prompts = self.scorer.prompts(problems)
        gen = self._generate(flat_prompts, version, between_steps)
        flat_problems = [p for p in problems for _ in range(rc.group_size)]
        versions = gen.versions if gen.versions is not None else [[version] * len(t) for t in gen.tokens]
        samples = self.scorer.score(flat_problems, flat_prompts, gen.tokens, gen.logprobs, versions,
                                    [started] * len(flat_prompts), gen.routed_experts)
        self.last_metrics = self.scorer.metrics(samples)
        return self.scorer.pack(samples)

    def _generate(self, prompts: list[list[int]], version: int, between_steps: BetweenSteps | None) -> Generation:
        rc = self.cfg.rollout
        if between_steps is None and rc.inflight_updates:
            between_steps = _no_update  # same engine path as the worker's (the benchmark measures it)
        if between_steps is None:  # the plain call: every engine, no per-step hook
            return self.engine.generate(prompts, rc.max_new_tokens, rc.temperature)
        return self.engine.generate(prompts, rc.max_new_tokens, rc.temperature,
                                    between_steps=between_steps, version=version)

    def close(self) -> None:
        """Nothing of its own to release (the engine and the reward are shared)."""
