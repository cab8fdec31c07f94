"""A reward plug-in that hangs (for the chaos suite): its 1st, 3rd and 5th call in each process
never return, as a plug-in stuck on a service that stopped answering; every other call scores
0.0. Used as ``rollout.rewards="task=1.0,tests.chaos.hanging_reward:sometimes_hangs=0.5"``."""
from __future__ import annotations

import itertools
import threading

HANGING_CALLS = (1, 3, 5)
_calls = itertools.count(1)
_never = threading.Event()


def sometimes_hangs(problem, response: str) -> float:
    if next(_calls) in HANGING_CALLS:
        _never.wait()  # no timeout of its own: only the worker's deadline ends the wait
    return 0.0
