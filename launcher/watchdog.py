"""Stuck detection for the workers a launcher supervises: alive is not the same as working.

Once a second the supervisor hands the watchdog its rollout workers; the watchdog reads their
heartbeats (one MGET) and keeps the last one seen of each, so a worker whose heartbeat key
expired (frozen: SIGSTOP, a deadlock holding the GIL) is still judged by its last phase. A
worker :func:`streamrl.coord.liveness.stall` finds stuck is reported once on the launcher's
output and in Redis (``launch:stuck``, read by ``streamrl-monitor``: which process, which phase,
since when), then SIGKILLed: the supervisor restarts it like any failed worker, and the learner
refunds the prompt groups it held when its heartbeat expires (``deadlines.heartbeat_s``), the
path a dead worker's reservations take.

Silence counts only while the watchdog itself could see: when its checks were held up (Redis
frozen or unreachable blocks every process's writes, and this loop's reads, alike), heartbeat
ages restart from the moment it sees again, so a Redis outage never reads as stuck workers.
"""
from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from typing import Callable

from streamrl.coord.liveness import Stall, stall
from streamrl.launcher.process import ManagedProcess
from streamrl.launcher.runstate import RunState

CHECK_S = 1.0


@dataclass
class Watchdog:
    """Finds stuck rollout workers among ``ManagedProcess``es named ``rollout-<id>``."""

    state: RunState
    stuck_s: float
    """``deadlines.stuck_s``: the longest heartbeat silence of a live worker."""
    batch_s: float
    """``deadlines.batch_s``: the longest stay in one working phase."""
    say: Callable[[str], None] = print
    detected: list[dict] = field(default_factory=list)
    """Every stall acted on: ``{"process", "phase", "since", "why", "detected_at"}``."""
    _last: dict[int, dict] = field(default_factory=dict)
    _next: float = 0.0
    _checked: float | None = None
    """Monotonic time of the last completed check."""
    _seeing_since: float = 0.0
    """Wall time from which silence counts (the end of the last gap in this watchdog's checks)."""

    def check(self, rollers: list[ManagedProcess], now: float | None = None) -> list[tuple[ManagedProcess, str]]:
        """Read the heartbeats (at most every ``CHECK_S``), kill stuck workers; ``(process, why)`` of each."""
        mono = time.monotonic()
        if mono < self._next:
            return []
        self._next = mono + CHECK_S
        now = time.time() if now is None else now
        beats = self.state.coord.workers()
        mono = time.monotonic()
        if self._checked is None or mono - self._checked > 3 * CHECK_S:
            self._seeing_since = now  # blind until now: nobody's silence before this counts
        self._checked = mono
        killed = []
        for p in rollers:
            wid = worker_id(p)
            if wid is None or not p.alive():
                continue
            hb = beats.get(wid)
            if hb is not None and hb.get("pid") == p.pid:
                self._last[wid] = hb
            last = self._last.get(wid)
            if last is None or last.get("pid") != p.pid:
                continue  # this incarnation has not beaten yet (starting)
            found = stall({**last, "time": max(float(last["time"]), self._seeing_since)}, now,
                          self.stuck_s, self.batch_s)
            if found is not None:
                self._act(p, wid, found, now)
                killed.append((p, found.describe(p.name).split(" ", 1)[1]))
        return killed

    def _act(self, p: ManagedProcess, wid: int, found: Stall, now: float) -> None:
        """Report ``found`` (launcher output and Redis), then SIGKILL the worker for a restart."""
        report = {"process": p.name, "pid": p.pid, "phase": found.phase, "since": found.since,
                  "why": found.why, "detected_at": now}
        self.detected.append(report)
        self.say(f"{found.describe(p.name)} since {time.strftime('%H:%M:%S', time.localtime(found.since))}; "
                 f"killing it for a restart (its prompt groups are refunded when its heartbeat expires)")
        self.state.record_stuck(p.name, json.dumps(report))
        self._last.pop(wid, None)
        p.signal(signal.SIGKILL)


def worker_id(p: ManagedProcess) -> int | None:
    """The worker id of a ``rollout-<id>`` process, None for other supervised processes."""
    prefix, _, rest = p.name.partition("-")
    return int(rest) if prefix == "rollout" and rest.isdigit() else None
