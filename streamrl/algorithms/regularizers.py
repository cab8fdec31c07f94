"""Regularisers added to the policy loss: KL to a frozen reference policy and entropy bonus."""
from __future__ import annotations

import torch
import torch.nn.functional as F

KL_ESTIMATORS = ("k1", "k3")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's estimators).

    ``k1 = log pi - log pi_ref`` (unbiased, high variance, can be negative);
    ``k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1`` (unbiased, >= 0).

    Args:
        logp: [B, T] with gradient; ref_logp: [B, T] (no gradient).
    Returns:
        [B, T] per-token penalty.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator {kind!r} unknown; known: {KL_ESTIMATORS}")
    d = ref_logp.detach() - logp
    if kind == "k1":
        return -d
    return torch.exp(d) - d - 1.0


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution.

    Args:
        logits: [B, T, V]. Returns: [B, T] (nats).
    """
    lp = F.log_softmax(logits.float() / temperature, dim=-1)
    return -(lp.exp() * lp).sum(-1)
