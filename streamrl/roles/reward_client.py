"""A rollout worker's handle on the reward-model role: the same callable as an in-process
reward model, ``(prompts: list[str], responses: list[str]) -> list[float]``, served remotely.

One DEALER socket, one request in flight. A request that gets no reply within ``timeout_s``
is sent again on a fresh socket to the endpoint read anew (the server may have been restarted
on another port and republished it); scoring is a pure function of the texts, so a resend is
harmless and a late reply to an earlier attempt is recognised by its id and dropped. After
``attempts`` silent tries the call raises :class:`RewardServerTimeout`, naming the endpoint.

Socket invariants (set in :meth:`RewardClient._connect`): LINGER = 0 (an unanswered request
dies with its socket), IMMEDIATE = 1 (nothing queues toward a peer that is not connected, so
a resend never doubles up on a dead pipe), RCVHWM/SNDHWM = 16.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Callable

import zmq

from streamrl.roles.reward_wire import decode_reply, encode_request
from streamrl.security import apply_client_keys, load_curve_keys
from streamrl.transport.codec import FrameError

log = logging.getLogger(__name__)
RESOLVE_POLL_S = 0.2  # how often an unpublished endpoint is read again (a Redis GET)


class RewardServerTimeout(TimeoutError):
    """The reward server gave no reply in time (it is down, overloaded, or unreachable)."""


class RewardServerError(RuntimeError):
    """The reward server answered with an error (its model failed on the batch) or garbage."""


class RewardClient:
    """Scores batches on the reward server found through ``resolve``.

    Args:
        resolve: the server's endpoint, or a function returning it now (None = not published
            yet), e.g. ``lambda: coord.get_endpoint("reward")``; called again after a timeout.
        timeout_s: seconds to wait for one reply.
        attempts: tries (fresh socket + endpoint read each) before :class:`RewardServerTimeout`.
    """

    def __init__(self, resolve: str | Callable[[], str | None], timeout_s: float = 60.0, attempts: int = 3):
        if timeout_s <= 0 or attempts < 1:
            raise ValueError(f"timeout_s = {timeout_s}, attempts = {attempts}: must be > 0 and >= 1")
        self._resolve = (lambda: resolve) if isinstance(resolve, str) else resolve
        self.timeout_s, self.attempts = timeout_s, attempts
        self.ctx = zmq.Context()
        self.sock: zmq.Socket | None = None
        self.endpoint: str | None = None
        self._ids = itertools.count(1)
        self.resends = 0

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

    def _attempt(self, rid: int, frames: list, deadline: float) -> list[float] | None:
        """Send once and wait for the reply to ``rid`` until ``deadline``; None on timeout."""
        while self.sock is None:  # no endpoint published (yet): read it again until the deadline
            self._connect()
            if self.sock is None:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(RESOLVE_POLL_S)
        while not self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLOUT):
            if time.monotonic() >= deadline:  # IMMEDIATE: not connected (yet)
                return None
        self.sock.send_multipart(frames, copy=False)
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.sock.poll(left_ms, zmq.POLLIN):
                return None
            try:
                got, scores, error = decode_reply(self.sock.recv_multipart(copy=False))
            except FrameError as e:
                raise RewardServerError(f"reward server at {self.endpoint} sent a malformed reply ({e})") from None
            if got != rid:
                continue  # a late answer to an attempt we already gave up on
            if error is not None:
                raise RewardServerError(f"reward server at {self.endpoint} failed on the batch: {error}")
            return scores

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        """Scores ``[B]`` of the pairs, from the server."""
        if not prompts:
            return []
        rid = next(self._ids)
        frames = encode_request(rid, prompts, responses)
        for attempt in range(self.attempts):
            scores = self._attempt(rid, frames, time.monotonic() + self.timeout_s)
            if scores is not None:
                if len(scores) != len(prompts):
                    raise RewardServerError(f"reward server at {self.endpoint} returned {len(scores)} scores "
                                            f"for {len(prompts)} pairs")
                return scores
            log.warning("no reply from the reward server at %s within %.1f s (attempt %d/%d); reconnecting",
                        self.endpoint, self.timeout_s, attempt + 1, self.attempts)
            self.resends += 1
            self._drop_socket()  # the next attempt reads the endpoint again
        raise RewardServerTimeout(f"reward server at {self.endpoint or '(endpoint not published)'} gave no reply "
                                  f"to a request of {len(prompts)} pairs within {self.timeout_s:.1f} s, "
                                  f"{self.attempts} attempts")

    def close(self) -> None:
        self._drop_socket()
        self.ctx.term()
