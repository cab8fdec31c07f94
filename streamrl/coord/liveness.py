"""Liveness: the phases a worker reports in its heartbeat, stall detection, deadline errors.

A process can stop without dying (SIGSTOP, a deadlock, a hung plug-in, a frozen mount); its
parent then sees a live pid forever. So every rollout worker's heartbeat carries *progress*:
the phase it is in, since when (wall clock), and counters that grow while it works (batches,
trajectories, tokens). :func:`stall` reads one heartbeat and says whether its process is
stuck, with the same rule for the launcher (which restarts it) and the monitor (which shows it):

* the heartbeat is older than ``deadlines.stuck_s``: the whole process is frozen (the
  heartbeat thread beats every second while the process runs at all);
* the phase is a working one (generating, loading weights) and has not changed for
  ``deadlines.batch_s``: the main loop is stuck inside one batch while the heartbeat thread
  still beats.

Waiting phases (admission, sending) are bounded by the worker itself
(``deadlines.admission_s``, ``deadlines.deliver_s``): it raises :class:`DeadlineExceeded`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STARTING = "starting"
WAITING_ADMISSION = "waiting-admission"
LOADING_WEIGHTS = "loading-weights"
GENERATING = "generating"
SENDING = "sending"
# Phases in which the worker computes: staying in one past deadlines.batch_s means it is stuck.
WORKING_PHASES = (LOADING_WEIGHTS, GENERATING)


class DeadlineExceeded(TimeoutError):
    """A wait ran past its deadline; the message names the process, what it waited for, how long,
    and the config knob that sets the deadline."""

    def __init__(self, process: str, waited_for: str, waited_s: float, knob: str):
        self.process, self.waited_for, self.waited_s, self.knob = process, waited_for, waited_s, knob
        super().__init__(f"{process}: waited {waited_s:.0f} s for {waited_for} (deadline {knob})")


@dataclass(frozen=True)
class Stall:
    """A stuck process as :func:`stall` found it (for the launcher's report and the monitor)."""

    phase: str
    since: float
    """Wall-clock time (``time.time()``) the phase began, or of the last heartbeat when frozen."""
    why: str

    def describe(self, process: str) -> str:
        return f"{process} stuck in phase {self.phase}: {self.why}"


def stall(heartbeat: dict[str, Any] | None, now: float, stuck_s: float, batch_s: float) -> Stall | None:
    """Whether the process that wrote ``heartbeat`` is stuck at wall time ``now``; None if not.

    Args:
        heartbeat: the last heartbeat read (``time``, ``phase``, ``phase_since``), or None.
        now: ``time.time()``.
        stuck_s: ``deadlines.stuck_s``, the longest silence of a live process.
        batch_s: ``deadlines.batch_s``, the longest stay in one working phase.
    """
    if not heartbeat or "time" not in heartbeat:
        return None
    phase = str(heartbeat.get("phase", heartbeat.get("state", "unknown")))
    beat = float(heartbeat["time"])
    if now - beat > stuck_s:
        return Stall(phase, beat, f"no heartbeat for {now - beat:.0f} s (deadlines.stuck_s = {stuck_s:g} s)")
    since = float(heartbeat.get("phase_since", beat))
    if phase in WORKING_PHASES and now - since > batch_s:
        return Stall(phase, since, f"no phase change for {now - since:.0f} s (deadlines.batch_s = {batch_s:g} s)")
    return None
