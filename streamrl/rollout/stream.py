"""Continuous single-turn grouped sampling: every decode slot busy, every group sent once it is done.

:class:`~streamrl.rollout.batch.BatchRoller` makes one ``generate`` call per batch, which lasts as
long as the batch's longest sample: with long-tailed lengths (median ~150 tokens, a few cut at
1,024) most slots sit idle for most of the call. :class:`StreamingRoller` runs one open-ended
``engine.generate_stream`` (hf_fast) instead (PipelineRL-style):

* a slot that frees takes a new sample at the next sync; slots are filled group by group (a
  group's ``group_size`` samples are admitted together, after ``reserve(k)`` granted the group);
* a finished sample goes to its group; a group whose last sample is in is scored at once
  (:class:`~streamrl.rollout.scoring.GroupScorer`, the same rewards, truncation rule, ids and
  packing as the batch path);
* scored groups go out ``rollout.prompts_per_batch`` at a time (messages as large as the batch
  path's), and whatever is left when the stream drains goes out last. A group is never split.

With ``between_steps`` (in-flight updates) every token carries the version that sampled it, so
one long stream can follow the learner's versions. Redis-free, like BatchRoller: the rollout
worker supplies ``reserve`` (admission), ``send`` (transport) and ``stop``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from tensordict import TensorDict

from streamrl.config import Config
from streamrl.engines.base import BetweenSteps
from streamrl.rewards import CombinedReward
from streamrl.rollout.scoring import GroupScorer, ScoredSamples


@dataclass
class _Group:
    """One problem's samples while they decode (``left``: samples not yet finished)."""

    problem: Any
    prompt: list[int]
    started_at: float
    left: int
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    routed: list = field(default_factory=list)


class StreamingRoller:
    """Groups through one open-ended ``generate_stream`` call per :meth:`run`.

    problems: an endless iterator of task problems (this worker's shard); reward, next_id,
    truncated_scores_zero: as for :class:`~streamrl.rollout.batch.BatchRoller`.
    ``last_metrics``: figures of the latest message sent (``rollout/truncated``, per-task rewards,
    ``rollout/slot_occupancy``: the share of decode slot-steps that drew a kept token since the
    previous message).
    """

    def __init__(self, cfg: Config, engine, tok, problems: Iterator[Any], reward: CombinedReward,
                 worker_id: int = 0, next_id: Callable[[], int] | None = None, truncated_scores_zero: bool = False):
        self.cfg, self.engine, self.tok, self.problems = cfg, engine, tok, problems
        self.scorer = GroupScorer(cfg, tok, reward, worker_id, next_id, truncated_scores_zero)
        self.reward = reward
        self.last_metrics: dict[str, float] = {}
        self._groups: dict[int, tuple[_Group, int]] = {}  # request index -> (its group, sample index)
        self._ready: list[ScoredSamples] = []               # scored groups not yet sent
        self._requests = 0                                  # prompts handed to the engine
        self.in_flight = 0                                  # groups admitted, not yet scored
        self.groups_sent = 0
        self._version = 0                                   # stamped on tokens when no per-token versions
        self._send: Callable[[TensorDict], None] | None = None
        self._tokens = 0                                    # tokens harvested in this run
        self._mark = (0, 0)                                 # (engine decode steps, tokens) at the last send

    def run(self, reserve: Callable[[int], int], send: Callable[[TensorDict], None], version: int,
            between_steps: BetweenSteps | None = None, stop: Callable[[], bool] = lambda: False,
            max_tokens: Callable[[int], int] | None = None) -> int:
        """Stream until ``stop()`` says so, then drain; returns the groups sent.

        reserve: ``reserve(k) -> granted`` (0..k): admission for up to ``k`` more groups, asked
        whenever ``k >= 1`` whole groups of slots are free. Granted groups start at once.
        send: takes each packed message (:func:`streamrl.trajectory.pack_trajectories` layout).
        version: the policy version loaded now (every token's, unless ``between_steps`` loads
        a newer one). max_tokens: an optional smaller cap per request (benchmarks emulate
        long-tailed lengths with it).
        """
        rc = self.cfg.rollout
        self._version, self._send = version, send
        self._mark = (self._steps(), 0)
        self._tokens = 0

        def refill(free: int) -> list[list[int]] | None:
            k = free // rc.group_size
            if k < 1:  # not a whole group's slots yet (the drain, too, waits for them: all free up)
                return []
            return None if stop() else self._admit(reserve, k)

        self.engine.generate_stream(refill, self._finished, rc.max_new_tokens, rc.temperature,
                                    between_steps=between_steps, version=version, max_tokens=max_tokens)
        assert not self._groups and self.in_flight == 0, "the stream drained with samples unfinished"
        if self._ready:
            self._flush()
        return self.groups_sent

    def _admit(self, reserve: Callable[[int], int], k: int) -> list[list[int]]:
        """The prompts of the groups ``reserve`` grants (at most ``k``), sample by sample."""
        granted = reserve(k)
        if not 0 <= granted <= k:
            raise ValueError(f"reserve({k}) granted {granted} groups: must be in [0, {k}]")
        g, prompts, now = self.cfg.rollout.group_size, [], time.time()
        for _ in range(granted):
            problem = next(self.problems)
            group = _Group(problem, self.scorer.encode.problem(problem), now, g)
            for m in range(g):
                self._groups[self._requests] = (group, m)
                self._requests += 1
                prompts.append(group.prompt)
        self.in_flight += granted
        return prompts

    def _finished(self, j: int, tokens: list[int], logprobs: list[float], versions: list[int] | None,
                  routed: torch.Tensor | None) -> None:
        """Sample ``j`` is done; score its group when it was the group's last."""
        group, _ = self._groups.pop(j)
        group.tokens.append(tokens)
        group.logprobs.append(logprobs)
        group.versions.append(versions if versions is not None else [self._version] * len(tokens))
        group.routed.append(routed)
        group.left -= 1
        self._tokens += len(tokens)
        if group.left:
            return
        self.in_flight -= 1
        g = len(group.tokens)
        routed_all = None if any(r is None for r in group.routed) else group.routed
        self._ready.append(self.scorer.score([group.problem] * g, [group.prompt] * g, group.tokens,
                                             group.logprobs, group.versions, [group.started_at] * g, routed_all))
        if len(self._ready) >= self.cfg.rollout.prompts_per_batch:
            self._flush()

    def _flush(self) -> None:
        """Pack the scored groups into one message and send it."""
        samples = ScoredSamples.concat(self._ready)
        groups, self._ready = len(self._ready), []
        steps = self._steps() - self._mark[0]
        live = self._tokens - self._mark[1]
        self._mark = (self._steps(), self._tokens)
        self.last_metrics = {**self.scorer.metrics(samples),  # a sample's first token comes from its prefill
                             "rollout/slot_occupancy": min(1.0, live / max(steps * self.engine.batch, 1))}
        # called from inside the engine's inference-mode loop: the message and whatever the sender
        # does with it (role annotations, metrics) get ordinary tensors, as on the batch path
        with torch.inference_mode(False):
            self._send(self.scorer.pack(samples))
        self.groups_sent += groups

    def _steps(self) -> int:
        return self.engine.decode_steps

    def close(self) -> None:
        """Nothing of its own to release (the engine and the reward are shared)."""
