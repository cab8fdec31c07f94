"""Worker side of the trajectory channel (design, ordering and flow control:
:mod:`streamrl.transport.channel`)."""
from __future__ import annotations

import logging
import secrets
import time

import zmq
from tensordict import TensorDict

from streamrl.trajectory import SCHEMA_VERSION
from streamrl.transport.channel import HELLO, INITIAL_CREDIT_BYTES, KIND
from streamrl.transport.codec import encode
from streamrl.transport.credits import CreditWindow, unpack_grant
from streamrl.transport.retention import DEFAULT_RETAIN_BYTES, Retained, Retention, unpack_ack
from streamrl.transport.sockets import worker_socket

log = logging.getLogger(__name__)


class TrajectorySender:
    """Worker side: sends trajectory batches to the learner, within its byte credit, and keeps
    each one until the learner acknowledges it as durable (resending what a dead learner lost).

    Args:
        endpoint: the learner's endpoint (from Redis: ``Coordinator.wait_endpoint``).
        worker_id: this worker's id (every trajectory's ``worker_id`` must match it).
        hwm: send high-water mark in messages (second fence after credits).
        resync_s: after this long blocked (or holding unacknowledged messages) without hearing
            from the learner, send HELLO again (recovers a restarted learner or a lost grant).
        initial_credit_bytes: bytes it may send before the learner's first grant.
        retain_bytes: encoded bytes kept for resending at most (the memory bound of retention;
            at the bound ``send`` blocks: backpressure, never loss).

    ``send`` returns once the message is queued; the tensors must not be modified afterwards
    (they are sent zero-copy and retained for a resend), which callers get for free by
    building a fresh batch per send.
    """

    def __init__(self, endpoint: str, worker_id: int, hwm: int = 8, ctx: zmq.Context | None = None,
                 *, resync_s: float = 2.0, initial_credit_bytes: int = INITIAL_CREDIT_BYTES,
                 retain_bytes: int = DEFAULT_RETAIN_BYTES):
        self.ctx = ctx or zmq.Context.instance()
        self.worker_id = int(worker_id)
        self.session = secrets.randbits(63)
        self.seq = 0
        self.produced = 0  # trajectories handed to the transport by this session (the ledger's "produced")
        self.resync_s = resync_s
        self.credit = CreditWindow(initial_credit_bytes)
        self.retention = Retention(retain_bytes)
        self.blocked_s = 0.0
        self.hellos = 0
        self.sock = worker_socket(self.ctx, endpoint, hwm, f"{self.worker_id}:{self.session}".encode())
        self._last_progress = time.monotonic()
        self._hello()

    def _hello(self) -> None:
        meta = {"worker_id": self.worker_id, "session": self.session, "sent_bytes": self.credit.sent,
                "seq": self.seq}
        try:  # a HELLO that does not fit right now is retried on the next resync
            self.sock.send_multipart(encode({}, HELLO, meta), zmq.NOBLOCK)
            self.hellos += 1
        except zmq.Again:
            pass
        self._last_progress = time.monotonic()

    def _drain_control(self) -> bool:
        """Apply every grant and ack waiting on the socket; True if any arrived."""
        got = False
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return got
            ack = unpack_ack(data)
            if ack is not None:
                lost = self.retention.on_ack(*ack)
                if lost:
                    log.warning("worker %d: the learner never got %d message(s) (restarted?); resending them",
                                self.worker_id, lost)
                got = True
                continue
            grant = unpack_grant(data)
            if grant is not None:
                self.credit.grant(*grant)
                got = True

    def service(self) -> None:
        """Apply grants and acks, resend what a restarted learner lost, HELLO when unacknowledged
        messages wait too long. Call it while idle (never blocks)."""
        if self._drain_control():
            self._last_progress = time.monotonic()
        if self.retention.lost:
            self.send(None, timeout_s=0.0)
        elif self.retention.pending() and time.monotonic() - self._last_progress > self.resync_s:
            self._hello()

    def send(self, td: TensorDict | None, timeout_s: float | None = None) -> bool:
        """Send one trajectory batch (after any resends due); blocks while the learner is backed up.

        Returns False if ``timeout_s`` passed without the message being queued (nothing of
        ``td`` was sent; call again with the same batch). ``td=None`` only sends resends.
        """
        t0 = time.monotonic()
        deadline = None if timeout_s is None else t0 + timeout_s
        try:
            while True:
                resend = bool(self.retention.lost)
                if not resend and td is None:
                    return True
                if resend:
                    item = self.retention.lost[0]
                else:
                    item = Retained(td, 0, self.produced + int(td["traj_id"].numel()))
                outcome = self._send_one(item, resend, deadline)
                if outcome == "timeout":
                    return False
                if outcome == "sent" and not resend:
                    self.produced = item.produced
                    return True
        finally:
            self.blocked_s += time.monotonic() - t0

    def _send_one(self, item: Retained, resend: bool, deadline: float | None) -> str:
        """``sent``, ``timeout``, or ``retry`` (an ack meanwhile asked for resends, which go first)."""
        meta = {"worker_id": self.worker_id, "session": self.session, "seq": self.seq,
                "trajectory_schema": SCHEMA_VERSION, "sent_at": time.time(), "produced": item.produced}
        frames = encode(dict(item.td.items()), KIND, meta)
        nbytes = sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
        if self._drain_control():
            self._last_progress = time.monotonic()
        # a resend is already counted in retention, so only credit can hold it back
        while not (self.credit.may_send(nbytes) and (resend or self.retention.has_room(nbytes))):
            if not resend and self.retention.lost:
                return "retry"
            now = time.monotonic()
            if now - self._last_progress > self.resync_s:
                self._hello()
            wait = self.resync_s if deadline is None else min(self.resync_s, deadline - now)
            if wait <= 0:
                return "timeout"
            if self.sock.poll(max(1, int(wait * 1000)), zmq.POLLIN) and self._drain_control():
                self._last_progress = time.monotonic()
        if not resend and self.retention.lost:
            return "retry"
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if remaining is not None and not self.sock.poll(int(remaining * 1000), zmq.POLLOUT):
            return "timeout"
        self.sock.send_multipart(frames, copy=False)
        self.credit.sent_message(nbytes)
        if resend:
            self.retention.pop_lost()
        self.retention.keep(self.seq, Retained(item.td, nbytes, item.produced))
        self.seq += 1
        return "sent"

    def flush(self, timeout_s: float = 10.0, durable: bool = False) -> bool:
        """Wait until the learner has read everything sent (with ``durable``: acknowledged it,
        resending what it lost); True if so."""
        deadline = time.monotonic() + timeout_s
        while self.credit.in_flight() > 0 or (durable and self.retention.pending()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if durable and self.retention.lost and not self.send(None, timeout_s=remaining):
                return False
            if time.monotonic() - self._last_progress > self.resync_s:
                self._hello()
            if (self.sock.poll(max(1, int(min(remaining, self.resync_s) * 1000)), zmq.POLLIN)
                    and self._drain_control()):
                self._last_progress = time.monotonic()
        return True

    def stats(self) -> dict[str, float]:
        return {
            "transport/sent_messages": self.seq,
            "transport/sent_bytes": self.credit.sent,
            "transport/in_flight_bytes": self.credit.in_flight(),
            "transport/blocked_s": self.blocked_s,
            "transport/hellos": self.hellos,
            "transport/produced": self.produced,
            "transport/retained_messages": self.retention.pending(),
            "transport/retained_bytes": self.retention.bytes,
            "transport/acked_messages": self.retention.acked,
            "transport/resent_messages": self.retention.resent,
        }

    def close(self) -> None:
        self.sock.close()
