"""A rollout worker's handle on a token-scoring role (reference, critic): sends a packed batch's
tokens, gets one float per response token back (see :mod:`streamrl.roles.token_wire`).

Same delivery contract as the reward client (:mod:`streamrl.roles.reward_client`): one DEALER
socket, one request in flight; no reply within ``timeout_s`` -> the request is sent again on a
fresh socket to the endpoint read anew (a restarted server republishes on a new port); a late
reply to an earlier attempt is recognised by its id and dropped; after ``attempts`` silent
tries :class:`RoleServerTimeout` names the endpoint. Scoring is idempotent for the reference;
for the critic a resend may train it twice on one batch, which only weighs that batch more.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Callable

import torch
import zmq

from streamrl.roles.token_wire import decode_reply, encode_request
from streamrl.security import apply_client_keys, load_curve_keys
from streamrl.transport.codec import FrameError

log = logging.getLogger(__name__)
RESOLVE_POLL_S = 0.2


class RoleServerTimeout(TimeoutError):
    """A role server gave no reply in time (down, overloaded or unreachable)."""


class RoleServerError(RuntimeError):
    """A role server answered with an error (its model failed on the batch) or garbage."""


class TokenRoleClient:
    """Scores packed batches on the ``role`` server found through ``resolve``.

    Args:
        role: ``reference`` or ``critic`` (the message kinds and the endpoint name).
        resolve: the endpoint, or a function returning it now (None = not published yet).
        timeout_s: seconds to wait for one reply; attempts: tries before :class:`RoleServerTimeout`.
    """

    def __init__(self, role: str, resolve: str | Callable[[], str | None], timeout_s: float = 60.0,
                 attempts: int = 3):
        if timeout_s <= 0 or attempts < 1:
            raise ValueError(f"timeout_s = {timeout_s}, attempts = {attempts}: must be > 0 and >= 1")
        self.role = role
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
        sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queues toward a peer that is not connected
        sock.setsockopt(zmq.RCVHWM, 16)
        sock.setsockopt(zmq.SNDHWM, 16)
        apply_client_keys(sock, load_curve_keys("client"))
        sock.connect(self.endpoint)
        self.sock = sock

    def _drop_socket(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None

    def _attempt(self, rid: int, frames: list, deadline: float) -> tuple[torch.Tensor, int] | None:
        while self.sock is None:
            self._connect()
            if self.sock is None:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(RESOLVE_POLL_S)
        while not self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLOUT):
            if time.monotonic() >= deadline:
                return None
        self.sock.send_multipart(frames, copy=False)
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.sock.poll(left_ms, zmq.POLLIN):
                return None
            try:
                got, values, error, version = decode_reply(self.role, self.sock.recv_multipart(copy=False))
            except FrameError as e:
                raise RoleServerError(f"{self.role} server at {self.endpoint} sent a malformed reply ({e})") from None
            if got != rid:
                continue
            if error is not None:
                raise RoleServerError(f"{self.role} server at {self.endpoint} failed on the batch: {error}")
            return values, version

    def __call__(self, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """``(values [R] float32, server model version)`` for the batch's response tokens."""
        rid = next(self._ids)
        frames = encode_request(self.role, rid, fields)
        n_resp = int(fields["response_tokens"].numel())
        for attempt in range(self.attempts):
            got = self._attempt(rid, frames, time.monotonic() + self.timeout_s)
            if got is not None:
                if got[0].shape != (n_resp,):
                    raise RoleServerError(f"{self.role} server at {self.endpoint} returned {tuple(got[0].shape)} "
                                          f"values for {n_resp} response tokens")
                return got
            log.warning("no reply from the %s server at %s within %.1f s (attempt %d/%d); reconnecting",
                        self.role, self.endpoint, self.timeout_s, attempt + 1, self.attempts)
            self.resends += 1
            self._drop_socket()
        raise RoleServerTimeout(f"{self.role} server at {self.endpoint or '(endpoint not published)'} gave no reply "
                                f"within {self.timeout_s:.1f} s, {self.attempts} attempts")

    def close(self) -> None:
        self._drop_socket()
        self.ctx.term()
