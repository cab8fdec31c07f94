"""Learner side of the trajectory channel (design, ordering and flow control:
:mod:`streamrl.transport.channel`)."""
from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict

import zmq
from tensordict import TensorDict

from streamrl.trajectory import SCHEMA_VERSION, TrajectoryError, validate_trajectories
from streamrl.transport.channel import DEFAULT_CREDIT_BYTES, HELLO, KIND, is_u63
from streamrl.transport.codec import FrameError, Limits, decode
from streamrl.transport.credits import CreditLedger
from streamrl.transport.retention import pack_ack
from streamrl.transport.sockets import learner_socket, recv_bounded

log = logging.getLogger(__name__)


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
        if hasattr(ids, "numel") and is_u63(worker) and is_u63(session) and is_u63(produced):
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
            seq = meta.get("seq") if is_u63(meta.get("seq")) else None
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
        if not (is_u63(meta.get("worker_id")) and is_u63(meta.get("session")) and is_u63(meta.get("sent_bytes"))):
            self.ledger.consume(peer, 0)  # still answer, so the peer learns the window
            raise FrameError("bad_meta", "hello needs integer worker_id, session, sent_bytes")
        self.hellos += 1
        self.ledger.resync(peer, meta["sent_bytes"])
        if is_u63(meta.get("seq")):
            self._handled(peer, meta["seq"], horizon_only=True)

    def _accept(self, meta: dict, tensors: dict) -> TensorDict:
        if meta.get("trajectory_schema") != SCHEMA_VERSION:
            raise FrameError("bad_schema_version", f"trajectory schema {str(meta.get('trajectory_schema'))[:32]!r}")
        worker, session, seq = meta.get("worker_id"), meta.get("session", 0), meta.get("seq")
        if not (is_u63(worker) and is_u63(session) and is_u63(seq)):
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
        if is_u63(produced):  # the sender's cumulative count: the learner's ledger balances against it
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
