"""ZeroMQ trajectory channel: many rollout workers (DEALER) → learner rank 0 (ROUTER).

This module holds the design and the wire constants; the two ends live in
:mod:`streamrl.transport.sender` (:class:`TrajectorySender`, worker side) and
:mod:`streamrl.transport.receiver` (:class:`TrajectoryReceiver`, learner side).

Design choice: **rank 0 receives and broadcasts**. One socket, one place that deduplicates,
checks sequence numbers and applies the staleness filter; batches then reach the other
data-parallel ranks through a ``torch.distributed`` broadcast (tensors, no pickle; see
:mod:`streamrl.learner.distributed`). Why not one socket per DP rank: group-relative
advantages need whole prompt groups and the staleness filter needs one view of what arrived,
so per-rank receivers would need a second agreement round (which groups, which ranks) every
step — itself a collective. Taking a batch off the wire costs less than broadcasting it to a
second rank, and the broadcast's cost is one collective per key, not bytes (figures in
docs/benchmarks.md). So the broadcast, not the socket, is the cost of this design; packing the batch
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
has made it durable: :meth:`streamrl.transport.receiver.TrajectoryReceiver.commit` (and the next ``poll``, which implies
that everything the previous one returned was handled) sends the acks.
"""
KIND = "trajectories"
HELLO = "hello"
DEFAULT_CREDIT_BYTES = 128 * 1024 * 1024  # two 64 MB batches in flight: the largest still pipeline
INITIAL_CREDIT_BYTES = 8 * 1024 * 1024
_INT63 = 1 << 63


def is_u63(x) -> bool:
    """A non-negative Python int below 2**63 (ids, sessions, sequence numbers from the network)."""
    return type(x) is int and 0 <= x < _INT63
