"""The two ZeroMQ sockets of the trajectory stream, their invariants, and bounded receive.

Learner rank 0 binds one ``ROUTER``; every rollout worker connects one ``DEALER``. Data
flows worker → learner; the only thing flowing back is a 16-byte credit grant (see
:mod:`streamrl.transport.credits`). ROUTER/DEALER rather than PULL/PUSH because credits need
that return path on the same connection (same ordering, same peer identity).

Each socket's invariants are documented where it is created, below.

Limitation worth knowing: libzmq hands a multipart message to the application only once
all its frames have arrived, and ``MAXMSGSIZE`` bounds each *frame*, not the sum. The
frame-count and total-size limits are enforced here as frames are read (without touching
their bytes), so a buggy worker costs at most one discarded message; a *hostile* peer that
sends a message of very many maximal frames could still make libzmq buffer it. The data
plane therefore trusts its network perimeter for denial of service (as the learner trusts
Redis); it never trusts frame *contents*.
"""
from __future__ import annotations

from typing import Any

import zmq

from streamrl.security import apply_client_keys, apply_server_keys, load_curve_keys
from streamrl.transport.codec import FrameError, Limits


def learner_socket(ctx: zmq.Context, bind: str, hwm: int, limits: Limits) -> zmq.Socket:
    """The learner's ROUTER socket, bound to ``bind`` (``tcp://host:*`` picks a free port).

    Invariants:
      * RCVHWM = ``hwm`` messages *per connected worker* (libzmq keeps one pipe per peer).
        When a worker's pipe is full the learner stops reading that TCP connection, the
        kernel buffers fill, and the worker's own SNDHWM then blocks it. Credits normally
        stop a worker long before that (byte bound); the HWM is the second fence.
      * SNDHWM = 1000 messages per peer for credit grants (16 bytes each). ROUTER drops a
        grant to a peer whose pipe is full or gone instead of blocking the learner; a lost
        grant is recovered by the worker's HELLO resync.
      * ROUTER_HANDOVER = 1: a worker that reconnects with the same routing id
        (``worker:session``) takes over its identity, so its credit ledger survives.
      * MAXMSGSIZE = ``limits.max_message_bytes``: libzmq drops the connection of a peer
        that announces a larger frame, before buffering it.
      * LINGER = 0: on close, undelivered grants are discarded (workers resync on their own).
    """
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
    sock.setsockopt(zmq.LINGER, 0)
    # Optional CURVE (encryption + client allow-list) when keys are configured in the
    # environment (STREAMRL_CURVE_DIR or STREAMRL_CURVE_SECRET, see streamrl.security).
    apply_server_keys(sock, load_curve_keys("server"))
    sock.bind(bind)
    return sock


def worker_socket(ctx: zmq.Context, endpoint: str, hwm: int, routing_id: bytes) -> zmq.Socket:
    """A rollout worker's DEALER socket, connected to the learner's ``endpoint``.

    Invariants:
      * SNDHWM = ``hwm`` messages. Credits bound what the worker may have in flight in bytes;
        the HWM additionally bounds the message count. When full, ``send`` would block;
        the sender polls POLLOUT first so a timeout returns instead of hanging.
      * RCVHWM = 1000 (credit grants only; the sender drains them before every send).
      * ROUTING_ID = ``worker_id:session``: stable across reconnects (see ROUTER_HANDOVER).
      * IMMEDIATE stays 0: the HELLO queues until the connection is up (so the first grant
        comes as soon as the learner reads); trajectories cannot pile up in a dead pipe
        anyway, since none is sent before the learner granted credit.
      * LINGER = 2000 ms on close: queued trajectories get a short chance to flush, then
        are dropped rather than hanging shutdown (the learner counts the seq gap).
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.LINGER, 2000)
    apply_client_keys(sock, load_curve_keys("client"))  # CURVE when configured (see learner_socket)
    sock.connect(endpoint)
    return sock


def recv_bounded(sock: zmq.Socket, limits: Limits) -> tuple[bytes, list[Any], int, FrameError | None]:
    """Read one ROUTER message frame by frame: ``(identity, frames, nbytes, error)``.

    Raises ``zmq.Again`` if nothing is waiting. Checks frame count and total size as frames
    are read (sizes only, payloads untouched); on a violation the rest of the message is
    drained and discarded and ``error`` says why, with ``frames`` empty. ``frames`` are
    ``zmq.Frame`` objects (zero-copy); ``nbytes`` counts every frame after the identity,
    kept or discarded (credit accounting needs it).
    """
    ident = sock.recv(zmq.NOBLOCK, copy=False)
    if not ident.more:  # a ROUTER always prefixes the identity; nothing after it = empty message
        return ident.bytes, [], 0, FrameError("empty", "no frames after the routing id")
    frames: list[Any] = []
    total = 0
    error: FrameError | None = None
    more = True
    while more:
        frame = sock.recv(copy=False)  # parts of one message arrive together: never blocks
        more = frame.more
        total += len(frame)
        if error is not None:
            continue
        if len(frames) >= limits.max_tensors + 1:
            error = FrameError("too_many_frames", f"more than {limits.max_tensors + 1} frames")
        elif total > limits.max_message_bytes:
            error = FrameError("oversized", f"more than {limits.max_message_bytes} bytes")
        elif not frames and len(frame) > limits.max_header_bytes:
            error = FrameError("header_too_large", f"{len(frame)} bytes")
        else:
            frames.append(frame)
    if error is not None:
        frames = []
    return ident.bytes, frames, total, error
