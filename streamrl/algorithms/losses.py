"""Policy losses with off-policy correction for stale, asynchronously generated samples.

Notation (all [B, T] over next-token positions, masked by ``mask``):
    logp        log pi_theta(token), with gradient
    prox_logp   log pi_prox(token): the learner's policy before this update (no gradient)
    behav_logp  log mu(token): the (possibly stale) policy that sampled the token

Decoupled PPO (AReaL): the PPO ratio is taken against the proximal policy,
``r = pi_theta / pi_prox``, while the off-policy gap ``pi_prox / mu`` is corrected by a
truncated importance weight ``w = min(pi_prox / mu, C)`` (truncated IS, Espeholt et al.).
With one optimizer step per batch, pi_prox == pi_theta numerically, r == 1 and the
correction is exactly the truncated IS weight on the policy gradient.
"""
from __future__ import annotations

import torch


def masked_token_mean(x: torch.Tensor, mask: torch.Tensor, denom: float | None = None) -> torch.Tensor:
    """Sum of ``x * mask`` over all tokens divided by ``denom`` (default: ``mask.sum()``)."""
    d = mask.sum().clamp(min=1.0) if denom is None else denom
    return (x * mask).sum() / d


def ppo_clip_tis_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    tis_cap: float | None = 2.0,
    denom: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip (with clip-higher) on the proximal ratio, times a truncated IS weight.

    Args:
        logp, prox_logp, behav_logp: [B, T] log-probabilities (see module docstring).
        advantages: [B] per-trajectory (broadcast over tokens) or [B, T] per-token.
        mask: [B, T] 1.0 on tokens that take part in the loss.
        tis_cap: truncation C of ``pi_prox / mu``; None disables the correction.
        denom: token count the sum is divided by (global across ranks for token-mean).

    Returns:
        (loss, stats) with stats ``clip_frac``, ``is_weight_mean``, ``is_truncated_frac``.
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - prox_logp.detach())
    surr = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv)
    if tis_cap is not None:
        raw_w = torch.exp((prox_logp - behav_logp).detach().clamp(max=20.0))
        w = raw_w.clamp(max=tis_cap)
    else:
        raw_w = w = torch.ones_like(logp)
    loss = -masked_token_mean(surr * w, mask, denom)
    with torch.no_grad():
        m = mask.bool()
        clipped = ((ratio < 1 - clip_low) & (adv < 0)) | ((ratio > 1 + clip_high) & (adv > 0))
        n = max(int(m.sum()), 1)
        stats = {
            "clip_frac": float(clipped[m].sum()) / n,
            "is_weight_mean": float(raw_w[m].mean()) if m.any() else 1.0,
            "is_truncated_frac": float((raw_w[m] > (tis_cap or float("inf"))).sum()) / n,
        }
    return loss, stats
