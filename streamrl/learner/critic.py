"""The critic of the ``learner.loss = vtrace`` variant: a value head, V-trace inputs, its loss.

Why a head on the policy model and not a separate critic model: one forward gives both the
log-probs and the values, and FSDP2 / DCP treat the head like any other parameter of the root
module (it is attached before ``parallelize()``, so the root ``fully_shard`` covers it and
checkpoints save it with its AdamW state). The trunk is shared: the value loss also shapes the
hidden states, as in IMPALA.

Rollout engines never see the head: :func:`is_critic_param` names its parameters, and the
trainer leaves them out of ``param_specs`` / ``full_tensors()`` (the weights manifest).

Per-token MDP of a response (positions on the ``[B, T-1]`` grid of ``token_logprobs``: index
``t`` is the position whose logits predict token ``t+1``): reward 0 everywhere except the
sequence reward at the last response token, where the episode ends (``done``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from streamrl.algorithms.vtrace import vtrace, vtrace_losses
from streamrl.config import LearnerConfig
from streamrl.learner.packing import ResponseGrid

VALUE_HEAD_ATTR = "streamrl_value_head"


def is_critic_param(name: str) -> bool:
    """True for parameters of the value head (never published to rollout workers)."""
    return name.startswith(VALUE_HEAD_ATTR + ".") or f".{VALUE_HEAD_ATTR}." in name


class ValueHead(nn.Module):
    """``V(x_t) = w . h_t + b`` on the final (normed) hidden state; zero-initialised so V starts at 0.

    Args:
        hidden_size: H.
    Shapes:
        hidden [B, T, H] -> values [B, T] (float32).
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        # skip_init: no draw from the global RNG, so turning the critic on leaves the run's
        # random streams (sampling, dropout) where they were.
        self.proj = nn.utils.skip_init(nn.Linear, hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden).squeeze(-1).float()


def attach_value_head(model: nn.Module) -> ValueHead:
    """Add a :class:`ValueHead` to ``model`` as ``model.streamrl_value_head`` (before sharding)."""
    hidden = int(model.config.hidden_size)
    dtype = next(model.parameters()).dtype
    head = ValueHead(hidden).to(dtype)
    setattr(model, VALUE_HEAD_ATTR, head)
    return head


def value_head(model: nn.Module) -> ValueHead | None:
    """The model's value head, or None when the critic is off."""
    return getattr(model, VALUE_HEAD_ATTR, None)


