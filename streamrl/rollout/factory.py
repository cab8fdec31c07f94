"""The roller a run's config asks for, built once per worker.

``env.name = 'none'``: single-turn grouped sampling (:class:`~streamrl.rollout.batch.BatchRoller`,
or with ``rollout.streaming`` the continuous :class:`~streamrl.rollout.stream.StreamingRoller`);
anything else: multi-turn episodes with tools (:func:`streamrl.envs.factory.build_episode_roller`).
Both score with the same reward object (:func:`run_reward`).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from streamrl.config import Config
from streamrl.rewards import CombinedReward, build_reward
from streamrl.rollout.base import Roller
from streamrl.rollout.batch import BatchRoller
from streamrl.rollout.stream import StreamingRoller
from streamrl.rollout.timed_reward import bound_plugins
from streamrl.tasks import build_task
from streamrl.tasks.truncation import zeroes_truncated


def run_reward(cfg: Config, reward_endpoint: Callable[[], str | None] | None = None) -> CombinedReward:
    """The run's reward (``rollout.rewards`` over the configured task); ``reward_endpoint``: the
    reward-model role's address, re-read after its restarts (:mod:`streamrl.roles`). Plug-ins
    run under ``deadlines.reward_s`` (:mod:`streamrl.rollout.timed_reward`)."""
    rc = cfg.rollout
    reward = build_reward(rc.rewards, build_task(cfg.task), rc.reward_model, rc.reward_model_device,
                          reward_endpoint=reward_endpoint)
    reward.fns = bound_plugins(reward.names, reward.fns, cfg.deadlines.reward_s)
    return reward


def build_roller(cfg: Config, engine, tok, problems: Iterator[Any], *, worker_id: int,
                 next_id: Callable[[], int] | None = None, reward: CombinedReward | None = None,
                 before_turn: Callable[[], int] | None = None, task=None) -> Roller | StreamingRoller:
    """The configured roller over ``engine``.

    problems: this worker's endless problem iterator; next_id: () -> a unique 63-bit id;
    reward: the scoring reward (default :func:`run_reward` without a reward-model role);
    before_turn: multi-turn only, () -> the version the next turn samples with (in-flight updates
    between turns); None stamps each turn with the batch's version.
    task: the run's task (default: built from ``cfg.task``); its rule for truncated responses applies.
    ``rollout.streaming`` gives a :class:`StreamingRoller` (driven by ``run``, not ``rollout_batch``).
    """
    reward = reward if reward is not None else run_reward(cfg)
    if cfg.env.name == "none":
        cls = StreamingRoller if cfg.rollout.streaming else BatchRoller
        return cls(cfg, engine, tok, problems, reward, worker_id, next_id,
                   truncated_scores_zero=zeroes_truncated(task if task is not None else build_task(cfg.task)))
    if cfg.rollout.streaming:
        raise ValueError(f"rollout.streaming = true with env.name = {cfg.env.name!r}: streaming is single-turn "
                         "(multi-turn episodes take turns between generate calls)")
    # torchrl (behind the environments) is imported only by runs that play episodes
    from streamrl.envs.factory import build_episode_roller  # noqa: PLC0415

    return build_episode_roller(cfg, engine, tok, problems, worker_id, next_id, reward, before_turn)
