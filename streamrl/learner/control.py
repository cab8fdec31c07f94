"""The learner's side of the control plane: re-assert its Redis state, watch workers come and go.

Why re-assert: the embedded Redis runs without persistence (``--save ""``), so a Redis restart
loses every key. The learner owns the run's truth (config, trajectory endpoint, newest version
and its manifest, admission-control counters, worker incarnation counters) and writes it back
as soon as it sees the state is gone; workers meanwhile retry with bounded backoff
(:class:`streamrl.coord.coordinator.OutageRetry`) and carry on.

Why watch heartbeats: a worker that dies holds admission-control reservations for groups it
will never send. When its heartbeat TTL runs out the learner logs it, counts it, and refunds
one batch worth of groups right away instead of waiting for the starvation timer, if its last
heartbeat said it held a batch, and never more than the reservations held and unaccounted
(a refund of groups nobody reserved admits extra batches for the rest of the run).
"""
from __future__ import annotations

import logging
import time

from streamrl.coord.coordinator import Coordinator

log = logging.getLogger(__name__)
CHECK_S = 1.0
# Heartbeat states of a worker that holds a reservation: decoding its batch, or blocked sending it.
HOLDING_STATES = ("generating", "backpressure")


class ControlPlane:
    """Rank 0's periodic control-plane duties (call :meth:`tick` often; it rate-limits itself).

    Args:
        coord: the learner's coordinator.
        config: the run config as a dict (re-stored after a Redis restart).
        endpoint: the trajectory endpoint workers connect to.
        ledger: the run's :class:`~streamrl.learner.accounting.Ledger` (worker join/leave counts).
        admission: the learner's :class:`~streamrl.learner.intake.Admission`; a worker whose
            heartbeat expires while it held a batch gets it refunded through it.
    """

    def __init__(self, coord: Coordinator, config: dict, endpoint: str, ledger, admission):
        self.coord, self.config, self.endpoint, self.ledger = coord, config, endpoint, ledger
        self.admission = admission
        self.reasserts = 0
        self.version = -1
        self.accounted_groups = 0
        self._alive: set[int] = set()
        self._states: dict[int, str | None] = {}  # last heartbeat state seen per live worker
        self._incarnations: dict[int, int] = {}
        self._next = 0.0
        self._sentinel = coord.keys._k("learner", "sentinel")  # present while Redis holds our state

    def note_incarnation(self, worker: int, incarnation: int) -> None:
        """Remember the newest incarnation seen per worker (ids must never repeat after a Redis loss)."""
        if incarnation > self._incarnations.get(worker, -1):
            self._incarnations[worker] = incarnation

    def assert_state(self, version: int, accounted_groups: int) -> None:
        """Write everything the learner owns (start, resume, or after Redis lost its state)."""
        c = self.coord
        c.r.set(self._sentinel, 1)
        c.put_config(self.config)
        c.set_endpoint("trajectories", self.endpoint)
        c.reassert_version()
        c.set_capacity(accounted_groups)
        for w, inc in self._incarnations.items():
            c.raise_counter(c.keys.incarnation(w), inc)
        for w in self._alive:  # keep departures detectable after a restart wiped the registry
            c.r.sadd(c.keys.workers, w)

    def tick(self, version: int, accounted_groups: int, force: bool = False) -> None:
        """Every call: one GET of the learner's sentinel key (gone = Redis lost its state: re-assert
        at once, before workers over-reserve against empty capacity counters); once per
        ``CHECK_S``: the worker registry."""
        c = self.coord
        if not c.r.exists(self._sentinel):
            self.reasserts += 1
            log.warning("Redis lost the run state (restarted without persistence?); re-asserting config, "
                        "endpoint, version v%s and capacity (%d groups accounted)",
                        c.last_published[0] if c.last_published else "-", accounted_groups)
            self.assert_state(version, accounted_groups)
        self.accounted_groups = accounted_groups
        now = time.monotonic()
        if not force and now < self._next:
            return
        self._next = now + CHECK_S
        self._watch_workers()

    def _watch_workers(self) -> None:
        workers = self.coord.workers()
        for w, hb in workers.items():
            if hb is not None:
                self._states[w] = hb.get("state")
            if hb is not None and w not in self._alive:
                self._alive.add(w)
                if w not in self.ledger.known_workers:
                    self.ledger.known_workers.add(w)
                    self.ledger.workers_joined += 1
                    log.info("worker %d joined (host %s, pid %s)", w, hb.get("host"), hb.get("pid"))
                else:
                    log.info("worker %d is back (incarnation %s)", w, hb.get("incarnation"))
            elif hb is None and w in self._alive:
                self._alive.discard(w)
                self.ledger.workers_left += 1
                held = self._states.pop(w, None) in HOLDING_STATES
                groups = min(self.admission.groups_per_batch,
                             self.admission.unaccounted_groups(self.accounted_groups)) if held else 0
                log.warning("worker %d left: no heartbeat within its TTL; no longer waiting on it, "
                            "refunding %d group reservation(s)", w, groups)
                self.admission.refund(groups, "worker_left")

    def generating(self) -> list[int]:
        """Live workers whose heartbeat says they are filling a reservation (a batch under way)."""
        return [w for w, hb in self.coord.workers().items() if hb is not None and hb.get("state") == "generating"]

    def alive(self) -> set[int]:
        return set(self._alive)

    def is_known(self, worker: int) -> bool:
        """A worker that registered (heartbeat) now or earlier in the run; refreshes once on a miss."""
        if worker in self.ledger.known_workers:
            return True
        self._watch_workers()
        return worker in self.ledger.known_workers
