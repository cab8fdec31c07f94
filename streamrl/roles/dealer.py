"""The request/reply loop every role client shares (reward, reference, critic).

One DEALER socket, one request in flight. A request that gets no reply within ``timeout_s``
is sent again on a fresh socket to the endpoint read anew (the server may have been restarted
on another port and republished it); a late reply to an earlier attempt is recognised by its
id and dropped. After ``attempts`` silent tries the call raises the client's timeout error,
naming the endpoint.

Socket invariants (set in :meth:`RoleDealer._connect`): LINGER = 0 (an unanswered request
dies with its socket), IMMEDIATE = 1 (nothing queues toward a peer that is not connected, so
a resend never doubles up on a dead pipe), RCVHWM/SNDHWM = 16.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable

import zmq

from streamrl.security import apply_client_keys, load_curve_keys
from streamrl.transport.codec import FrameError

log = logging.getLogger(__name__)
RESOLVE_POLL_S = 0.2  # how often an unpublished endpoint is read again (a Redis GET)
# frames -> (request id, payload, error string or None); raises FrameError on garbage
Decode = Callable[[list], tuple[int, Any, str | None]]


class RoleServerTimeout(TimeoutError):
    """A role server gave no reply in time (it is down, overloaded, or unreachable)."""


class RoleServerError(RuntimeError):
    """A role server answered with an error (its model failed on the batch) or garbage."""


class RoleDealer:
    """Sends requests to the ``role`` server found through ``resolve`` and waits for their replies.

    Args:
        role: the server's name in messages (``reward``, ``reference``, ``critic``).
        resolve: the endpoint, or a function returning it now (None = not published yet);
            called again after a timeout.
        timeout_s: seconds to wait for one reply; attempts: tries before ``timeout_error``.
        timeout_error, server_error: the exception classes raised (subclasses of the above).
    """

    def __init__(self, role: str, resolve: str | Callable[[], str | None], timeout_s: float = 60.0,
                 attempts: int = 3, timeout_error: type[RoleServerTimeout] = RoleServerTimeout,
                 server_error: type[RoleServerError] = RoleServerError):
        if timeout_s <= 0 or attempts < 1:
            raise ValueError(f"timeout_s = {timeout_s}, attempts = {attempts}: must be > 0 and >= 1")
        self.role = role
        self._resolve = (lambda: resolve) if isinstance(resolve, str) else resolve
        self.timeout_s, self.attempts = timeout_s, attempts
        self.timeout_error, self.server_error = timeout_error, server_error
        self.ctx = zmq.Context()
        self.sock: zmq.Socket | None = None
        self.endpoint: str | None = None
        self._ids = itertools.count(1)
        self.resends = 0

    def next_id(self) -> int:
        return next(self._ids)

    def _connect(self) -> None:
        self._drop_socket()
        self.endpoint = self._resolve()
        if not self.endpoint:
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RCVHWM, 16)
        sock.setsockopt(zmq.SNDHWM, 16)
        apply_client_keys(sock, load_curve_keys("client"))
        sock.connect(self.endpoint)
        self.sock = sock

    def _drop_socket(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None

    def _attempt(self, rid: int, frames: list, decode: Decode, deadline: float) -> tuple[bool, Any]:
        """Send once and wait for the reply to ``rid`` until ``deadline``: ``(True, payload)`` or
        ``(False, None)`` on timeout."""
        while self.sock is None:  # no endpoint published (yet): read it again until the deadline
            self._connect()
            if self.sock is None:
                if time.monotonic() >= deadline:
                    return False, None
                time.sleep(RESOLVE_POLL_S)
        while not self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLOUT):
            if time.monotonic() >= deadline:  # IMMEDIATE: not connected (yet)
                return False, None
        self.sock.send_multipart(frames, copy=False)
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.sock.poll(left_ms, zmq.POLLIN):
                return False, None
            try:
                got, payload, error = decode(self.sock.recv_multipart(copy=False))
            except FrameError as e:
                raise self.server_error(f"{self.role} server at {self.endpoint} sent a malformed reply ({e})") from None
            if got != rid:
                continue  # a late answer to an attempt we already gave up on
            if error is not None:
                raise self.server_error(f"{self.role} server at {self.endpoint} failed on the batch: {error}")
            return True, payload

    def request(self, rid: int, frames: list, decode: Decode, what: str) -> Any:
        """The payload of the reply to request ``rid`` (``frames``), resending as described above;
        ``what`` describes the request in the timeout error."""
        for attempt in range(self.attempts):
            ok, payload = self._attempt(rid, frames, decode, time.monotonic() + self.timeout_s)
            if ok:
                return payload
            log.warning("no reply from the %s server at %s within %.1f s (attempt %d/%d); reconnecting",
                        self.role, self.endpoint, self.timeout_s, attempt + 1, self.attempts)
            self.resends += 1
            self._drop_socket()  # the next attempt reads the endpoint again
        raise self.timeout_error(f"{self.role} server at {self.endpoint or '(endpoint not published)'} gave no reply "
                                 f"to {what} within {self.timeout_s:.1f} s, {self.attempts} attempts")

    def close(self) -> None:
        self._drop_socket()
        self.ctx.term()
