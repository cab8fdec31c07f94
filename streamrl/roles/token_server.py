"""The server of a token-scoring role (reference, critic): requests from every rollout worker
answered together in batches.

The socket, the rejection of malformed requests and the loop are
:class:`~streamrl.roles.batching_server.BatchingServer`'s (the reward role's too), with the token
wire's limits: whatever has arrived when the model becomes free is scored in one call of
``score_fn`` (up to ``max_trajectories``), and each request gets its own slice of the values
back; a failure of ``score_fn`` answers each request of the batch with an error and goes on.
"""
from __future__ import annotations

from typing import Callable

import torch

from streamrl.roles.batching_server import BatchingServer
from streamrl.roles.token_wire import LIMITS, decode_request, encode_reply

# fields of the merged batch -> (values [R], version of the model that computed them)
ScoreFn = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, int]]


def merge_requests(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One packed batch from several requests (keys every part carries, concatenated)."""
    keys = [k for k in parts[0] if all(k in p for p in parts)]
    return {k: torch.cat([p[k] for p in parts]) for k in keys}


class TokenRoleServer(BatchingServer):
    """Serves ``score_fn`` for ``role`` over ZeroMQ; :meth:`serve_once` is one round."""

    def __init__(self, role: str, score_fn: ScoreFn, vocab_size: int, bind: str = "tcp://127.0.0.1:*",
                 max_trajectories: int = 256):
        super().__init__(role, LIMITS, bind, max_trajectories)
        self.score_fn, self.vocab_size = score_fn, vocab_size
        self.trajectories = self.tokens = 0

    def serve_once(self, timeout_ms: int = 100) -> int:
        """Wait up to ``timeout_ms`` for requests, score what arrived, reply; returns trajectories scored."""
        if not self.poll(timeout_ms):
            return 0
        batch = self.read_ready(lambda frames: decode_request(self.role, frames, self.vocab_size),
                                lambda req: int(req[1]["prompt_lens"].numel()))  # (ident, rid, fields)
        if not batch:
            return 0
        merged = merge_requests([f for _, _, f in batch])
        n_resp = int(merged["response_tokens"].numel())

        def scored() -> tuple[torch.Tensor, int]:
            values, version = self.score_fn(merged)
            if values.shape != (n_resp,):
                raise RuntimeError(f"{self.role} returned {tuple(values.shape)} values for {n_resp} tokens")
            return values, version

        out, failure = self.score(scored, f"a batch of {len(merged['prompt_lens'])} trajectories")
        values, version = out if failure is None else (None, 0)
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
        """``<role>/*`` counters for the monitor (throughput: trajectories, tokens and ``score_s``)."""
        r = self.role
        return {**self.base_metrics(), f"{r}/trajectories": self.trajectories, f"{r}/tokens": self.tokens}