def response_mdp(prompt_lens: list[int], response_lens: list[int], reward: torch.Tensor, width: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token rewards, episode ends and response positions on the ``[B, width]`` grid.

    Response token ``j`` of row ``i`` is predicted at position ``p_i - 1 + j``.

    Args:
        prompt_lens, response_lens: B ints; reward: [B] sequence rewards; width: T-1.
    Returns:
        (rewards [B, width] float32: the sequence reward at the last response token, 0 elsewhere;
        done [B, width] bool: True at the last response token;
        resp [B, width] bool: True on every response position).

    Examples:
        >>> r, d, m = response_mdp([2], [3], torch.tensor([1.0]), 5)
        >>> r.tolist(), d.tolist(), m.tolist()
        ([[0.0, 0.0, 0.0, 1.0, 0.0]], [[False, False, False, True, False]], [[False, True, True, True, False]])
    """
    b = len(prompt_lens)
    rewards = torch.zeros(b, width)
    done = torch.zeros(b, width, dtype=torch.bool)
    resp = torch.zeros(b, width, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        if r <= 0:
            continue
        last = p - 1 + r - 1
        rewards[i, last] = float(reward[i])
        done[i, last] = True
        resp[i, p - 1 : last + 1] = True
    return rewards, done, resp


def critic_targets(values: torch.Tensor, log_rhos: torch.Tensor, rewards: torch.Tensor, done: torch.Tensor,
                   resp: torch.Tensor, gamma: float, rho_bar: float, c_bar: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace value targets and per-token policy advantages of response tokens (no gradient).

    Args:
        values: [B, T-1] V at the positions that predict each token (detached here).
        log_rhos: [B, T-1] ``log pi_prox - log mu`` (zeroed outside the response).
        rewards, done, resp: from :func:`response_mdp`.
    Returns:
        (vs [B, T-1], pg_adv [B, T-1]); meaningful on ``resp`` positions only.
    """
    with torch.no_grad():
        v = values.detach().float() * resp
        # V(x_{t+1}) inside the response; 0 after the episode ends (and the trace is cut there).
        nxt = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
        nxt = torch.where(done | ~resp, torch.zeros_like(nxt), nxt)
        lr = torch.where(resp, log_rhos.detach().float(), torch.zeros_like(v))
        return vtrace(lr, v, nxt, rewards.to(v), done, gamma=gamma, rho_bar=rho_bar, c_bar=c_bar)


def value_loss(values: torch.Tensor, vs: torch.Tensor, mask: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """``0.5 * sum(mask * (vs - V)^2) / num_tokens`` (global token count / world, like the policy loss).

    Args:
        values: [B, T-1] with gradient; vs: [B, T-1] targets; mask: [B, T-1].
    """
    zeros = torch.zeros_like(values)
    return vtrace_losses(zeros, values, vs, zeros, mask, num_tokens=num_tokens)[1]


def critic_metrics(values: torch.Tensor, vs: torch.Tensor, mask: torch.Tensor, group=None) -> dict[str, float]:
    """``learner/value_mean``, ``learner/vtrace_target_mean`` and ``learner/explained_variance``
    (``1 - Var(vs - V) / Var(vs)``) over the masked tokens of every rank in ``group``.

    Args:
        values, vs, mask: [B, T-1] (this rank's rows; an idle rank passes an all-zero mask).
    """
    with torch.no_grad():
        m = mask.double()
        v, t = values.detach().double(), vs.detach().double()
        s = torch.stack([m.sum(), (v * m).sum(), (t * m).sum(), (t * t * m).sum(),
                         ((t - v) * m).sum(), ((t - v) ** 2 * m).sum()])
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(s, group=group)
        n = float(s[0].clamp(min=1.0))
        var_t = float(s[3]) / n - (float(s[2]) / n) ** 2
        var_r = float(s[5]) / n - (float(s[4]) / n) ** 2
        ev = 1.0 - var_r / var_t if var_t > 1e-12 else 0.0
    return {"learner/value_mean": float(s[1]) / n, "learner/vtrace_target_mean": float(s[2]) / n,
            "learner/explained_variance": ev}


def whiten_advantages(adv: torch.Tensor, mask: torch.Tensor, group=None, eps: float = 1e-6) -> torch.Tensor:
    """``(A - mean) / std`` over the masked tokens of every rank in ``group`` (PPO's batch whitening).

    Why: early on V is ~0, so every V-trace advantage is ~ the (non-negative) return and the
    policy gradient pushes up every sampled token at once; entropy collapses before the critic
    has learned a baseline (seen on the GPU recipe: entropy 3.96 -> 0.05 in 10 steps).
    Whitening gives the batch its own baseline until the critic provides one. The statistics
    are global, so 2 ranks compute what 1 rank would.

    Args:
        adv: [B, T-1]; mask: [B, T-1] (an idle rank passes an all-zero mask).
    Returns:
        [B, T-1] whitened advantages, 0 outside the mask.
    """
    with torch.no_grad():
        m = mask.to(torch.float64)
        a = adv.detach().to(torch.float64)
        s = torch.stack([m.sum(), (a * m).sum(), (a * a * m).sum()])
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(s, group=group)
        n = float(s[0])
        if n < 2:
            return adv * mask
        mean = float(s[1]) / n
        std = max(float(s[2]) / n - mean * mean, 0.0) ** 0.5
        return ((adv - mean) / (std + eps)) * mask


def vtrace_inputs(lc: LearnerConfig, grid: ResponseGrid, rows: list[int], values: torch.Tensor,
                  prox_logp: torch.Tensor, mask: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(V-trace targets [b, R], per-token policy advantages [b, R]) of trajectories ``rows`` of
    ``grid``, whitened over ``group`` with ``lc.vtrace_adv_norm``.

    Args:
        values, prox_logp, mask: [b, R] on the learner's device (the rows' values, proximal
            log-probs and loss mask).
    """
    device = values.device
    behav = grid.behav[rows].to(device)
    vs, a = critic_targets(values, prox_logp - behav, grid.tok_reward[rows].to(device),
                           grid.tok_done[rows].to(device), grid.resp[rows].to(device),
                           lc.gamma, lc.vtrace_rho_bar, lc.vtrace_c_bar)
    if lc.vtrace_adv_norm:
        a = whiten_advantages(a, mask, group)
    return vs, a
