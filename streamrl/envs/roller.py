"""One batch of multi-turn episodes for the rollout worker: problems x group size -> episodes ->
a packed trajectory batch and the monitor's figures.

The tool-task implementation of :class:`streamrl.rollout.base.Roller` (next to the single-turn
:class:`streamrl.rollout.batch.BatchRoller`), Redis-free. Each sample
gets its own environment (environments keep per-episode state); all samples of a batch share
the engine calls turn by turn and one :class:`~streamrl.envs.tools.ToolRunner`.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

from streamrl.envs.base import Environment
from streamrl.envs.episode import EpisodeLimits, episode_metrics, episodes_to_trajectories, run_episodes
from streamrl.envs.render import Renderer
from streamrl.envs.tools import ToolRunner


class EpisodeBatchRoller:
    """``prompts_per_batch`` problems x ``group_size`` episodes per call.

    make_env: () -> a fresh environment (called once per sample per batch).
    next_id: () -> a unique 63-bit id (the worker's :func:`streamrl.trajectory.make_id` counter).
    runner: the tool runner the environments share, for its counters (optional; closed by :meth:`close`).
    before_turn: () -> version, called before every turn (the worker loads newer weights there:
        in-flight updates between turns); None stamps every turn with the batch's version.
    lanes: parts of the batch whose turns interleave so tools overlap generation (``env.lanes``).
    """

    def __init__(self, engine, tok, problems: Iterator[Any], make_env: Callable[[], Environment],
                 renderer: Renderer, limits: EpisodeLimits, next_id: Callable[[], int], *,
                 prompts_per_batch: int, group_size: int, temperature: float = 1.0, worker_id: int = 0,
                 runner: ToolRunner | None = None, before_turn: Callable[[], int] | None = None, lanes: int = 1):
        if prompts_per_batch < 1 or group_size < 1:
            raise ValueError(f"prompts_per_batch = {prompts_per_batch}, group_size = {group_size}: must be >= 1")
        self.engine, self.tok, self.problems, self.make_env = engine, tok, problems, make_env
        self.renderer, self.limits, self.next_id = renderer, limits, next_id
        self.prompts_per_batch, self.group_size, self.temperature = prompts_per_batch, group_size, temperature
        self.worker_id, self.runner, self.before_turn, self.lanes = worker_id, runner, before_turn, lanes
        self.last_metrics: dict[str, float] = {}
        self._pool = ThreadPoolExecutor(max_workers=min(16, prompts_per_batch * group_size),
                                        thread_name_prefix="streamrl-env")

    def rollout_batch(self, version: int, between_steps=None):
        """Play one batch; returns the packed trajectories (one per episode) and keeps the
        batch's monitor figures in ``last_metrics``.

        ``between_steps``: in-flight updates inside a turn (engines hf_fast, vllm), as in
        :class:`~streamrl.rollout.batch.BatchRoller`; ``version`` stamps the turns when there is
        no ``before_turn`` hook.
        """
        started = time.perf_counter()
        problems = [next(self.problems) for _ in range(self.prompts_per_batch)]
        flat = [p for p in problems for _ in range(self.group_size)]
        kwargs = {"between_steps": between_steps} if between_steps is not None else {}
        episodes = run_episodes(self.engine, [self.make_env() for _ in flat], flat, self.renderer,
                                self._decode, self.tok.eos_token_id, self.limits, self.temperature,
                                before_turn=self.before_turn or (lambda: version), pool=self._pool,
                                lanes=self.lanes, **kwargs)
        group_ids, traj_ids = [], []
        for _ in problems:
            gid = self.next_id()
            group_ids += [gid] * self.group_size
            traj_ids += [self.next_id() for _ in range(self.group_size)]
        td = episodes_to_trajectories(episodes, group_ids, traj_ids, self.worker_id)
        metrics = episode_metrics(episodes)
        metrics["env/reward_mean"] = sum(ep.reward for ep in episodes) / len(episodes)
        metrics["env/batch_s"] = time.perf_counter() - started
        if self.runner is not None:
            metrics.update(self.runner.counters())
        self.last_metrics = metrics
        return td

    def _decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=False)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.runner is not None:
            self.runner.close()
