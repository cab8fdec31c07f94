"""Byte credits: a slow learner slows rollout workers, and queued bytes stay bounded.

ZeroMQ high-water marks count *messages*; a trajectory message is 4 KB or 64 MB, so an HWM
alone bounds memory only as ``hwm * max_message_bytes`` per worker. Credits bound *bytes*:

* The learner grants each worker a window of ``window`` bytes (before the first grant a
  worker assumes a small initial window, 8 MiB by default). A grant is absolute: the
  16-byte message ``(consumed, window)`` says "I have taken ``consumed`` bytes of yours off
  the wire; you may have ``window`` bytes beyond that in flight".
* A worker may send a message of ``n`` bytes when ``sent - consumed + n <= window``, or when
  nothing is in flight (so one message larger than the window still goes, alone).
* The learner counts a message as consumed when its ``poll`` reads it (valid or rejected),
  and answers with a grant per worker after each read burst. It does not read while it
  trains, so queued bytes per worker stay ``<= max(window, one message)``.
* Absolute counters make grants idempotent (a lost or duplicated grant is harmless) and
  resynchronisation trivial: a worker that waited ``resync_s`` without progress sends HELLO
  carrying its ``sent`` total; since one connection delivers in order, everything it sent
  before the HELLO has been read or lost, so the learner sets ``consumed = sent``. This
  recovers from a learner restart, a dropped connection or a message libzmq discarded.

Both sides here are plain bookkeeping (no sockets), unit-tested on their own.
"""
from __future__ import annotations

import struct
from collections import OrderedDict

GRANT = struct.Struct("<QQ")  # consumed bytes, window bytes; little-endian uint64


def pack_grant(consumed: int, window: int) -> bytes:
    return GRANT.pack(consumed, window)


def unpack_grant(data: bytes) -> tuple[int, int] | None:
    """``(consumed, window)`` or None for anything that is not exactly one grant."""
    if len(data) != GRANT.size:
        return None
    return GRANT.unpack(data)


class CreditWindow:
    """Worker side: how many bytes may be in flight right now.

    ``initial`` is the window assumed before the learner's first grant (so a worker need
    not wait a round trip, and a learner busy training when the worker starts does not
    stall it); ``None`` waits for the grant.
    """

    def __init__(self, initial: int | None = None):
        self.sent = 0  # bytes of data messages handed to the socket, ever
        self.consumed = 0  # latest ``consumed`` the learner granted
        self.window: int | None = initial  # replaced by the learner's window on each grant

    def grant(self, consumed: int, window: int) -> None:
        # A restarted learner may report less than before; the newest grant is the truth
        # (one connection delivers in order), but never more than we actually sent.
        self.consumed = min(consumed, self.sent)
        self.window = window

    def in_flight(self) -> int:
        return self.sent - self.consumed

    def may_send(self, nbytes: int) -> bool:
        if self.window is None:
            return False
        return self.in_flight() == 0 or self.in_flight() + nbytes <= self.window

    def sent_message(self, nbytes: int) -> None:
        self.sent += nbytes


class CreditLedger:
    """Learner side: bytes consumed per peer identity (LRU-bounded, so churn cannot grow it).

    Grants are batched: a peer is *urgent* once a quarter of its window was consumed since
    its last grant (or after a HELLO); the receiver sends urgent grants after every read
    burst and all outstanding ones before it waits. A worker therefore never stalls while
    the learner is reading, and small messages do not each cost a send back.
    """

    def __init__(self, window: int, max_peers: int = 4096):
        if window < 1:
            raise ValueError(f"credit window must be >= 1 byte, got {window}")
        self.window = window
        self.max_peers = max_peers
        self._consumed: OrderedDict[bytes, int] = OrderedDict()
        self._granted: dict[bytes, int] = {}
        self._urgent: set[bytes] = set()

    def consume(self, peer: bytes, nbytes: int) -> None:
        self._consumed[peer] = self._consumed.get(peer, 0) + nbytes
        if peer not in self._granted or self._consumed[peer] - self._granted[peer] >= self.window // 4:
            self._urgent.add(peer)
        self._touch(peer)

    def resync(self, peer: bytes, sent: int) -> None:
        """HELLO: everything ``peer`` sent before it has been read or lost."""
        self._consumed[peer] = sent
        self._urgent.add(peer)
        self._touch(peer)

    def _touch(self, peer: bytes) -> None:
        self._consumed.move_to_end(peer)
        while len(self._consumed) > self.max_peers:
            old, _ = self._consumed.popitem(last=False)
            self._granted.pop(old, None)
            self._urgent.discard(old)

    def pending_grants(self, everything: bool = False) -> list[tuple[bytes, bytes]]:
        """``(peer, grant)`` for urgent peers, or with ``everything`` for all peers owed one."""
        if everything:
            peers = [p for p, c in self._consumed.items() if self._granted.get(p) != c or p in self._urgent]
        else:
            peers = list(self._urgent)
        out = []
        for p in peers:
            self._granted[p] = self._consumed[p]
            out.append((p, pack_grant(self._consumed[p], self.window)))
        self._urgent.clear() if everything else self._urgent.difference_update(peers)
        return out
