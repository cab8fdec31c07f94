"""Sender retention with acknowledgements: a worker keeps what it sent until the learner has it durably.

Credits (:mod:`streamrl.transport.credits`) say a message was *read*; that is not enough to
survive a learner crash: a message read (or still queued in the learner's socket) when the
learner is SIGKILLed is gone, while the worker believes it delivered. So the learner also
*acknowledges*: once it has written a message's trajectories to its journal (or dropped them
as duplicates of something already durable, or rejected them for good) it sends an ack, and
only then does the worker forget the message.

Ack frame (learner -> worker, on the same ROUTER/DEALER pair as grants; never 16 bytes long,
so it cannot be mistaken for a grant)::

    b"ACK1" | horizon: uint64 | n: uint64 | seq_1 .. seq_n: uint64      (little-endian; 20 + 8n bytes)

* ``seq_i``: data messages of this sender session the learner has made durable or resolved.
* ``horizon``: every message with ``seq < horizon`` has been read by this learner or was lost
  before it could be (one connection delivers in order, so nothing older can still arrive).
  A data message read moves the horizon to ``seq + 1``; a HELLO carrying the sender's next
  ``seq`` moves it there (that is how a restarted learner tells a worker what it never got).

A retained message below the horizon that is not acknowledged was therefore lost with a dead
learner: the worker sends it again (new ``seq``, same trajectory ids; the learner drops ids it
already holds, so a resend never trains twice).

Memory bound: a worker retains at most ``max_bytes`` of encoded messages (or one message
larger than that, alone). At the bound ``TrajectorySender.send`` blocks like it does for
credits (backpressure; the worker stops generating); nothing is ever dropped silently.
"""
from __future__ import annotations

import struct
from collections import OrderedDict, deque
from dataclasses import dataclass

from tensordict import TensorDict

ACK_MAGIC = b"ACK1"
_ACK_HEAD = struct.Struct("<4sQQ")
DEFAULT_RETAIN_BYTES = 256 * 1024 * 1024  # two default credit windows: retention is never the first fence


def pack_ack(horizon: int, seqs: list[int]) -> bytes:
    """One ack frame: ``seqs`` are durable, everything below ``horizon`` was read or lost."""
    return _ACK_HEAD.pack(ACK_MAGIC, horizon, len(seqs)) + struct.pack(f"<{len(seqs)}Q", *seqs)


def unpack_ack(data: bytes) -> tuple[int, list[int]] | None:
    """``(horizon, seqs)`` of an ack frame, or None for anything else (a grant, garbage)."""
    if len(data) < _ACK_HEAD.size or data[:4] != ACK_MAGIC:
        return None
    _, horizon, n = _ACK_HEAD.unpack_from(data)
    if len(data) != _ACK_HEAD.size + 8 * n:
        return None
    return horizon, list(struct.unpack_from(f"<{n}Q", data, _ACK_HEAD.size))


@dataclass
class Retained:
    """One sent, not yet acknowledged message: the batch (re-encoded on a resend) and its size."""

    td: TensorDict
    nbytes: int
    produced: int  # the sender's cumulative trajectory count up to and including this batch


class Retention:
    """Worker side bookkeeping (no sockets): sent messages by ``seq`` until acknowledged.

    Args:
        max_bytes: encoded bytes retained at most (one larger message may be retained alone).
    """

    def __init__(self, max_bytes: int = DEFAULT_RETAIN_BYTES):
        if max_bytes < 1:
            raise ValueError(f"retention bound must be >= 1 byte, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.acked = 0  # messages acknowledged, ever
        self.resent = 0  # messages handed back for a resend, ever
        self._items: OrderedDict[int, Retained] = OrderedDict()
        self.lost: deque[Retained] = deque()  # lost with a learner: to be sent again, oldest first

    def has_room(self, nbytes: int) -> bool:
        """May a new message of ``nbytes`` be sent now without exceeding the bound?"""
        return self.pending() == 0 or self.bytes + nbytes <= self.max_bytes

    def keep(self, seq: int, item: Retained) -> None:
        assert seq not in self._items, f"seq {seq} retained twice"
        self._items[seq] = item
        self.bytes += item.nbytes

    def on_ack(self, horizon: int, seqs: list[int]) -> int:
        """Forget the acknowledged messages; move those lost below ``horizon`` to the resend queue
        (:attr:`lost`, oldest first; still counted in :attr:`bytes`). Returns how many were lost."""
        for s in seqs:
            item = self._items.pop(s, None)
            if item is not None:
                self.bytes -= item.nbytes
                self.acked += 1
        lost = [s for s in self._items if s < horizon]
        for s in lost:
            self.lost.append(self._items.pop(s))
        self.resent += len(lost)
        return len(lost)

    def pop_lost(self) -> Retained:
        """The oldest message to send again (the caller keeps it again under its new ``seq``)."""
        item = self.lost.popleft()
        self.bytes -= item.nbytes
        return item

    def pending(self) -> int:
        """Messages not yet acknowledged (in flight or waiting for a resend)."""
        return len(self._items) + len(self.lost)
