"""The server loop of a token-scoring role (reference, critic): one ROUTER socket, requests from
every rollout worker answered together in batches.

Same socket contract as the reward role (:mod:`streamrl.roles.reward_server`), with the token
wire's limits: whatever has arrived when the
model becomes free is scored in one call of ``score_fn`` (up to ``max_trajectories``), and
each request gets its own slice of the values back. A malformed request is rejected, counted
by reason and logged at most once per reason per minute; a failure of ``score_fn`` answers
each request of the batch with an error and the loop goes on.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable

import torch
import zmq

from streamrl.roles.token_wire import LIMITS, decode_request, encode_reply
from streamrl.security import apply_server_keys, load_curve_keys
from streamrl.transport.codec import FrameError
from streamrl.transport.sockets import recv_bounded

log = logging.getLogger(__name__)
# fields of the merged batch -> (values [R], version of the model that computed them)
ScoreFn = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, int]]
LOG_EVERY_S = 60.0


def merge_requests(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One packed batch from several requests (keys every part carries, concatenated)."""
    keys = [k for k in parts[0] if all(k in p for p in parts)]
    return {k: torch.cat([p[k] for p in parts]) for k in keys}


class TokenRoleServer:
    """Serves ``score_fn`` for ``role`` over ZeroMQ; :meth:`serve_once` is one round."""

    def __init__(self, role: str, score_fn: ScoreFn, vocab_size: int, bind: str = "tcp://127.0.0.1:*",
                 max_trajectories: int = 256):
        if max_trajectories < 1:
            raise ValueError(f"max_trajectories = {max_trajectories}: must be >= 1")
        self.role, self.score_fn, self.vocab_size = role, score_fn, vocab_size
        self.max_trajectories = max_trajectories
        self.ctx = zmq.Context()
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.RCVHWM, 64)
        sock.setsockopt(zmq.SNDHWM, 64)
        sock.setsockopt(zmq.MAXMSGSIZE, LIMITS.max_message_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        apply_server_keys(sock, load_curve_keys("server"))
        sock.bind(bind)
        self.sock = sock
        self.endpoint: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests = self.trajectories = self.tokens = self.batches = self.errors = 0
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

    def _read_ready(self) -> list[tuple[bytes, int, dict[str, torch.Tensor]]]:
        batch, n = [], 0
        while n < self.max_trajectories:
            try:
                ident, frames, _, error = recv_bounded(self.sock, LIMITS)
            except zmq.Again:
                break
            try:
                if error is not None:
                    raise error
                rid, fields = decode_request(self.role, frames, self.vocab_size)
            except FrameError as e:
                self._reject(e)
                continue
            batch.append((ident, rid, fields))
            n += int(fields["prompt_lens"].numel())
        return batch

    def serve_once(self, timeout_ms: int = 100) -> int:
        """Wait up to ``timeout_ms`` for requests, score what arrived, reply; returns trajectories scored."""
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            return 0
        batch = self._read_ready()
        if not batch:
            return 0
        merged = merge_requests([f for _, _, f in batch])
        n_resp = int(merged["response_tokens"].numel())
        t0 = time.perf_counter()
        try:
            values, version = self.score_fn(merged)
            if values.shape != (n_resp,):
                raise RuntimeError(f"{self.role} returned {tuple(values.shape)} values for {n_resp} tokens")
            failure = None
        except Exception as e:  # noqa: BLE001 (a bad batch must not take the role down for every worker)
            log.exception("%s failed on a batch of %d trajectories", self.role, len(merged["prompt_lens"]))
            values, version, failure = None, 0, f"{type(e).__name__}: {e}"
            self.errors += 1
        self.score_s += time.perf_counter() - t0
        start = 0
        for ident, rid, fields in batch:
            r = int(fields["response_tokens"].numel())
            part = None if failure else values[start:start + r]
            start += r
            self.sock.send_multipart([ident, *encode_reply(self.role, rid, part, failure, version)], copy=False)
        self.requests += len(batch)
        self.trajectories += int(merged["prompt_lens"].numel())
        self.tokens += n_resp
        self.batches += 1
        return int(merged["prompt_lens"].numel())

    def metrics(self) -> dict[str, float]:
        """``<role>/*`` counters for the monitor (throughput: tokens and ``score_s``)."""
        r = self.role
        out = {f"{r}/requests": self.requests, f"{r}/trajectories": self.trajectories, f"{r}/tokens": self.tokens,
               f"{r}/batches": self.batches, f"{r}/errors": self.errors, f"{r}/score_s": self.score_s,
               f"{r}/rejected": sum(self.rejected.values())}
        out.update({f"{r}/rejected_{k}": v for k, v in self.rejected.items()})
        return out

    def serve(self, should_stop: Callable[[], bool], on_tick: Callable[[], None] | None = None) -> None:
        """Serve until ``should_stop()``; ``on_tick`` runs between rounds (metrics, training)."""
        while not should_stop():
            self.serve_once()
            if on_tick is not None:
                on_tick()

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

