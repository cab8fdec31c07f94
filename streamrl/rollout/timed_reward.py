"""Reward plug-ins under a deadline: a call that hangs scores as a failure and is counted.

A plug-in (``rollout.rewards: "my_module:my_reward"``) is user code: it may call a service, a
solver or a sandbox, and hang. An unbounded call would freeze the worker's main loop while its
heartbeat thread keeps beating. Each call runs in a daemon thread and is waited on for at most
``deadlines.reward_s``; past it the sample scores 0.0, the timeout is counted
(``rollout/reward_timeouts``) and logged once per plug-in. A Python thread cannot be killed, so
a hung call keeps its thread; while ``MAX_HUNG`` calls are hung at once, further calls start no
thread and score 0.0 at once (counted the same way), so a plug-in that always hangs costs
neither unbounded threads nor ``reward_s`` per sample. (An exception here would not stop the
worker: :class:`~streamrl.rewards.CombinedReward` scores a raising plug-in 0 and counts it.)
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)
MAX_HUNG = 32


class TimedReward:
    """``fn(problem, response) -> float`` bounded by ``timeout_s`` per call (see module doc)."""

    def __init__(self, fn: Callable[[Any, str], float], name: str, timeout_s: float):
        self.fn, self.name, self.timeout_s = fn, name, timeout_s
        self.timeouts = 0
        self._hung: list[threading.Thread] = []
        self.token_credit = getattr(fn, "token_credit", None)

    def __call__(self, problem, response: str) -> float:
        self._hung = [t for t in self._hung if t.is_alive()]
        if len(self._hung) >= MAX_HUNG:
            self.timeouts += 1
            return 0.0
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["value"] = float(self.fn(problem, response))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e

        thread = threading.Thread(target=call, name=f"reward:{self.name}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            return self._timed_out(thread)
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _timed_out(self, thread: threading.Thread) -> float:
        self.timeouts += 1
        if self.timeouts == 1:
            log.warning("reward plug-in %s gave no score within %g s (deadlines.reward_s): scored 0.0, counted "
                        "in rollout/reward_timeouts", self.name, self.timeout_s)
        self._hung.append(thread)
        if len(self._hung) == MAX_HUNG:
            log.warning("reward plug-in %s: %d calls hung at once; it scores 0.0 without being called until "
                        "one returns", self.name, MAX_HUNG)
        return 0.0


def bound_plugins(names: list[str], fns: list, timeout_s: float) -> list:
    """``fns`` with each plug-in (a ``module:function`` name) wrapped in :class:`TimedReward`."""
    return [TimedReward(fn, name, timeout_s) if ":" in name else fn for name, fn in zip(names, fns)]


def reward_timeouts(fns: list) -> int:
    """Calls of the plug-ins in ``fns`` that timed out so far."""
    return sum(fn.timeouts for fn in fns if isinstance(fn, TimedReward))
