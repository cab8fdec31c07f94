"""The reward-model role's server: requests from every rollout worker scored together in batches
(up to ``max_batch`` pairs per forward).

The socket, the rejection of malformed requests and the loop are
:class:`~streamrl.roles.batching_server.BatchingServer`'s; here: decode reward requests (prompt
and response texts), score them, reply to each request with its slice of the scores. A model
failure on a batch answers each of its requests with an error and goes on.
"""
from __future__ import annotations

from typing import Callable

from streamrl.roles.batching_server import BatchingServer
from streamrl.roles.reward_wire import ENDPOINT, LIMITS, decode_request, encode_reply

ScoreFn = Callable[[list[str], list[str]], list[float]]


class RewardServer(BatchingServer):
    """Serves ``score_fn`` over ZeroMQ; :meth:`serve_once` is one poll-read-score-reply round."""

    def __init__(self, score_fn: ScoreFn, bind: str = "tcp://127.0.0.1:*", max_batch: int = 256):
        super().__init__(ENDPOINT, LIMITS, bind, max_batch)
        self.score_fn = score_fn
        self.pairs = 0

    def serve_once(self, timeout_ms: int = 100) -> int:
        """Wait up to ``timeout_ms`` for requests, score what arrived, reply; returns pairs scored."""
        if not self.poll(timeout_ms):
            return 0
        batch = self.read_ready(decode_request, lambda req: len(req[1]))  # (ident, rid, prompts, responses)
        if not batch:
            return 0
        prompts = [p for _, _, ps, _ in batch for p in ps]
        responses = [r for _, _, _, rs in batch for r in rs]

        def scored() -> list[float]:
            scores = [float(x) for x in self.score_fn(prompts, responses)]
            if len(scores) != len(prompts):
                raise RuntimeError(f"reward model returned {len(scores)} scores for {len(prompts)} pairs")
            return scores

        scores, failure = self.score(scored, f"a batch of {len(prompts)} pairs")
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
        return {**self.base_metrics(), "reward/pairs": self.pairs}
