"""In-process twin of the trajectory channel: the learner-facing API of ``TrajectoryReceiver``
without sockets, so the learner's intake (dedup, staleness, refunds, journal replay, version
rebase) is tested in one process, deterministically.

What a learner reads from a trajectory source (both implementations)::

    poll(timeout_s) -> list[TensorDict]   validated batches (acks what the previous poll returned)
    commit()                              acknowledge everything handled so far
    max_version                           newest policy version a batch may carry (None: no check)
    produced                              {(worker_id, session): sender's cumulative trajectories}
    rejected, rejected_trajectories       Counter by reason / by worker
    stats(), close()

The sending side is :meth:`LocalFeed.send`, which numbers messages and counts ``produced``
per session like :class:`~streamrl.transport.sender.TrajectorySender` does. Validation is the
same function the receiver runs (:func:`streamrl.trajectory.validate_trajectories`).
"""
from __future__ import annotations

import time
from collections import Counter, deque

from tensordict import TensorDict

from streamrl.trajectory import TrajectoryError, validate_trajectories


class LocalFeed:
    """Trajectory batches handed over in memory (one process, no sockets)."""

    endpoint = "local://"

    def __init__(self):
        self.max_version: int | None = None
        self.produced: dict[tuple[int, int], int] = {}
        self.rejected: Counter[str] = Counter()
        self.rejected_trajectories: Counter[int] = Counter()
        self.acked: list[tuple[int, int, int]] = []  # (worker, session, seq) acknowledged, in order
        self._queue: deque[tuple[int, int, int, int, TensorDict]] = deque()
        self._handled: list[tuple[int, int, int]] = []
        self._next_seq: Counter[tuple[int, int]] = Counter()
        self._sent: Counter[tuple[int, int]] = Counter()
        self._ids_sent: set[int] = set()

    def send(self, td: TensorDict, session: int = 0) -> int:
        """Queue one batch from worker ``td["worker_id"][0]``'s sender ``session``; returns its seq.
        A trajectory id this session sent before is a resend: not produced again (the real
        sender keeps a message's count when it resends it)."""
        worker = int(td["worker_id"][0])
        key = (worker, session)
        new = set(td["traj_id"].tolist()) - self._ids_sent
        self._ids_sent |= new
        self._sent[key] += len(new)
        seq = self._next_seq[key]
        self._next_seq[key] += 1
        self._queue.append((worker, session, seq, self._sent[key], td))
        return seq

    def pending(self) -> int:
        """Batches sent and not yet polled."""
        return len(self._queue)

    def poll(self, timeout_s: float = 0.0, max_messages: int = 256) -> list[TensorDict]:
        """Everything queued (up to ``max_messages``), validated; waits ``timeout_s`` only when
        nothing is queued (a learner waiting for data)."""
        self.commit()
        if not self._queue and timeout_s > 0:
            time.sleep(min(timeout_s, 0.01))  # nothing can arrive while the caller blocks us
        out = []
        while self._queue and len(out) < max_messages:
            worker, session, seq, produced, td = self._queue.popleft()
            self.produced[(worker, session)] = max(self.produced.get((worker, session), 0), produced)
            self._handled.append((worker, session, seq))
            try:
                validate_trajectories(td, max_version=self.max_version)
            except TrajectoryError as e:
                self.rejected[e.reason] += 1
                self.rejected_trajectories[worker] += int(td["traj_id"].numel())
                continue
            out.append(td)
        return out

    def commit(self) -> None:
        self.acked.extend(self._handled)
        self._handled.clear()

    def stats(self) -> dict[str, float]:
        return {"transport/rejected": sum(self.rejected.values()), "transport/acks_sent": len(self.acked)}

    def close(self) -> None:
        self._queue.clear()
