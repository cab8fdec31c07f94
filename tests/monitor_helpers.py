"""Monitor test helpers: an empty :class:`~streamrl.monitor.source.State` to build snapshots from."""
from __future__ import annotations

import time

from streamrl.monitor.source import State


def empty_state(now: float | None = None) -> State:
    """A State with nothing in it (no heartbeats, no version, no stop)."""
    return State(time=now or time.time(), version=-1, stop=None, heartbeats={}, incarnations={})
