"""ZeroMQ trajectory channel: many rollout workers (DEALER) → learner rank 0 (ROUTER).

Design choice: **rank 0 receives and broadcasts**. One socket, one place that deduplicates,
checks sequence numbers and applies the staleness filter; batches then reach the other
data-parallel ranks through a ``torch.distributed`` broadcast (tensors, no pickle; see
:mod:`streamrl.learner.distributed`). Why not one socket per DP rank: group-relative
advantages need whole prompt groups and the staleness filter needs one view of what arrived,
so per-rank receivers would need a second agreement round (which groups, which ranks) every
step — itself a collective. Measured on the 2-core dev machine (loaded): the stream takes a
1 MB batch off the wire in ~1.7 ms and a 16 MB one in ~25 ms; ``broadcast_batch`` to a second
gloo rank took ~43 ms (1 MB) and ~27 ms (16 MB), dominated by one collective per key (13),
not by bytes. So the broadcast, not the socket, is the cost of this design; packing the batch
into one buffer (one collective) is the cheap fix, and per-rank receive only pays once
trajectory bytes per step approach the broadcast bandwidth (GB per step).

Flow control (bounded memory, a slow learner slows workers): byte credits per worker on top
of ZeroMQ high-water marks (:mod:`streamrl.transport.credits`). The learner grants credit when
``poll`` reads a message; while it trains it does not poll, so each worker can have at most
``credit_bytes`` (or one larger message) queued, and then ``send`` blocks or times out.
Learner memory held by the stream is therefore at most about
``n_workers * max(credit_bytes, initial_credit_bytes, one message)`` plus kernel socket buffers.
Sockets and their invariants: :mod:`streamrl.transport.sockets`.

Ordering and integrity: each sender has a random 63-bit ``session`` and numbers its data
messages ``seq = 0, 1, 2, ...``. The receiver tracks ``(worker_id, session)``: a jump is a gap
(messages lost: counted, logged), a step back is a replay (counted); a new session of a known
worker is a restart (counted). Every rejected message increments ``rejected[reason]`` and is
logged (rate limited); the receiver never raises on network input. Duplicate trajectory ids
are dropped by the learner's intake (:mod:`streamrl.learner.intake`), whose id set survives
restarts in checkpoints and the journal.

Durability: the sender retains every message until the learner acknowledges it
(:mod:`streamrl.transport.retention`). The receiver acknowledges a message once its caller
has made it durable: :meth:`TrajectoryReceiver.commit` (and the next ``poll``, which implies
that everything the previous one returned was handled) sends the acks.
"""
from __future__ import annotations

import logging
import secrets
import time
from collections import Counter, OrderedDict

import zmq
from tensordict import TensorDict

from streamrl.trajectory import (
    SCHEMA_VERSION,
    TrajectoryError,
    validate_trajectories,
)
from streamrl.transport.codec import FrameError, Limits, decode, encode
from streamrl.transport.credits import CreditLedger, CreditWindow, unpack_grant
from streamrl.transport.retention import DEFAULT_RETAIN_BYTES, Retained, Retention, pack_ack, unpack_ack
from streamrl.transport.sockets import learner_socket, recv_bounded, worker_socket

log = logging.getLogger(__name__)
KIND = "trajectories"
HELLO = "hello"
DEFAULT_CREDIT_BYTES = 128 * 1024 * 1024  # two 64 MB batches in flight: the largest still pipeline
INITIAL_CREDIT_BYTES = 8 * 1024 * 1024
_INT63 = 1 << 63


def _is_u63(x) -> bool:
    return type(x) is int and 0 <= x < _INT63


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


