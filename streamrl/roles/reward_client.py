"""A rollout worker's handle on the reward-model role: the same callable as an in-process
reward model, ``(prompts: list[str], responses: list[str]) -> list[float]``, served remotely.

Delivery is the shared :class:`~streamrl.roles.dealer.RoleDealer`: one request in flight; no
reply within ``timeout_s`` -> sent again on a fresh socket to the endpoint read anew (the
server may have been restarted on another port and republished it); scoring is a pure
function of the texts, so a resend is harmless and a late reply to an earlier attempt is
recognised by its id and dropped. After ``attempts`` silent tries the call raises
:class:`RewardServerTimeout`, naming the endpoint.
"""
from __future__ import annotations

from typing import Callable

from streamrl.roles.dealer import RoleDealer, RoleServerError, RoleServerTimeout
from streamrl.roles.reward_wire import ENDPOINT, decode_reply, encode_request


class RewardServerTimeout(RoleServerTimeout):
    """The reward server gave no reply in time (it is down, overloaded, or unreachable)."""


class RewardServerError(RoleServerError):
    """The reward server answered with an error (its model failed on the batch) or garbage."""


class RewardClient(RoleDealer):
    """Scores batches on the reward server found through ``resolve``.

    Args:
        resolve: the server's endpoint, or a function returning it now (None = not published
            yet), e.g. ``lambda: coord.get_endpoint("reward")``; called again after a timeout.
        timeout_s: seconds to wait for one reply.
        attempts: tries (fresh socket + endpoint read each) before :class:`RewardServerTimeout`.
    """

    def __init__(self, resolve: str | Callable[[], str | None], timeout_s: float = 60.0, attempts: int = 3):
        super().__init__(ENDPOINT, resolve, timeout_s, attempts, RewardServerTimeout, RewardServerError)

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        """Scores ``[B]`` of the pairs, from the server."""
        if not prompts:
            return []
        rid = self.next_id()
        scores = self.request(rid, encode_request(rid, prompts, responses), decode_reply,
                              f"a request of {len(prompts)} pairs")
        if len(scores) != len(prompts):
            raise RewardServerError(f"reward server at {self.endpoint} returned {len(scores)} scores "
                                    f"for {len(prompts)} pairs")
        return scores
