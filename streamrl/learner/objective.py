"""The learner's objective: which policy loss and regularisers a config selects.

``learner.loss`` names a preset; all share PPO-clip with clip-higher (``clip_low``,
``clip_high``) and optional dual-clip, and differ in the off-policy correction of the gap
between the proximal policy (the learner before this update) and the behaviour policy (the
stale rollout weights that sampled the tokens):

====================  ==========================================================================
loss                  correction
====================  ==========================================================================
grpo_no_correction    none: ratio to the proximal policy only (ignores staleness)
grpo_tis              token-level truncated IS ``min(pi_prox/mu, tis_cap)``
grpo_mis              token-level masked IS (tokens with ``pi_prox/mu > tis_cap`` leave the loss)
grpo_seq_tis          sequence-level truncated IS (product of token ratios, truncated)
grpo_seq_mis          sequence-level masked IS
decoupled_ppo         AReaL decoupled PPO as in the paper (Fu et al. 2025, eq. 5): PPO-clip on
                      ``pi/pi_prox`` times the *untruncated* behaviour weight ``pi_prox/mu``
                      (AReaL's ``behav_imp_weight_cap = None``; ``tis_cap`` is not used). With a
                      cap it would be ``grpo_mis`` (masked) or ``grpo_tis`` (truncated)
ppo_coupled           standard PPO with the behaviour policy as the old policy (no decoupling)
gspo                  GSPO sequence ratio to pi_prox, times the sequence truncated IS weight
vtrace                critic variant (IMPALA): a value head learns V-trace targets
                      (``value_coef``, ``gamma``, ``vtrace_rho_bar``, ``vtrace_c_bar``); the policy
                      gets per-token V-trace advantages ``min(rho_bar, pi_prox/mu) (r + gamma v' - V)``
                      (the truncated IS weight is inside them) under PPO-clip to pi_prox; group
                      advantages are not used (see :mod:`streamrl.learner.critic`)
====================  ==========================================================================
"""
from __future__ import annotations

import torch

from streamrl.algorithms.losses import gspo_loss, importance_weights, masked_stats, policy_loss
from streamrl.algorithms.regularizers import kl_penalty
from streamrl.algorithms.losses import aggregate
from streamrl.config import LearnerConfig

LOSSES: dict[str, dict] = {
    "grpo_no_correction": {"is_mode": "none"},
    "grpo_tis": {"is_mode": "token-tis"},
    "grpo_mis": {"is_mode": "token-mis"},
    "grpo_seq_tis": {"is_mode": "seq-tis"},
    "grpo_seq_mis": {"is_mode": "seq-mis"},
    # The paper's objective: the behaviour weight is not truncated (an infinite cap).
    "decoupled_ppo": {"is_mode": "token-tis", "is_cap": float("inf")},
    "ppo_coupled": {"is_mode": "none", "coupled": True},
    "gspo": {},
    # The off-policy correction is already inside the V-trace advantage (min(rho_bar, rho)).
    "vtrace": {"is_mode": "none"},
}


def compute_policy_loss(
    cfg: LearnerConfig,
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: float,
    num_seqs: float,
    norm_len: float,
    tensor_stats: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """Policy loss for ``cfg.loss`` on one rank's slice, normalised by global counts.

    Stats: ``clip_frac``, ``is_weight_mean``, ``is_truncated_frac``; floats, or with
    ``tensor_stats`` 0-dim device tensors computed without waiting for the device (GSPO's
    ``clip_frac`` stays a float), which the training loop reads once per step.

    Args:
        logp, prox_logp, behav_logp, mask: [B, T]; advantages: [B] (group advantages), or
            [B, T] per-token V-trace advantages for ``vtrace``.
        num_tokens, num_seqs: global counts divided by the data-parallel size (FSDP averages
            gradients over ranks, so each rank's share is scaled up by the world size).
        norm_len: the Dr.GRPO constant of ``seq-mean-token-sum-norm`` (max response length).
    """
    if cfg.loss not in LOSSES:
        raise ValueError(f"learner.loss = {cfg.loss!r} unknown; known: {sorted(LOSSES)}")
    if cfg.loss == "gspo":
        w, raw = importance_weights(prox_logp, behav_logp, mask, "seq-tis", cfg.tis_cap)
        loss, st = gspo_loss(logp, prox_logp, advantages, mask, cfg.gspo_clip_low, cfg.gspo_clip_high,
                             num_seqs=num_seqs, seq_weight=w[:, 0])
        tok = masked_stats(torch.zeros_like(mask, dtype=torch.bool), raw, mask, None)
        st["is_weight_mean"] = tok["is_weight_mean"]
        st["is_truncated_frac"] = (raw[:, 0] > cfg.tis_cap).float().mean()
        return loss, _stats_out(st, tensor_stats)
    preset = LOSSES[cfg.loss]
    loss, st = policy_loss(
        logp, prox_logp, behav_logp, advantages, mask,
        clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip or None,
        is_mode=preset["is_mode"], is_cap=preset.get("is_cap", cfg.tis_cap), coupled=preset.get("coupled", False),
        agg=cfg.agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len, tensor_stats=True,
    )
    if cfg.loss == "vtrace":
        # PPO-clip on pi/pi_prox with the V-trace advantage (rather than IMPALA's plain
        # -A log pi): with one optimizer step per batch the two have the same gradient (ratio 1);
        # with minibatches > 1 the clip keeps later minibatches from overshooting. The IS weight
        # is inside the advantage; report it against vtrace_rho_bar.
        _, raw = importance_weights(prox_logp, behav_logp, mask, "token-tis", cfg.vtrace_rho_bar)
        tok = masked_stats(torch.zeros_like(mask, dtype=torch.bool), raw, mask, cfg.vtrace_rho_bar)
        st["is_weight_mean"], st["is_truncated_frac"] = tok["is_weight_mean"], tok["is_truncated_frac"]
    return loss, _stats_out(st, tensor_stats)


def _stats_out(st: dict, tensor_stats: bool) -> dict:
    """Stats as the caller asked: device tensors as they are, or floats (one read of the device)."""
    if tensor_stats:
        return st
    keys = [k for k, v in st.items() if isinstance(v, torch.Tensor)]
    vals = torch.stack([st[k].detach().double().reshape(()) for k in keys]).tolist() if keys else []
    return {**st, **dict(zip(keys, vals))}


def kl_term(cfg: LearnerConfig, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
            num_tokens: float, num_seqs: float, norm_len: float) -> torch.Tensor:
    """KL(pi || pi_ref) estimate aggregated like the policy loss."""
    return aggregate(kl_penalty(logp, ref_logp, cfg.kl_estimator), mask, cfg.agg, num_tokens, num_seqs, norm_len)
