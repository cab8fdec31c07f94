"""Core borrowing: a CPU rollout worker decodes with the learner's cores while the learner waits for data.

Why: on a small CPU host (2 cores, 1 learner + 1 worker, one intra-op thread each by
:func:`streamrl.placement.assign_threads`) a fast learner step leaves the worker as the
bottleneck, and the learner then blocks for its next batch with its core idle. The reverse of
:mod:`streamrl.learner.core_lending` (the learner borrowing a waiting worker's core).

How:

* The placement tells each CPU worker how many of a colocated CPU learner's threads are its
  share (``STREAMRL_BORROWABLE_THREADS``: the learner's threads split over the host's CPU
  workers); no more is ever borrowed.
* Rank 0 of the learner publishes its phase in Redis (:class:`~streamrl.learner.core_lending.LearnerPhase`):
  ``waiting`` only while it blocks for its next batch. A daemon thread here reads it every
  ``poll_s`` (one GET) and keeps the offer: the share while the learner on this host waits, else 0.
  The decode thread never touches Redis.
* Only cores that are really free are borrowed: the poller also measures the host's other
  processes' load from ``/proc/stat`` (:class:`~streamrl.learner.core_lending.HostLoad`, the
  learner's own check) and a borrowed thread that another tenant would deschedule is not taken.
* The decode thread calls :meth:`CoreBorrower.apply` before the prefill and before every decode
  step (the engine's ``between_steps`` hook, :mod:`streamrl.engines.decode_loop`): on CPU the
  step is eager, so a thread count changed between two steps applies to the next one, and
  ``torch.set_num_threads`` must run on the decode thread itself (OpenMP keeps it per calling
  thread). Give-back latency: one poll plus one decode step (~0.5 s for SmolLM2-135M at batch 64).
* Never both sides at once: the worker borrows only while generating and only while the learner
  says ``waiting`` (no compute); the learner borrows only while the worker's heartbeat says it
  waits (no compute). Each side's switch lags the other's state change by at most one poll
  plus one step (decode step or decoder layer).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time

import torch

from streamrl.learner.core_lending import POLL_S, WAITING, HostLoad, PollingThread, phase_key

log = logging.getLogger(__name__)
BORROWABLE_ENV = "STREAMRL_BORROWABLE_THREADS"


def borrowable_threads() -> int:
    """This worker's share of the colocated CPU learner's threads (0: nothing may be borrowed)."""
    return int(os.environ.get(BORROWABLE_ENV, "0") or 0)


class CoreBorrower(PollingThread):
    """Lends a CPU rollout worker the colocated learner's threads while the learner waits.

    Args:
        coord: a :class:`~streamrl.coord.coordinator.Coordinator` (its Redis client is used from
            the polling thread only).
        base_threads: the worker's own threads (``torch.get_num_threads()`` at start).
        borrowable: most threads this worker may borrow (its placement share).
        host: the host name the learner reports with its phase (default: this host).
        poll_s: seconds between phase polls.
        host_load: the host's other processes' load; only cores they leave free are borrowed.
            None: the learner's phase alone decides (no ``/proc/stat``).
    """

    def __init__(self, coord, base_threads: int, borrowable: int, host: str | None = None, poll_s: float = POLL_S,
                 host_load: HostLoad | None = None):
        assert base_threads >= 1 and borrowable >= 0, (base_threads, borrowable)
        self.coord, self.base, self.borrowable, self.poll_s = coord, base_threads, borrowable, poll_s
        self.key = phase_key(coord)
        self.host = host or socket.gethostname()
        self.host_load = host_load
        self.others_busy = 0.0
        """Cores the host's other processes (the learner included) kept busy over the last window."""
        self.offer = 0
        """Threads the waiting learner leaves now (written by the poller, read by apply)."""
        self.threads = base_threads
        """Threads the decode thread runs with now."""
        self.switches = 0
        self._t_apply: float | None = None  # None: outside a batch (no decode time accrues)
        self._gen_s = self._borrowed_s = self._borrowed_thread_s = 0.0

    # -- the polling thread ------------------------------------------------------------------
    thread_name = "core-borrower"

    def poll(self) -> int:
        """Read the learner's phase once and update :attr:`offer`; returns it."""
        try:
            raw = self.coord.r.get(self.key)
        except Exception as e:  # noqa: BLE001 - Redis down: borrow nothing until it is back
            log.debug("core borrowing: phase poll failed: %s", e)
            raw = None
        state = json.loads(raw) if raw else {}
        waiting = state.get("phase") == WAITING and state.get("host") == self.host
        offer = self.borrowable if waiting else 0
        if self.host_load is not None:
            free, self.others_busy = self.host_load.free_threads(self.base, self.others_busy)
            offer = max(0, min(offer, free))
        self.offer = offer
        return offer

    # -- the decode thread -------------------------------------------------------------------
    def apply(self) -> int:
        """Run with ``base + offer`` threads from now on (decode thread only); returns the count."""
        now = time.monotonic()
        if self._t_apply is None:
            self._t_apply = now
        want = self.base + self.offer
        if want != self.threads:
            self._account(now)
            torch.set_num_threads(want)
            self.threads = want
            self.switches += 1
        return self.threads

    def end_batch(self) -> None:
        """A batch's decoding is over: back to the worker's own threads (decode thread only)."""
        if self._t_apply is not None:
            self._account(time.monotonic())
            self._t_apply = None
        if self.threads != self.base:
            torch.set_num_threads(self.base)
            self.threads = self.base
            self.switches += 1

    def _account(self, now: float) -> None:
        extra, dt = self.threads - self.base, now - self._t_apply
        self._gen_s += dt
        self._borrowed_s += dt if extra > 0 else 0.0
        self._borrowed_thread_s += extra * dt
        self._t_apply = now

    def metrics(self) -> dict[str, float]:
        """Since the last call: share of generation time with borrowed threads, mean borrowed
        threads over that time, thread switches, and the others' busy cores (last window)."""
        gen = max(self._gen_s, 1e-9)
        out = {"rollout/borrowed_frac": self._borrowed_s / gen, "rollout/borrowed_threads_mean":
               self._borrowed_thread_s / gen, "rollout/borrow_switches": self.switches,
               "rollout/others_busy_cores": self.others_busy}
        self._gen_s = self._borrowed_s = self._borrowed_thread_s = 0.0
        self.switches = 0
        return out


def make_core_borrower(cfg, coord) -> CoreBorrower | None:
    """The worker's borrower when ``placement.lend_idle_cores`` is on, the worker decodes on CPU with
    an engine that calls back between decode steps (hf_fast), single-turn, and the placement gave
    it a share of a colocated CPU learner's threads; None otherwise. Started."""
    rc = cfg.rollout
    share = borrowable_threads()
    if (not cfg.placement.lend_idle_cores or share < 1 or not rc.device.startswith("cpu")
            or rc.engine != "hf_fast" or cfg.env.name != "none"):
        return None
    borrower = CoreBorrower(coord, torch.get_num_threads(), share, host_load=HostLoad.open()).start()
    log.info("core borrowing on: %d thread(s) of its own, up to %d borrowed while the learner waits",
             borrower.base, share)
    return borrower
