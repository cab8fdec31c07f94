"""Adaptive staleness: the learner sets the workers' admission bound each step, within the user's bounds.

Admission control lets a worker reserve prompt groups while it is at most ``bound`` versions
ahead of the learner (:meth:`streamrl.coord.coordinator.Coordinator.try_reserve`). A large bound
keeps the workers decoding and the learner fed; a small one keeps the samples close to the policy
being trained. Which bound learns fastest depends on the model, the learning rate and the
lengths, and it moves during a run (early updates move the policy more). With
``learner.staleness = adaptive`` the learner's rank 0 measures, every step:

* **ESS** (``learner/is_ess``): the normalised effective sample size of the per-token importance
  weights ``w = pi_prox / mu``, ``(sum w)^2 / (n sum w^2)`` in (0, 1]. 1 means on-policy; a low
  value means a few tokens carry the update (the correction's variance grows). Default target
  0.9: token weights of a healthy asynchronous run stay within a few percent of 1, and ESS 0.9
  is already a weight spread of ~0.33 (std/mean).
* **Clip fraction** (``learner/clip_frac``): the tokens whose PPO ratio left the clip range; when
  it grows the update throws gradient away. Default ceiling 0.2. With one optimizer step per batch
  (``learner.minibatches = 1``) the ratio to ``pi_prox`` is 1 and the clip fraction 0, except for
  ``ppo_coupled`` (ratio to the behaviour policy): the ESS and the KL carry the signal then.
* **Behaviour KL** (``learner/kl_behaviour``): ``KL(mu || pi_prox)`` (k3 estimator over the
  sampled tokens), the policy drift the samples lag by. Default ceiling 0.05 nats per token,
  the size of one PPO trust region.
* **Idle share** (``learner/idle_frac``): the share of the step the learner waited for data. It is
  the only signal that says a looser bound would buy anything. Default target 0.1.

The rule: when any off-policy signal is over its target, tighten by one; when the learner starves
and the off-policy signals are healthy with a margin (``MARGIN`` of the way to their limits), loosen
by one; otherwise hold. The signals are smoothed by an exponential moving average
(``learner.staleness_ema``), and the bound moves at most once per ``learner.staleness_interval``
steps, so one noisy step never moves it and it does not oscillate around a threshold: a change must
survive the dead band between "unhealthy" and "healthy with a margin" and the wait.

It starts in the middle of ``[learner.staleness_min, learner.max_staleness]`` so either end is at
most half the range of changes away. ``learner.max_staleness`` stays the ceiling everywhere: the
intake drops only samples older than it, so a sample admitted under any bound the controller ever
set is trained, never wasted.

Pure python (no torch, no Redis): :class:`StalenessController` maps signals to a bound;
the learner publishes the bound through the Coordinator.
"""
from __future__ import annotations

from dataclasses import dataclass

# How far inside its limits a signal must be to count as healthy (a fraction of the distance from
# the ideal value to the limit): the dead band between tightening and loosening.
MARGIN = 0.25


@dataclass(frozen=True)
class StalenessSignals:
    """One learner step's measurements: ``ess`` in (0, 1], ``clip_frac`` in [0, 1],
    ``kl_behaviour`` >= 0 (nats per token), ``idle_frac`` in [0, 1]."""

    ess: float
    clip_frac: float
    kl_behaviour: float
    idle_frac: float

    @classmethod
    def from_metrics(cls, metrics: dict[str, float]) -> "StalenessSignals":
        """The signals in a learner step's metrics (the on-policy value where one is absent)."""
        return cls(ess=metrics.get("learner/is_ess", 1.0), clip_frac=metrics.get("learner/clip_frac", 0.0),
                   kl_behaviour=metrics.get("learner/kl_behaviour", 0.0),
                   idle_frac=metrics.get("learner/idle_frac", 0.0))


@dataclass(frozen=True)
class StalenessTargets:
    """The controller's limits: ``ess_min``, ``clip_frac_max``, ``kl_max``, ``idle_frac_max``."""

    ess_min: float = 0.9
    clip_frac_max: float = 0.2
    kl_max: float = 0.05
    idle_frac_max: float = 0.1


