"""What every role server shares: one ROUTER socket, requests from all rollout workers read
together, malformed ones rejected and counted, a serve loop.

Socket invariants (:func:`role_socket`):
  * ROUTER, one pipe per worker; RCVHWM = 64 requests per worker (a worker has one request
    in flight, resends included), SNDHWM = 64 replies per worker; a reply to a worker that has
    gone is dropped, never blocks the server (ROUTER semantics).
  * MAXMSGSIZE = the wire limit: libzmq drops a peer announcing a bigger frame.
  * LINGER = 0: undelivered replies are discarded on close (clients resend on timeout).

Why batch across workers: a model's forward costs about the same for 8 requests as for 1 on a
GPU, and several workers finish their batches at nearly the same moment; whatever has arrived
when the model becomes free is scored in one call. A malformed request is rejected, counted by
reason in ``rejected`` and logged at most once per reason per minute; the loop goes on.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Callable

import zmq

from streamrl.security import apply_server_keys, load_curve_keys, stop_authenticator
from streamrl.transport.codec import FrameError, Limits
from streamrl.transport.sockets import recv_bounded

log = logging.getLogger(__name__)
LOG_EVERY_S = 60.0  # a flood of bad frames logs one line per reason per minute


def role_socket(ctx: zmq.Context, bind: str, limits: Limits) -> zmq.Socket:
    """A role server's ROUTER socket bound to ``bind`` (``tcp://host:*`` picks a port)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 64)
    sock.setsockopt(zmq.SNDHWM, 64)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
    sock.setsockopt(zmq.LINGER, 0)
    apply_server_keys(sock, load_curve_keys("server"))  # CURVE when configured (see streamrl.security)
    sock.bind(bind)
    return sock


class BatchingServer:
    """Socket, counters and loop of a role server; subclasses implement :meth:`serve_once`.

    Args:
        role: the role's name (log lines and metric prefixes).
        limits: the role wire's frame limits.
        bind: ZeroMQ address to bind.
        max_items: a batch stops growing once it holds this many items (pairs, trajectories).
    """

    def __init__(self, role: str, limits: Limits, bind: str, max_items: int):
        if max_items < 1:
            raise ValueError(f"{role} server: max batch size = {max_items}: must be >= 1")
        self.role, self.limits, self.max_items = role, limits, max_items
        self.ctx = zmq.Context()
        self.sock = role_socket(self.ctx, bind, limits)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests = self.batches = self.errors = 0
        self.rejected: Counter[str] = Counter()
        self.score_s = 0.0
        self._last_logged: dict[str, float] = {}

    def _reject(self, error: FrameError) -> None:
        self.rejected[error.reason] += 1
        now = time.monotonic()
        if now - self._last_logged.get(error.reason, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last_logged[error.reason] = now
            log.warning("rejected a %s request (%s; %d so far for this reason)", self.role, error,
                        self.rejected[error.reason])

    def read_ready(self, decode: Callable[[list], tuple], size: Callable[[tuple], int]) -> list[tuple]:
        """Every well-formed request waiting now as ``(ident, *decode(frames))``, until the batch
        holds ``max_items`` (``size`` of each decoded request); malformed ones are rejected."""
        batch, n = [], 0
        while n < self.max_items:
            try:
                ident, frames, _, error = recv_bounded(self.sock, self.limits)
            except zmq.Again:
                break
            try:
                if error is not None:
                    raise error
                decoded = decode(frames)
            except FrameError as e:
                self._reject(e)
                continue
            batch.append((ident, *decoded))
            n += size(decoded)
        return batch

    def poll(self, timeout_ms: int) -> bool:
        """True when a request is waiting (after up to ``timeout_ms``)."""
        return bool(self.sock.poll(timeout_ms, zmq.POLLIN))

    def score(self, fn: Callable[[], Any], what: str) -> tuple[Any, str | None]:
        """``(fn(), None)`` or ``(None, "Type: message")`` when it raised: a bad batch answers its
        requests with the error and must not take the role down for every worker."""
        t0 = time.perf_counter()
        try:
            return fn(), None
        except Exception as e:  # noqa: BLE001
            log.exception("%s failed on %s", self.role, what)
            self.errors += 1
            return None, f"{type(e).__name__}: {e}"
        finally:
            self.score_s += time.perf_counter() - t0

    def base_metrics(self) -> dict[str, float]:
        """``<role>/requests, batches, errors, score_s, rejected[_reason]`` counters for the monitor."""
        r = self.role
        out = {f"{r}/requests": self.requests, f"{r}/batches": self.batches, f"{r}/errors": self.errors,
               f"{r}/score_s": self.score_s, f"{r}/rejected": sum(self.rejected.values())}
        out.update({f"{r}/rejected_{k}": v for k, v in self.rejected.items()})
        return out

    def serve_once(self, timeout_ms: int = 100) -> int:
        raise NotImplementedError

    def serve(self, should_stop: Callable[[], bool], on_tick: Callable[[], None] | None = None) -> None:
        """Serve until ``should_stop()``; ``on_tick`` runs between rounds (heartbeats, metrics, training)."""
        while not should_stop():
            self.serve_once()
            if on_tick is not None:
                on_tick()

    def close(self) -> None:
        self.sock.close(0)
        stop_authenticator(self.ctx)  # a live ZAP thread would keep ctx.term() waiting
        self.ctx.term()