class TrajectoryReceiver:
    """Learner side: binds the ROUTER socket, decodes, validates, counts, grants credit, acks.

    Args:
        bind: ZeroMQ endpoint to bind (``tcp://host:*`` for a free port; read ``.endpoint``).
        hwm: receive high-water mark in messages per worker.
        limits: codec limits checked before allocating.
        credit_bytes: bytes each worker may have in flight (the memory bound per worker).
    """

    def __init__(self, bind: str = "tcp://127.0.0.1:*", hwm: int = 8, limits: Limits = Limits(),
                 ctx: zmq.Context | None = None, *, credit_bytes: int = DEFAULT_CREDIT_BYTES):
        self.ctx = ctx or zmq.Context.instance()
        self.sock = learner_socket(self.ctx, bind, hwm, limits)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.limits = limits
        self.ledger = CreditLedger(credit_bytes)
        self.rejected: Counter[str] = Counter()
        self.received_messages = 0
        self.received_trajectories = 0
        self.received_bytes = 0
        self.seq_gaps = 0
        self.seq_replays = 0
        self.restarts = 0
        self.hellos = 0
        self.acks_sent = 0
        self._latency_sum = 0.0
        self._latency_n = 0
        self._next_seq: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._session_of: dict[int, int] = {}
        # peer -> [horizon, seqs handled since the last commit] (see streamrl.transport.retention)
        self._acks: dict[bytes, list] = {}
        # (worker_id, session) -> trajectories that sender had produced up to its newest message read
        self.produced: dict[tuple[int, int], int] = {}
        self.rejected_trajectories: Counter[int] = Counter()  # worker_id -> trajectories in rejected messages
        self._last_log = 0.0
        self.max_version: int | None = None

    def poll(self, timeout_s: float, max_messages: int = 256) -> list[TensorDict]:
        """Receive trajectory batches arriving within ``timeout_s``.

        Returns as soon as at least one batch was accepted (after draining what is already
        queued, up to ``max_messages`` reads), or an empty list at the deadline. Calling it
        again acknowledges what the previous call returned (see :meth:`commit`).
        """
        self.commit()
        out: list[TensorDict] = []
        deadline = time.monotonic() + timeout_s
        reads = 0
        while True:
            if not self.sock.poll(0, zmq.POLLIN):
                self._grant(everything=True)  # about to wait: nobody may stay blocked on us
                remaining = max(0.0, deadline - time.monotonic())
                if not self.sock.poll(int(remaining * 1000), zmq.POLLIN):
                    return out
            while reads < max_messages:
                try:
                    peer, frames, nbytes, error = recv_bounded(self.sock, self.limits)
                except zmq.Again:
                    break
                reads += 1
                td = self._handle(peer, frames, nbytes, error)
                if td is not None:
                    out.append(td)
            if out or reads >= max_messages or time.monotonic() >= deadline:
                # Queue drained: send every owed grant, since the caller may now train for a while.
                self._grant(everything=not self.sock.poll(0, zmq.POLLIN))
                return out
            self._grant()

    def _grant(self, everything: bool = False) -> None:
        for peer, grant in self.ledger.pending_grants(everything):
            try:
                self.sock.send_multipart([peer, grant], zmq.NOBLOCK)
            except zmq.ZMQError:  # peer gone or its pipe full: it resyncs by HELLO
                pass

    def commit(self) -> None:
        """Acknowledge every message handled since the last commit: the caller has made what
        :meth:`poll` returned durable (journaled) or dropped it for good. Rejected messages and
        HELLO horizons are acknowledged here too, so a sender never resends them."""
        for peer, (horizon, seqs) in self._acks.items():
            try:
                self.sock.send_multipart([peer, pack_ack(horizon, seqs)], zmq.NOBLOCK)
                self.acks_sent += 1
            except zmq.ZMQError:  # peer gone or its pipe full: a later horizon makes it resend; ids dedup
                pass
        self._acks.clear()

    def _count_rejected(self, meta: dict, tensors: dict) -> None:
        """A registered-looking sender's message was rejected after decoding: its trajectories
        still count as produced (and rejected), so the learner's ledger balances."""
        ids = tensors.get("traj_id")
        worker, session, produced = meta.get("worker_id"), meta.get("session"), meta.get("produced")
        if hasattr(ids, "numel") and _is_u63(worker) and _is_u63(session) and _is_u63(produced):
            key = (worker, session)
            self.produced[key] = max(self.produced.get(key, 0), produced)
            self.rejected_trajectories[worker] += int(ids.numel())

    def _handled(self, peer: bytes, seq: int, horizon_only: bool = False) -> None:
        rec = self._acks.setdefault(peer, [0, []])
        if horizon_only:  # a HELLO: everything before its seq was read or lost
            rec[0] = max(rec[0], seq)
        else:
            rec[0] = max(rec[0], seq + 1)
            rec[1].append(seq)

    def _handle(self, peer: bytes, frames, nbytes: int, error: FrameError | None) -> TensorDict | None:
        self.received_messages += 1
        self.received_bytes += nbytes
        accounted = False
        seq = None
        meta, tensors = {}, {}
        try:
            if error is not None:
                raise error
            kind, meta, tensors = decode(frames, self.limits)
            if kind == HELLO:
                accounted = True  # HELLOs are outside the byte budget; answered either way
                self._hello(peer, meta)
                return None
            self.ledger.consume(peer, nbytes)
            accounted = True
            seq = meta.get("seq") if _is_u63(meta.get("seq")) else None
            if kind != KIND:
                raise FrameError("bad_kind", f"kind {kind[:32]!r}, expected {KIND!r}")
            td = self._accept(meta, tensors)
            self._handled(peer, seq)
            return td
        except (FrameError, TrajectoryError) as e:
            if not accounted:  # garbage still used queue space; a worker clamps consumed to sent
                self.ledger.consume(peer, nbytes)
            if seq is not None:  # resending a rejected message would be rejected again
                self._handled(peer, seq)
                self._count_rejected(meta, tensors)
            self._reject(e.reason, str(e))
            return None

    def _hello(self, peer: bytes, meta: dict) -> None:
        if not (_is_u63(meta.get("worker_id")) and _is_u63(meta.get("session")) and _is_u63(meta.get("sent_bytes"))):
            self.ledger.consume(peer, 0)  # still answer, so the peer learns the window
            raise FrameError("bad_meta", "hello needs integer worker_id, session, sent_bytes")
        self.hellos += 1
        self.ledger.resync(peer, meta["sent_bytes"])
        if _is_u63(meta.get("seq")):
            self._handled(peer, meta["seq"], horizon_only=True)

    def _accept(self, meta: dict, tensors: dict) -> TensorDict:
        if meta.get("trajectory_schema") != SCHEMA_VERSION:
            raise FrameError("bad_schema_version", f"trajectory schema {str(meta.get('trajectory_schema'))[:32]!r}")
        worker, session, seq = meta.get("worker_id"), meta.get("session", 0), meta.get("seq")
        if not (_is_u63(worker) and _is_u63(session) and _is_u63(seq)):
            raise FrameError("bad_meta", "worker_id, session and seq must be integers in [0, 2**63)")
        validate_trajectories(tensors, max_version=self.max_version)
        td = TensorDict(tensors, batch_size=[])
        if not (td["worker_id"] == worker).all():
            raise FrameError("worker_mismatch", f"trajectories claim another worker than {worker}")
        self._track_seq(worker, session, seq)
        sent_at = meta.get("sent_at")
        if isinstance(sent_at, float):
            self._latency_sum += max(0.0, time.time() - sent_at)
            self._latency_n += 1
        produced = meta.get("produced")
        if _is_u63(produced):  # the sender's cumulative count: the learner's ledger balances against it
            key = (worker, session)
            self.produced[key] = max(self.produced.get(key, 0), produced)
        self.received_trajectories += int(td["traj_id"].numel())
        return td

    def _track_seq(self, worker: int, session: int, seq: int) -> None:
        key = (worker, session)
        expected = self._next_seq.get(key)
        if expected is None:
            # A session we have not seen: a new worker, a restarted one, or our own restart
            # mid-stream (then seq > 0 is not a loss we can attribute, so no gap is counted).
            if self._session_of.get(worker, session) != session:
                self.restarts += 1
                log.info("worker %d restarted (new session)", worker)
            self._session_of[worker] = session
        elif seq > expected:
            self.seq_gaps += seq - expected
            log.warning("worker %d: sequence gap %d..%d (%d messages missing)", worker, expected, seq - 1, seq - expected)
        elif seq < expected:
            self.seq_replays += 1
        self._next_seq[key] = max(seq + 1, expected or 0)
        self._next_seq.move_to_end(key)
        while len(self._next_seq) > 65536:  # bounded even under session churn
            self._next_seq.popitem(last=False)

    def _reject(self, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rejected trajectory message: %s", detail)
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
            "transport/seq_replays": self.seq_replays,
            "transport/sender_restarts": self.restarts,
            "transport/hellos": self.hellos,
            "transport/acks_sent": self.acks_sent,
            "transport/rejected": sum(self.rejected.values()),
            "transport/latency_ms_mean": 1000 * self._latency_sum / max(1, self._latency_n),
        }
        for reason, n in self.rejected.items():
            out[f"transport/rejected_{reason}"] = n
        return out

    def close(self) -> None:
        self.sock.close()
