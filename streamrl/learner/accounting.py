"""Trajectory accounting: every trajectory that reaches the learner is trained, pending, or lost for a reason.

The ledger is rank 0's book of the run, saved in every checkpoint and restored on resume, so
its totals cover the whole run across learner restarts (steps rolled back by a crash are not
counted: their trajectories are replayed from the journal and counted when trained again).

Invariant checked at the end of a run (``balanced``)::

    accepted == trained + pending + sum(lost)          (lost: stale, group_overflow, ...)

plus the promise ``duplicated == 0``: no trajectory id trained twice in the surviving lineage.

What cannot be seen from here is a trajectory a worker made but never delivered. Ids help:
a worker numbers its group and trajectory ids consecutively per incarnation (``make_id`` with
``(incarnation << 28) | counter``; a group takes ``group_size + 1`` counters), so a hole between
two received groups of one incarnation is a group lost in flight (``lost["in_flight_gap"]``).
A tail that never arrived (the batch a SIGKILLed worker was generating) is invisible by
construction; admission control refunds its reservation instead.
"""
from __future__ import annotations

import logging
from collections import Counter

import torch
from tensordict import TensorDict

from streamrl.trajectory import ID_SHIFT

log = logging.getLogger(__name__)
# Mirrors streamrl.workers.rollout.INCARNATION_BITS (a test keeps them equal).
INCARNATION_BITS = 28


def split_id(tid: int) -> tuple[int, int, int]:
    """(worker_id, incarnation, counter) of an id made by the rollout worker."""
    low = tid & ((1 << ID_SHIFT) - 1)
    return tid >> ID_SHIFT, low >> INCARNATION_BITS, low & ((1 << INCARNATION_BITS) - 1)


class Ledger:
    """Counters of one run (rank 0). JSON state via :meth:`state_dict`; trained ids as a tensor."""

    def __init__(self, group_size: int):
        self.group_size = group_size
        self.accepted = 0
        self.trained = 0
        self.duplicated = 0
        self.replayed = 0
        self.lost: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()  # messages rejected (transport + learner gates), by reason
        self.gated: Counter[str] = Counter()  # this incarnation's learner-gate rejections (folded into rejected)
        self.duplicates_dropped = 0
        self.known_workers: set[int] = set()
        self.workers_joined = 0
        self.workers_left = 0
        self.trained_ids: set[int] = set()
        # (worker, incarnation) -> [groups received, max group counter]
        self._groups: dict[tuple[int, int], list[int]] = {}

    # -- events ------------------------------------------------------------------------------
    def on_accept(self, td: TensorDict) -> None:
        """A batch passed every gate and enters the buffer."""
        self.accepted += int(td["traj_id"].numel())
        for gid in torch.unique(td["group_id"]).tolist():
            w, inc, c = split_id(gid)
            rec = self._groups.setdefault((w, inc), [0, 0])
            rec[0] += 1
            rec[1] = max(rec[1], c)

    def on_train(self, batch: TensorDict) -> None:
        ids = batch["traj_id"].tolist()
        twice = sum(1 for t in ids if t in self.trained_ids)
        if twice:
            log.error("%d trajectories trained a second time (ids %s...)", twice, ids[:3])
        self.duplicated += twice
        self.trained_ids.update(ids)
        self.trained += len(ids)

    def in_flight_gaps(self) -> int:
        """Trajectories of groups missing between received groups of one worker incarnation."""
        stride = self.group_size + 1
        missing = 0
        for n, top in self._groups.values():
            expected = (top - 1) // stride + 1 if top >= 1 else n
            missing += max(0, expected - n)
        return missing * self.group_size

    # -- report ------------------------------------------------------------------------------
    def summary(self, pending: int, stale: int, overflow: int) -> dict:
        lost = Counter(self.lost)
        if stale:
            lost["stale"] = stale
        if overflow:
            lost["group_overflow"] = overflow
        gaps = self.in_flight_gaps()
        accounted = self.trained + pending + sum(lost.values())
        if gaps:
            lost["in_flight_gap"] = gaps  # never reached us: not part of the accepted balance
        return {
            "accepted": self.accepted,
            "trained": self.trained,
            "pending_at_end": pending,
            "lost": dict(sorted(lost.items())),
            "lost_total": sum(lost.values()),
            "duplicated": self.duplicated,
            "duplicates_dropped": self.duplicates_dropped,
            "replayed_from_journal": self.replayed,
            "rejected_messages": dict(sorted(self.rejected.items())),
            "workers_seen": len(self.known_workers),
            "workers_joined": self.workers_joined,
            "workers_left": self.workers_left,
            "balanced": accounted == self.accepted,
        }

    # -- checkpoint ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"accepted": self.accepted, "trained": self.trained, "duplicated": self.duplicated,
                "replayed": self.replayed, "lost": dict(self.lost), "rejected": dict(self.rejected),
                "duplicates_dropped": self.duplicates_dropped, "known_workers": sorted(self.known_workers),
                "workers_joined": self.workers_joined, "workers_left": self.workers_left,
                "groups": [[w, i, n, m] for (w, i), (n, m) in self._groups.items()]}

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
        self._groups = {(w, i): [n, m] for w, i, n, m in state.get("groups", [])}
        self.trained_ids = set(trained_ids)

    def trained_ids_tensor(self) -> torch.Tensor:
        return torch.tensor(sorted(self.trained_ids), dtype=torch.int64)