class StalenessController:
    """Maps each step's :class:`StalenessSignals` to an admission bound in ``[floor, ceiling]``.

    Args:
        floor, ceiling: the user's bounds (``learner.staleness_min``, ``learner.max_staleness``).
        targets: the signals' limits.
        ema: weight of the past in the moving average of each signal, in [0, 1).
        interval: at least this many steps between two changes of the bound (and before the first).
    """

    def __init__(self, floor: int, ceiling: int, targets: StalenessTargets = StalenessTargets(),
                 ema: float = 0.8, interval: int = 5):
        if not 0 <= floor <= ceiling:
            raise ValueError(f"staleness bounds [{floor}, {ceiling}]: need 0 <= floor <= ceiling")
        if not 0 <= ema < 1:
            raise ValueError(f"staleness ema = {ema!r}: must be in [0, 1)")
        if interval < 1:
            raise ValueError(f"staleness interval = {interval!r}: must be >= 1")
        self.floor, self.ceiling, self.targets, self.ema, self.interval = floor, ceiling, targets, ema, interval
        self.bound = (floor + ceiling) // 2
        self.smoothed: StalenessSignals | None = None
        self.steps_since_change = 0

    def update(self, signals: StalenessSignals) -> int:
        """Fold one step's signals in; returns the bound for the next step."""
        self.smoothed = signals if self.smoothed is None else StalenessSignals(
            *(self.ema * old + (1 - self.ema) * new for old, new in zip(_values(self.smoothed), _values(signals))))
        self.steps_since_change += 1
        if self.steps_since_change < self.interval:
            return self.bound
        move = self.direction(self.smoothed)
        new = min(self.ceiling, max(self.floor, self.bound + move))
        if new != self.bound:
            self.bound, self.steps_since_change = new, 0
        return self.bound

    def direction(self, s: StalenessSignals) -> int:
        """-1 (too off-policy), +1 (starving while healthy with a margin) or 0."""
        t = self.targets
        if s.ess < t.ess_min or s.clip_frac > t.clip_frac_max or s.kl_behaviour > t.kl_max:
            return -1
        healthy = (s.ess >= t.ess_min + MARGIN * (1 - t.ess_min) and s.clip_frac <= (1 - MARGIN) * t.clip_frac_max
                   and s.kl_behaviour <= (1 - MARGIN) * t.kl_max)
        return 1 if healthy and s.idle_frac > t.idle_frac_max else 0


def _values(s: StalenessSignals) -> tuple[float, float, float, float]:
    return s.ess, s.clip_frac, s.kl_behaviour, s.idle_frac


class StalenessGovernor:
    """Rank 0's side of the admission bound: feeds the controller after each step and publishes
    the bound (``learner.staleness = adaptive``); with ``fixed`` the bound is the ceiling and
    nothing is published (the workers use their own ``learner.max_staleness``).

    ``coord``: anything with ``set_staleness_bound(int)`` (the run's Coordinator).
    """

    def __init__(self, lc, coord):
        self.coord, self.ceiling = coord, lc.max_staleness
        self.controller = None
        if lc.staleness == "adaptive":
            targets = StalenessTargets(lc.staleness_ess_min, lc.staleness_clip_frac_max, lc.staleness_kl_max,
                                       lc.staleness_idle_frac_max)
            self.controller = StalenessController(lc.staleness_min, lc.max_staleness, targets, lc.staleness_ema,
                                                  lc.staleness_interval)
            coord.set_staleness_bound(self.controller.bound)

    @property
    def bound(self) -> int:
        """The bound the workers are admitted under now."""
        return self.ceiling if self.controller is None else self.controller.bound

    def step(self, metrics: dict[str, float]) -> dict[str, float]:
        """After a learner step: the bound the step ran under (``learner/staleness_bound``),
        then, adaptive, the next bound published (written every step: Redis may have restarted).
        A step skipped for want of signal (``learner/skipped_no_signal``) ran no policy loss, so it
        measured no off-policy signal: it leaves the controller as it is."""
        out = {"learner/staleness_bound": float(self.bound)}
        if self.controller is not None:
            if not metrics.get("learner/skipped_no_signal"):
                self.controller.update(StalenessSignals.from_metrics(metrics))
            self.coord.set_staleness_bound(self.controller.bound)
        return out
