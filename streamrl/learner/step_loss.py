"""The learner's per-micro-batch objective: every loss term built from the forward outputs, summed in one place.

``learner.loss`` names a policy-loss preset; all share PPO-clip with clip-higher (``clip_low``,
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

Around the policy term :class:`StepLoss` adds the critic's value loss, the KL penalty to the
reference, the entropy bonus and the MoE router losses. Every term is normalised by global
counts (:class:`~streamrl.algorithms.losses.Normalizers`), so the gradients of a minibatch's
micro-batches add up to the gradient of one loss over the whole minibatch on every rank.
"""
from __future__ import annotations

import dataclasses

import torch

from streamrl.algorithms.losses import (Normalizers, PolicyLossSpec, gspo_loss, importance_weights, masked_stats,
                                        policy_loss)
from streamrl.algorithms.moe_losses import load_balancing_loss, router_z_loss
from streamrl.algorithms.regularizers import kl_penalty
from streamrl.config import LearnerConfig
from streamrl.learner.critic import critic_metrics, value_loss
from streamrl.learner.moe_router import router_metrics

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


def policy_loss_spec(cfg: LearnerConfig) -> PolicyLossSpec:
    """The PPO-clip settings of the ``cfg.loss`` preset (not ``gspo``, which has its own loss)."""
    if cfg.loss not in LOSSES:
        raise ValueError(f"learner.loss = {cfg.loss!r} unknown; known: {sorted(LOSSES)}")
    preset = LOSSES[cfg.loss]
    return PolicyLossSpec(clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip or None,
                          is_mode=preset.get("is_mode", "token-tis"), is_cap=preset.get("is_cap", cfg.tis_cap),
                          coupled=preset.get("coupled", False))


def compute_policy_loss(cfg: LearnerConfig, logp: torch.Tensor, prox_logp: torch.Tensor, behav_logp: torch.Tensor,
                        advantages: torch.Tensor, mask: torch.Tensor, norm: Normalizers, tensor_stats: bool = False
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """Policy loss for ``cfg.loss`` on one rank's slice, normalised by global counts.

    Stats: ``clip_frac``, ``is_weight_mean``, ``is_truncated_frac``; floats, or with
    ``tensor_stats`` 0-dim device tensors computed without waiting for the device (GSPO's
    ``clip_frac`` stays a float), which the training loop reads once per step.

    Args:
        logp, prox_logp, behav_logp, mask: [B, T]; advantages: [B] (group advantages), or
            [B, T] per-token advantages (V-trace, token credit, GAE).
        norm: ``cfg.agg`` and the global counts divided by the data-parallel size (FSDP
            averages gradients over ranks, so each rank's share is scaled up by the world size).
    """
    spec = policy_loss_spec(cfg)
    if cfg.loss == "gspo":
        w, raw = importance_weights(prox_logp, behav_logp, mask, "seq-tis", cfg.tis_cap)
        loss, st = gspo_loss(logp, prox_logp, advantages, mask, cfg.gspo_clip_low, cfg.gspo_clip_high,
                             num_seqs=norm.num_seqs, seq_weight=w[:, 0])
        tok = masked_stats(torch.zeros_like(mask, dtype=torch.bool), raw, mask, None)
        st["is_weight_mean"] = tok["is_weight_mean"]
        st["is_truncated_frac"] = (raw[:, 0] > cfg.tis_cap).float().mean()
        return loss, _stats_out(st, tensor_stats)
    loss, st = policy_loss(logp, prox_logp, behav_logp, advantages, mask, spec, norm, tensor_stats=True)
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
            norm: Normalizers) -> torch.Tensor:
    """KL(pi || pi_ref) estimate (``cfg.kl_estimator``) aggregated like the policy loss."""
    return norm.reduce(kl_penalty(logp, ref_logp, cfg.kl_estimator), mask)


@dataclasses.dataclass
class ForwardOutputs:
    """One micro-batch's forward on the response grid: ``logp`` [b, R] (with gradient),
    ``entropy`` [b, R] or None, ``values`` [b, R] (the critic's head) or None, and the router
    logits per MoE layer ``[N, E]`` (empty for a dense model)."""

    logp: torch.Tensor
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    routers: list[torch.Tensor] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class LossTargets:
    """What one micro-batch's forward is scored against (no gradient), on the learner's device.

    ``prox_logp``, ``behav_logp``, ``advantages`` ([b] or [b, R]), ``mask`` [b, R] (0 on a
    dummy micro-batch); ``tokens``: the loss tokens as a host float (the weight of the
    token-mean metrics); ``ref_logp`` [b, R] with a KL penalty; ``value_targets`` [b, R] for the
    critic; ``token_weight`` [N] and ``router_share`` (this micro-batch's share of the global
    tokens) for the router losses; ``micro_batches``: how many the minibatch has on this rank.
    """

    prox_logp: torch.Tensor
    behav_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    tokens: float
    ref_logp: torch.Tensor | None = None
    value_targets: torch.Tensor | None = None
    token_weight: torch.Tensor | None = None
    router_share: float = 1.0
    micro_batches: int = 1


