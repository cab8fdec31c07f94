"""What a rollout worker asks of the token-scoring roles once per batch: the reference's
log-probs (``ref_logprobs``) when ``placement.reference`` runs it as its own process, the
critic's values (``values``, ``critic_version``) when ``placement.critic`` does.

The worker calls :func:`trajectory_roles` once at start-up and the returned
:class:`TrajectoryRoles` once per finished batch, before sending it to the learner; with no
separate role configured it returns None and the worker does nothing extra.
"""
from __future__ import annotations

from typing import Callable

import torch
from tensordict import TensorDict

from streamrl.config import Config
from streamrl.roles.critic import ROLE as CRITIC, critic_role_configured
from streamrl.roles.reference import ROLE as REFERENCE, reference_role_configured
from streamrl.roles.token_client import TokenRoleClient
from streamrl.roles.token_wire import TOKEN_KEYS

ENDPOINT_WAIT_S = 600.0


class TrajectoryRoles:
    """Adds the role servers' per-token fields to a packed batch.

    Args:
        clients: role name -> client; ``reference`` fills ``ref_logprobs``, ``critic`` fills
            ``values`` and ``critic_version`` (it is sent the rewards too, to train on).
    """

    def __init__(self, clients: dict[str, TokenRoleClient]):
        self.clients = clients

    def __call__(self, td: TensorDict) -> TensorDict:
        fields = {k: td[k] for k in TOKEN_KEYS}
        if REFERENCE in self.clients:
            td["ref_logprobs"] = self.clients[REFERENCE](fields)[0]
        if CRITIC in self.clients:
            values, version = self.clients[CRITIC]({**fields, "reward": td["reward"]})
            td["values"] = values
            td["critic_version"] = torch.full_like(td["traj_id"], version)
        return td

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


def trajectory_roles(cfg: Config, coord, timeout_s: float = 120.0) -> TrajectoryRoles | None:
    """The roles this run's workers call (waiting for their endpoints), or None when there is none.

    ``coord`` is the worker's :class:`~streamrl.coord.coordinator.Coordinator`: each client reads
    the endpoint through it again after a timeout, so a restarted server is found.
    """
    roles = [REFERENCE] if reference_role_configured(cfg) else []
    roles += [CRITIC] if critic_role_configured(cfg) else []
    if not roles:
        return None
    clients = {}
    for role in roles:
        coord.wait_endpoint(role, timeout_s=ENDPOINT_WAIT_S)
        resolve: Callable[[], str | None] = lambda r=role: coord.get_endpoint(r)  # noqa: E731
        clients[role] = TokenRoleClient(role, resolve, timeout_s=timeout_s)
    return TrajectoryRoles(clients)
