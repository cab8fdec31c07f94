"""The reward-model role's server loop: one ROUTER socket, requests from every rollout worker
scored together in batches.

Why batch across workers: a reward model's forward costs about the same for 8 pairs as for 1
on a GPU, and several workers finish their batches at nearly the same moment; whatever has
arrived when the model becomes free is scored in one forward (up to ``max_batch`` pairs).

Socket invariants (set in :func:`reward_socket`):
  * ROUTER, one pipe per worker; RCVHWM = 64 requests per worker (a worker has one request
    in flight, resends included), SNDHWM = 64 replies per worker; a reply to a worker that has
    gone is dropped, never blocks the server (ROUTER semantics).
  * MAXMSGSIZE = the wire limit: libzmq drops a peer announcing a bigger frame.
  * LINGER = 0: undelivered replies are discarded on close (clients resend on timeout).

A malformed request (bad frames, bad texts) is rejected, counted by reason in
``rejected``, logged (at most once per reason per minute), and the loop goes on. A model
failure on a batch answers each of its requests with an error and goes on.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable

import zmq

from streamrl.roles.reward_wire import LIMITS, decode_request, encode_reply
from streamrl.security import apply_server_keys, load_curve_keys
from streamrl.transport.codec import FrameError
from streamrl.transport.sockets import recv_bounded

log = logging.getLogger(__name__)
ScoreFn = Callable[[list[str], list[str]], list[float]]
LOG_EVERY_S = 60.0  # a flood of bad frames logs one line per reason per minute


def reward_socket(ctx: zmq.Context, bind: str) -> zmq.Socket:
    """The reward server's ROUTER socket bound to ``bind`` (``tcp://host:*`` picks a port)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 64)
    sock.setsockopt(zmq.SNDHWM, 64)
    sock.setsockopt(zmq.MAXMSGSIZE, LIMITS.max_message_bytes)
    sock.setsockopt(zmq.LINGER, 0)
    apply_server_keys(sock, load_curve_keys("server"))  # CURVE when configured (see streamrl.security)
    sock.bind(bind)
    return sock


class RewardServer:
    """Serves ``score_fn`` over ZeroMQ; :meth:`serve_once` is one poll-read-score-reply round."""

    def __init__(self, score_fn: ScoreFn, bind: str = "tcp://127.0.0.1:*", max_batch: int = 256):
        if max_batch < 1:
            raise ValueError(f"max_batch = {max_batch}: must be >= 1")
        self.score_fn, self.max_batch = score_fn, max_batch
        self.ctx = zmq.Context()
        self.sock = reward_socket(self.ctx, bind)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests = self.pairs = self.batches = self.errors = 0
        self.rejected: Counter[str] = Counter()
        self.score_s = 0.0
        self._last_logged: dict[str, float] = {}

    def _reject(self, error: FrameError) -> None:
        self.rejected[error.reason] += 1
        now = time.monotonic()
        if now - self._last_logged.get(error.reason, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last_logged[error.reason] = now
            log.warning("rejected a reward request (%s; %d so far for this reason)", error,
                        self.rejected[error.reason])

    def _read_ready(self) -> list[tuple[bytes, int, list[str], list[str]]]:
        """Every well-formed request waiting now, up to ``max_batch`` pairs (at least one request)."""
        batch, pairs = [], 0
        while pairs < self.max_batch:
            try:
                ident, frames, _, error = recv_bounded(self.sock, LIMITS)
            except zmq.Again:
                break
            try:
                if error is not None:
                    raise error
                rid, prompts, responses = decode_request(frames)
            except FrameError as e:
                self._reject(e)
                continue
            batch.append((ident, rid, prompts, responses))
            pairs += len(prompts)
        return batch

    def serve_once(self, timeout_ms: int = 100) -> int:
        """Wait up to ``timeout_ms`` for requests, score what arrived, reply; returns pairs scored."""
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            return 0
        batch = self._read_ready()
        if not batch:
            return 0
        prompts = [p for _, _, ps, _ in batch for p in ps]
        responses = [r for _, _, _, rs in batch for r in rs]
        t0 = time.perf_counter()
        try:
            scores = [float(x) for x in self.score_fn(prompts, responses)]
            if len(scores) != len(prompts):
                raise RuntimeError(f"reward model returned {len(scores)} scores for {len(prompts)} pairs")
            failure = None
        except Exception as e:  # noqa: BLE001 (a bad batch must not take the role down for every worker)
            log.exception("reward model failed on a batch of %d pairs", len(prompts))
            scores, failure = [], f"{type(e).__name__}: {e}"
            self.errors += 1
        self.score_s += time.perf_counter() - t0
        start = 0
        for ident, rid, ps, _ in batch:
            part = None if failure else scores[start:start + len(ps)]
            start += len(ps)
            self.sock.send_multipart([ident, *encode_reply(rid, part, failure)], copy=False)
        self.requests += len(batch)
        self.pairs += len(prompts)
        self.batches += 1
        return len(prompts)

    def metrics(self) -> dict[str, float]:
        """``reward/*`` counters for the monitor."""
        out = {"reward/requests": self.requests, "reward/pairs": self.pairs, "reward/batches": self.batches,
               "reward/errors": self.errors, "reward/score_s": self.score_s,
               "reward/rejected": sum(self.rejected.values())}
        out.update({f"reward/rejected_{k}": v for k, v in self.rejected.items()})
        return out

    def serve(self, should_stop: Callable[[], bool], on_tick: Callable[[], None] | None = None) -> None:
        """Serve until ``should_stop()``; ``on_tick`` runs between rounds (heartbeats, metrics)."""
        while not should_stop():
            self.serve_once()
            if on_tick is not None:
                on_tick()

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
