"""A learner batch's host-side inputs: response grid, advantages, minibatch split, rows left out.

Every rank computes these on the whole batch (broadcast from rank 0); they are cheap and
identical everywhere, so ranks agree on every split without talking.

Samples whose advantage is 0 on every loss token add exactly 0 to the loss and its gradient
when nothing else trains on them (no critic, KL, entropy bonus or MoE router loss): with
``learner.drop_zero_advantage`` they are left out of the micro-batches before the split over
ranks, while every normaliser still counts them (:func:`zero_advantage_rows`).
"""
from __future__ import annotations

import math

import torch
from tensordict import TensorDict

from streamrl.algorithms.advantages import group_advantages, token_group_advantages
from streamrl.config import Config, LearnerConfig
from streamrl.learner.critic import response_mdp
from streamrl.learner.packing import ResponseGrid, response_grid, response_positions
from streamrl.roles.critic import served_gae_advantages
from streamrl.trajectory import num_trajectories


def batch_response_grid(batch: TensorDict, critic: bool) -> ResponseGrid:
    """The batch's loss mask, behaviour log-probs, positions (and token rewards, and with
    ``critic`` the per-token MDP of each response) on the ``[B, R]`` response grid."""
    g = ResponseGrid(loss_mask=response_grid(batch, "response_mask"),
                     behav=response_grid(batch, "behaviour_logprobs"),
                     positions=response_positions(batch))
    if "token_rewards" in batch.keys():
        g.token_rewards = response_grid(batch, "token_rewards")
    if critic:  # per-token MDP of each response; group advantages are not used
        r_lens = batch["response_lens"].tolist()
        g.tok_reward, g.tok_done, g.resp = response_mdp([1] * len(r_lens), r_lens, batch["reward"], g.width)
    return g


def batch_advantages(cfg: Config, batch: TensorDict, grid: ResponseGrid) -> torch.Tensor:
    """[B] GRPO advantages (``learner.advantage = sequence``), [B, R] per-token group-relative
    reward-to-go on the response grid (``token``), or [B, R] GAE from the critic role (``gae``).

    A ``token`` learner fails on a batch without ``token_rewards`` rather than falling back
    to sequence advantages: a silent fallback would make a token-credit run a GRPO run
    without saying so (every worker shares the config, so this means a broken producer).
    """
    lc = cfg.learner
    if lc.advantage == "gae":  # [B, R] from the critic role's values (streamrl.roles.critic)
        return served_gae_advantages(batch, cfg.critic, grid.loss_mask)
    if lc.advantage == "token":
        if grid.token_rewards is None:
            raise ValueError("learner.advantage = 'token' got a batch without token_rewards; "
                             "run the rollout workers with rollout.token_rewards = true")
        return token_group_advantages(grid.token_rewards, grid.positions, batch["group_id"],
                                      normalize_std=lc.adv_std_norm)
    return group_advantages(batch["reward"], batch["group_id"], normalize_std=lc.adv_std_norm)


def minibatch_rows(batch: TensorDict, minibatches: int) -> list[list[int]]:
    """The batch's trajectories split into ``minibatches`` contiguous lists (the last may be shorter)."""
    n_all = num_trajectories(batch)
    per_mb = math.ceil(n_all / minibatches)
    return [list(range(j, min(j + per_mb, n_all))) for j in range(0, n_all, per_mb)]


def trains_every_sample(lc: LearnerConfig, critic: bool, is_moe: bool) -> bool:
    """True when a loss term other than the policy loss counts every token: the V-trace
    critic's value loss, a KL penalty, an entropy bonus, an MoE's router losses (or the
    unfreeze gates reading router metrics)."""
    gated = lc.router_freeze_steps > 0 and (lc.router_unfreeze_min_entropy > 0 or lc.router_unfreeze_max_usage_std > 0)
    router_terms = is_moe and (lc.aux_loss_coef > 0 or lc.z_loss_coef > 0 or gated)
    return critic or lc.kl_coef > 0 or lc.entropy_coef > 0 or router_terms


def zero_advantage_rows(lc: LearnerConfig, adv: torch.Tensor, grid: ResponseGrid, critic: bool,
                        is_moe: bool) -> torch.Tensor:
    """[N] bool: the samples to leave out of the forward/backward (``learner.drop_zero_advantage``).

    A sample whose advantage is 0 on every loss token (``adv``: [N] or [N, R]) has a policy
    loss of exactly 0 and a gradient of exactly 0 (``-0 * ratio``, in every loss preset,
    ``ppo_coupled``, dual-clip and GSPO included), in every minibatch. Leaving it out changes
    no gradient because the normalisers (``n_tok``, ``n_seq`` of ``learner.agg``) are taken
    over the whole minibatch, not over the micro-batches. All False where another term trains
    on every sample (:func:`trains_every_sample`).
    """
    if not lc.drop_zero_advantage or trains_every_sample(lc, critic, is_moe):
        return torch.zeros(adv.shape[0], dtype=torch.bool)
    a = adv.detach().cpu()
    a = a[:, None] if a.ndim == 1 else a
    return ~((a != 0) & (grid.loss_mask > 0)).any(dim=1)


def no_signal(lc: LearnerConfig, adv: torch.Tensor, critic: bool) -> bool:
    """True when ``learner.skip_no_signal`` applies and every advantage is exactly 0
    (``adv``: [N] or [N, R]). The V-trace critic and a KL penalty train without it."""
    return bool(lc.skip_no_signal and not critic and lc.kl_coef == 0 and not adv.any())


def batch_summary(batch: TensorDict, adv: torch.Tensor, grid: ResponseGrid, dropped: torch.Tensor
                  ) -> dict[str, float]:
    """The step metrics that describe the batch itself (host floats, same on every rank)."""
    mask = grid.loss_mask
    return {
        "learner/dropped_zero_adv_frac": float(dropped.float().mean()),
        "learner/reward_mean": float(batch["reward"].mean()),
        "learner/advantage_abs_mean": (float(adv.abs().mean()) if adv.ndim == 1 else
                                       float((adv.abs() * mask).sum() / mask.sum().clamp(min=1))),
        "learner/trained_tokens": float(mask.sum()),
        "learner/trajectories": float(num_trajectories(batch)),
    }
