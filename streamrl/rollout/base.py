"""What a rollout worker needs from any roller: one scored, packed batch per call.

Two implementations: :class:`streamrl.rollout.batch.BatchRoller` (single turn, ``group_size``
samples per problem) and :class:`streamrl.envs.roller.EpisodeBatchRoller` (multi-turn episodes
with tools). :func:`streamrl.rollout.factory.build_roller` picks one from the config.
With ``rollout.streaming`` it gives a :class:`streamrl.rollout.stream.StreamingRoller` instead, which
is not a Roller: it runs one open-ended stream (``run(reserve, send, ...)``) rather than batches.
"""
from __future__ import annotations

from typing import Protocol

from tensordict import TensorDict

from streamrl.engines.base import BetweenSteps


class Roller(Protocol):
    """Produces trajectory batches with the weights of one policy version.

    ``last_metrics``: monitor figures of the latest batch (``rollout/truncated``, ``env/...`` for episodes), ``{}`` when
    the roller has none.
    """

    last_metrics: dict[str, float]

    def rollout_batch(self, version: int, between_steps: BetweenSteps | None = None) -> TensorDict:
        """Generate, score and pack one batch (the :func:`streamrl.trajectory.pack_trajectories`
        layout: ``B`` trajectories, responses concatenated).

        ``version``: the policy version loaded now, stamped on every token unless
        ``between_steps`` (the engine's hook between decode steps: in-flight weight updates,
        core borrowing; see :data:`streamrl.engines.base.BetweenSteps`) loads a newer one, in
        which case each token carries the version that sampled it.
        """

    def close(self) -> None:
        """Release what the roller holds (environment and tool pools); the engine is the caller's."""
