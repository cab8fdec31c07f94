"""A reward plug-in that makes rollout worker 1 a straggler ten times slower than it would be (for
the chaos suite); in every other process it scores 0.0 at once. Used as
``rollout.rewards="task=1.0,tests.chaos.straggler_reward:slow_on_worker_1=0.5"``.

In worker 1 each call sleeps ``SLOWDOWN - 1`` times the wall time the worker spent outside this
plug-in since its previous call (generating, scoring, sending), so the worker runs ``SLOWDOWN``
times slower whatever the machine's speed, as a host that is that much slower would.
"""
from __future__ import annotations

import sys
import time

SLOW_WORKER = 1
SLOWDOWN = 10
MAX_SLEEP_S = 5.0  # after a long wait for admission, do not turn it into a ten-fold longer sleep


def _worker_id() -> int | None:
    """This rollout worker's id, from its command line (``--worker-id N``), or None elsewhere."""
    argv = sys.argv
    return int(argv[argv.index("--worker-id") + 1]) if "--worker-id" in argv else None


_SLOW = _worker_id() == SLOW_WORKER
_last_return: float | None = None  # when the previous call returned (None: none yet)


def slow_on_worker_1(problem, response: str) -> float:
    global _last_return
    if _SLOW:
        now = time.monotonic()
        if _last_return is not None:
            time.sleep(min(MAX_SLEEP_S, (SLOWDOWN - 1) * (now - _last_return)))
        _last_return = time.monotonic()
    return 0.0
