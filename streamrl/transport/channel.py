"""ZeroMQ trajectory channel: many rollout workers (PUSH) → learner rank 0 (PULL).

Design choice: **rank 0 receives and broadcasts**. One socket, one place that deduplicates,
checks sequence numbers and applies the staleness filter; batches then reach the other
data-parallel ranks through a ``torch.distributed`` broadcast (tensors, no pickle). With the
small trajectory batches of RL (kilobytes to a few MB per step) the broadcast costs far less
than a step, and a single admission point keeps group completion and dedup exact.

Backpressure: both sockets have a small high-water mark (``hwm`` messages). When the
learner stalls, its receive queue fills, then the worker's send queue, and then
``send()`` blocks the worker (PUSH blocks when all peers are at HWM): memory stays bounded
at about ``2 * hwm`` messages, and a slow learner slows the workers instead of growing queues.
"""
from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict

import zmq
from tensordict import TensorDict

from streamrl.trajectory import (
    SCHEMA_VERSION,
    TrajectoryError,
    concat_trajectories,
    split_trajectories,
    validate_trajectories,
)
from streamrl.transport.codec import FrameError, Limits, decode, encode

log = logging.getLogger(__name__)
KIND = "trajectories"


class TrajectorySender:
    """Worker side: connects a PUSH socket to the learner's endpoint and sends batches."""

    def __init__(self, endpoint: str, worker_id: int, hwm: int = 8, ctx: zmq.Context | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.worker_id = worker_id
        self.seq = 0
        # PUSH: SNDHWM bounds queued outgoing messages; when full, send blocks (backpressure).
        # LINGER 2 s on close: pending trajectories get a short chance to flush, then are
        # dropped rather than hanging shutdown forever.
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(endpoint)

    def send(self, td: TensorDict, timeout_s: float | None = None) -> bool:
        """Send one trajectory batch; blocks while the learner is backed up.

        Returns False if ``timeout_s`` passed without the message being queued.
        """
        meta = {"worker_id": self.worker_id, "seq": self.seq, "trajectory_schema": SCHEMA_VERSION}
        frames = encode(dict(td.items()), KIND, meta)
        if timeout_s is not None and not self.sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
            return False
        self.sock.send_multipart(frames, copy=False)
        self.seq += 1
        return True

    def close(self) -> None:
        self.sock.close()


class TrajectoryReceiver:
    """Learner side: binds a PULL socket, decodes, validates, dedups and counts.

    Every rejected message increments ``rejected[reason]`` and is logged (rate-limited);
    the receiver never raises on bad input.
    """

    def __init__(self, bind: str = "tcp://127.0.0.1:*", hwm: int = 8, limits: Limits = Limits(),
                 ctx: zmq.Context | None = None, dedup_window: int = 1_000_000):
        self.ctx = ctx or zmq.Context.instance()
        # PULL: RCVHWM bounds queued incoming messages; when full, peers' sends block.
        # MAXMSGSIZE drops oversized messages inside libzmq before they are buffered whole.
        # LINGER 0: on close, undelivered input is discarded (workers' own queues hold it).
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
        self.sock.bind(bind)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.limits = limits
        self.rejected: Counter[str] = Counter()
        self.received_messages = 0
        self.received_trajectories = 0
        self.received_bytes = 0
        self.seq_gaps = 0
        self.duplicates = 0
        self._next_seq: dict[int, int] = {}
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._dedup_window = dedup_window
        self._last_log = 0.0
        self.max_version: int | None = None

    def poll(self, timeout_s: float) -> list[TensorDict]:
        """Receive all messages that arrive within ``timeout_s`` (at least waits once)."""
        out = []
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            if not self.sock.poll(int(remaining * 1000), zmq.POLLIN):
                return out
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                td = self._accept(frames)
                if td is not None:
                    out.append(td)
            if out:
                return out

    def _accept(self, frames) -> TensorDict | None:
        self.received_messages += 1
        self.received_bytes += sum(len(f.buffer) for f in frames)
        try:
            _, meta, tensors = decode(frames, self.limits, expect_kind=KIND)
            if meta.get("trajectory_schema") != SCHEMA_VERSION:
                raise FrameError("bad_schema_version", f"trajectory schema {meta.get('trajectory_schema')!r}")
            worker, seq = meta.get("worker_id"), meta.get("seq")
            if not isinstance(worker, int) or not isinstance(seq, int):
                raise FrameError("bad_meta", "worker_id and seq must be integers")
            td = TensorDict(tensors, batch_size=[])
            validate_trajectories(td, max_version=self.max_version)
            if not (td["worker_id"] == worker).all():
                raise FrameError("worker_mismatch", f"trajectories claim another worker than {worker}")
        except (FrameError, TrajectoryError) as e:
            self._reject(e.reason, str(e))
            return None
        expected = self._next_seq.get(worker)
        if expected is not None and seq > expected:
            self.seq_gaps += seq - expected
            log.warning("worker %d: sequence gap %d..%d (%d messages missing)", worker, expected, seq - 1, seq - expected)
        self._next_seq[worker] = max(seq + 1, expected or 0)
        keep = []
        for i, tid in enumerate(td["traj_id"].tolist()):
            if tid in self._seen:
                self.duplicates += 1
                continue
            self._seen[tid] = None
            keep.append(i)
        while len(self._seen) > self._dedup_window:
            self._seen.popitem(last=False)
        if not keep:
            return None
        if len(keep) < td["traj_id"].numel():
            parts = split_trajectories(td)
            td = concat_trajectories([parts[i] for i in keep])
        self.received_trajectories += len(keep)
        return td

    def mark_seen(self, traj_ids: list[int]) -> None:
        """Pre-load the dedup set (e.g. ids already trained before a resume)."""
        for t in traj_ids:
            self._seen[t] = None

    def _reject(self, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        now = time.monotonic()
        if now - self._last_log > 1.0:
            self._last_log = now
            log.warning("rejected trajectory message (%s); totals %s", detail, dict(self.rejected))

    def stats(self) -> dict[str, float]:
        out = {
            "transport/messages": self.received_messages,
            "transport/trajectories": self.received_trajectories,
            "transport/bytes": self.received_bytes,
            "transport/seq_gaps": self.seq_gaps,
            "transport/duplicates": self.duplicates,
            "transport/rejected": sum(self.rejected.values()),
        }
        for reason, n in self.rejected.items():
            out[f"transport/rejected_{reason}"] = n
        return out

    def close(self) -> None:
        self.sock.close()