class StepLoss:
    """The objective of one micro-batch: ``__call__`` returns (loss, metrics as device scalars).

    ``loss = value_coef * value + policy + kl_coef * kl - entropy_coef * entropy
    + share * (aux_loss_coef * aux + z_loss_coef * z)``; terms whose inputs or coefficients are
    absent are left out. Never calls the model.

    Args:
        cfg: the learner config (loss preset, coefficients, ``agg``).
        num_experts, top_k: the MoE's routing (0 for a dense model).
        world: the data-parallel size; group: its process group (router and critic statistics).
    """

    def __init__(self, cfg: LearnerConfig, num_experts: int = 0, top_k: int = 0, world: int = 1, group=None):
        self.cfg, self.num_experts, self.top_k, self.world, self.group = cfg, num_experts, top_k, world, group

    def __call__(self, out: ForwardOutputs, tgt: LossTargets, norm: Normalizers
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        terms: dict[str, torch.Tensor] = {}
        metrics: dict[str, torch.Tensor | float] = {}
        if tgt.value_targets is not None:
            terms["value"] = self._value_term(out, tgt, norm, metrics)
        terms["policy"] = self._policy_term(out, tgt, norm, metrics)
        if self.cfg.kl_coef > 0:
            kl = kl_term(self.cfg, out.logp, tgt.ref_logp, tgt.mask, norm)
            terms["kl"] = self.cfg.kl_coef * kl
            metrics["learner/kl_ref"] = kl.detach()
        if out.entropy is not None:
            ent = (out.entropy * tgt.mask).sum() / norm.num_tokens
            if self.cfg.entropy_coef > 0:
                terms["entropy"] = -(self.cfg.entropy_coef * ent)
            metrics["learner/entropy"] = ent.detach()
        if out.routers:
            terms.update(self._router_terms(out.routers, tgt, metrics))
        with torch.no_grad():
            metrics["learner/behaviour_logprob_abs_diff"] = ((tgt.behav_logp - out.logp.detach()).abs()
                                                             * tgt.mask).sum()
        loss = torch.zeros((), device=out.logp.device)
        for term in terms.values():
            loss = loss + term
        return loss, metrics

    def _value_term(self, out: ForwardOutputs, tgt: LossTargets, norm: Normalizers, metrics: dict) -> torch.Tensor:
        """``value_coef *`` the critic's value loss against the V-trace targets."""
        v_loss = value_loss(out.values, tgt.value_targets, tgt.mask, norm.num_tokens)
        metrics["learner/value_loss"] = v_loss.detach()
        metrics["learner/vtrace_advantage_abs_mean"] = (tgt.advantages.abs() * tgt.mask).sum().detach() / norm.num_tokens
        for k, v in critic_metrics(out.values, tgt.value_targets, tgt.mask, self.group).items():
            metrics[k] = v / tgt.micro_batches
        return self.cfg.value_coef * v_loss

    def _policy_term(self, out: ForwardOutputs, tgt: LossTargets, norm: Normalizers, metrics: dict) -> torch.Tensor:
        """The ``learner.loss`` preset's policy loss; its stats weighted by the micro-batch's tokens."""
        loss, stats = compute_policy_loss(self.cfg, out.logp, tgt.prox_logp, tgt.behav_logp, tgt.advantages,
                                          tgt.mask, norm, tensor_stats=True)
        metrics["learner/loss"] = loss.detach()
        for k in ("clip_frac", "is_weight_mean", "is_truncated_frac"):
            metrics[f"learner/{k}"] = stats[k] * tgt.tokens
        return loss

    def _router_terms(self, routers: list[torch.Tensor], tgt: LossTargets, metrics: dict) -> dict[str, torch.Tensor]:
        """The MoE load-balancing and z losses (each micro-batch's share of the global loss) and router metrics."""
        cfg, share, tok_w = self.cfg, tgt.router_share, tgt.token_weight
        terms = {}
        aux = load_balancing_loss(routers, self.num_experts, self.top_k, tok_w, self.group, scale=self.world)
        metrics["moe/aux_loss"] = aux.detach() * share / self.world
        if cfg.aux_loss_coef > 0:
            terms["aux"] = cfg.aux_loss_coef * share * aux
        if cfg.z_loss_coef > 0:
            z = router_z_loss(routers, tok_w, self.group, scale=self.world)
            terms["z"] = cfg.z_loss_coef * share * z
            metrics["moe/z_loss"] = z.detach() * share / self.world
        for k, v in router_metrics(routers, self.top_k, tok_w, self.group, as_tensors=True).items():
            metrics[k] = v * share
        return terms
