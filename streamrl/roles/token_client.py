"""A rollout worker's handle on a token-scoring role (reference, critic): sends a packed batch's
tokens, gets one float per response token back (see :mod:`streamrl.roles.token_wire`).

Delivery (resend on timeout to the endpoint read anew, late replies dropped) is the shared
:class:`~streamrl.roles.dealer.RoleDealer`. Scoring is idempotent for the reference; for the
critic a resend may train it twice on one batch, which only weighs that batch more.
"""
from __future__ import annotations

from typing import Callable

import torch

from streamrl.roles.dealer import RoleDealer, RoleServerError, RoleServerTimeout
from streamrl.roles.token_wire import decode_reply, encode_request

__all__ = ["TokenRoleClient", "RoleServerError", "RoleServerTimeout"]


class TokenRoleClient(RoleDealer):
    """Scores packed batches on the ``role`` server found through ``resolve`` (see :class:`RoleDealer`)."""

    def __init__(self, role: str, resolve: str | Callable[[], str | None], timeout_s: float = 60.0,
                 attempts: int = 3):
        super().__init__(role, resolve, timeout_s, attempts)

    def _decode(self, frames: list):
        rid, values, error, version = decode_reply(self.role, frames)
        return rid, (values, version), error

    def __call__(self, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """``(values [R] float32, server model version)`` for the batch's response tokens."""
        rid = self.next_id()
        n_resp = int(fields["response_tokens"].numel())
        values, version = self.request(rid, encode_request(self.role, rid, fields), self._decode,
                                       f"a batch of {len(fields['prompt_lens'])} trajectories")
        if values.shape != (n_resp,):
            raise RoleServerError(f"{self.role} server at {self.endpoint} returned {tuple(values.shape)} values "
                                  f"for {n_resp} response tokens")
        return values, version
