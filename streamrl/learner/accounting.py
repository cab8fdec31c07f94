"""Trajectory accounting: every trajectory a worker produced is trained, pending, lost for a reason, or rejected.

The ledger is rank 0's book of the run, saved in every checkpoint and restored on resume, so
its totals cover the whole run across learner restarts (steps rolled back by a crash are not
counted: their trajectories are replayed from the journal and counted when trained again).

Invariants checked at the end of a run (``balanced``)::

    accepted == trained + pending + sum(lost)                  (lost: stale, group_overflow, ...)
    produced == trained + pending + sum(lost) + rejected       (``lost["in_flight"]`` = the gap)

plus the promise ``duplicated == 0``: no trajectory id trained twice in the surviving lineage.

``produced`` comes from the workers: every message carries its sender's cumulative count of
trajectories handed to the transport (:class:`streamrl.transport.sender.TrajectorySender`),
and the ledger keeps the newest count per sender session. A message lost between a worker and
the learner therefore shows up as ``lost["in_flight"]`` as soon as a later message of the same
sender arrives. With sender retention (:mod:`streamrl.transport.retention`) that number is 0
across learner crashes: what the dead learner lost is sent again. A tail no message ever
reported (the batch a SIGKILLed worker was generating) is invisible by construction;
admission control refunds its reservation instead.
"""
from __future__ import annotations

import logging
from collections import Counter

import torch
from tensordict import TensorDict

log = logging.getLogger(__name__)


class Ledger:
    """Counters of one run (rank 0). JSON state via :meth:`state_dict`; trained ids as a tensor."""

    def __init__(self):
        self.accepted = 0
        self.trained = 0
        self.duplicated = 0
        self.replayed = 0
        self.lost: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()  # messages rejected (transport + learner gates), by reason
        self.gated: Counter[str] = Counter()  # this incarnation's learner-gate rejections (folded into rejected)
        self.duplicates_dropped = 0
        self.rejected_trajectories = 0  # trajectories of registered workers' rejected messages
        self.known_workers: set[int] = set()
        self.workers_joined = 0
        self.workers_left = 0
        self.trained_ids: set[int] = set()
        self.produced: dict[tuple[int, int], int] = {}  # (worker, sender session) -> newest cumulative count

    # -- events ------------------------------------------------------------------------------
    def on_accept(self, td: TensorDict) -> None:
        """A batch passed every gate and enters the buffer."""
        self.accepted += int(td["traj_id"].numel())

    def on_produced(self, counts: dict[tuple[int, int], int]) -> None:
        """Newest cumulative ``produced`` counts per (worker, sender session) from the transport."""
        for key, n in counts.items():
            if key[0] in self.known_workers and n > self.produced.get(key, 0):
                self.produced[key] = n

    def on_train(self, batch: TensorDict) -> None:
        ids = batch["traj_id"].tolist()
        twice = sum(1 for t in ids if t in self.trained_ids)
        if twice:
            log.error("%d trajectories trained a second time (ids %s...)", twice, ids[:3])
        self.duplicated += twice
        self.trained_ids.update(ids)
        self.trained += len(ids)

    # -- report ------------------------------------------------------------------------------
    def summary(self, pending: int, stale: int, overflow: int) -> dict:
        lost = Counter(self.lost)
        if stale:
            lost["stale"] = stale
        if overflow:
            lost["group_overflow"] = overflow
        accounted = self.trained + pending + sum(lost.values())
        produced = sum(self.produced.values())
        in_flight = produced - accounted - self.rejected_trajectories
        if in_flight > 0:
            lost["in_flight"] = in_flight  # produced, never reached us: not part of the accepted balance
        return {
            "produced": produced,
            "accepted": self.accepted,
            "trained": self.trained,
            "pending_at_end": pending,
            "lost": dict(sorted(lost.items())),
            "lost_total": sum(lost.values()),
            "duplicated": self.duplicated,
            "duplicates_dropped": self.duplicates_dropped,
            "replayed_from_journal": self.replayed,
            "rejected_messages": dict(sorted(self.rejected.items())),
            "rejected_trajectories": self.rejected_trajectories,
            "workers_seen": len(self.known_workers),
            "workers_joined": self.workers_joined,
            "workers_left": self.workers_left,
            # produced < accounted would mean a count went wrong (or a sender without counts)
            "balanced": accounted == self.accepted and in_flight >= 0,
        }

    # -- checkpoint ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"accepted": self.accepted, "trained": self.trained, "duplicated": self.duplicated,
                "replayed": self.replayed, "lost": dict(self.lost), "rejected": dict(self.rejected),
                "duplicates_dropped": self.duplicates_dropped, "known_workers": sorted(self.known_workers),
                "workers_joined": self.workers_joined, "workers_left": self.workers_left,
                "rejected_trajectories": self.rejected_trajectories,
                "produced": [[w, s, n] for (w, s), n in self.produced.items()]}

    def load_state_dict(self, state: dict, trained_ids: list[int]) -> None:
        self.accepted = int(state.get("accepted", 0))
        self.trained = int(state.get("trained", 0))
        self.duplicated = int(state.get("duplicated", 0))
        self.replayed = int(state.get("replayed", 0))
        self.lost = Counter({k: int(v) for k, v in state.get("lost", {}).items()})
        self.rejected = Counter({k: int(v) for k, v in state.get("rejected", {}).items()})
        self.duplicates_dropped = int(state.get("duplicates_dropped", 0))
        self.known_workers = set(map(int, state.get("known_workers", [])))
        self.workers_joined = int(state.get("workers_joined", 0))
        self.workers_left = int(state.get("workers_left", 0))
        self.rejected_trajectories = int(state.get("rejected_trajectories", 0))
        self.produced = {(int(w), int(s)): int(n) for w, s, n in state.get("produced", [])}
        self.trained_ids = set(trained_ids)

    def trained_ids_tensor(self) -> torch.Tensor:
        return torch.tensor(sorted(self.trained_ids), dtype=torch.int64)
