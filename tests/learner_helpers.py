"""Learner helpers only tests use: eval-mode log-probs, the EMA router state, and the walking
skeleton's PPO-clip + truncated-IS loss. (The packed step's gradient and the padded forward
are in :mod:`streamrl.bench.padded_reference`, which the learner bench shares.)"""
from __future__ import annotations

import torch

from streamrl.algorithms.losses import Normalizers, PolicyLossSpec, policy_loss
from streamrl.bench.padded_reference import padded_forward
from streamrl.learner.logprobs import token_logprobs
from streamrl.learner.trainer import Trainer


def ppo_clip_tis_loss(logp: torch.Tensor, prox_logp: torch.Tensor, behav_logp: torch.Tensor,
                      advantages: torch.Tensor, mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.28,
                      tis_cap: float | None = 2.0, denom: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip (with clip-higher) on the proximal ratio times a truncated IS weight (None: no
    correction), token-mean over ``denom`` tokens: :func:`policy_loss` in its simplest form.
    logp, prox_logp, behav_logp, mask: [B, T]; advantages: [B] or [B, T]."""
    spec = PolicyLossSpec(clip_low=clip_low, clip_high=clip_high, is_mode="token-tis" if tis_cap is not None else "none",
                          is_cap=tis_cap or 1.0)
    return policy_loss(logp, prox_logp, behav_logp, advantages, mask, spec, Normalizers(num_tokens=denom))


def evaluate_logprobs(tr: Trainer, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Next-token log-probs [B, T-1] of ``tr``'s model on padded ``ids``/``attn`` [B, T] in eval
    mode: deterministic routing, no dropout."""
    tr.model.eval()
    with torch.no_grad():
        logits, _ = padded_forward(tr, tr.model, ids.to(tr.device), attn.to(tr.device))
    tr.model.train()
    return token_logprobs(logits, ids.to(tr.device), tr.cfg.rollout.temperature)


def router_ema_state(tr: Trainer) -> dict[str, torch.Tensor]:
    """``{param_name: full EMA router tensor}`` of ``tr`` (empty when EMA is off)."""
    return tr.router.ema_state() if tr.router.ema else {}
