"""V-trace (Espeholt et al. 2018, IMPALA) targets for a critic variant of the learner.

Shapes are time-major per row: ``[B, T]``, time on the last axis. With ``rho = pi / mu``:

    delta_t = min(rho_bar, rho_t) * (r_t + gamma_t V(x_{t+1}) - V(x_t))
    v_t - V(x_t) = delta_t + gamma_t * min(c_bar, rho_t) * (v_{t+1} - V(x_{t+1}))
    A_t = min(rho_bar, rho_t) * (r_t + gamma_t v_{t+1} - V(x_t))

where ``gamma_t = gamma * (1 - done_t)``. With rho = 1 everywhere (on-policy, caps >= 1)
``v_t`` is exactly the n-step bootstrapped return. torchrl's ``vtrace_advantage_estimate``
computes the same quantities (its docstring swaps ``log_pi`` and ``log_mu``: its code takes
``rho = exp(log_pi - log_mu)`` with ``log_pi`` the *target* policy); our test checks the two agree.
"""
from __future__ import annotations

import torch


def vtrace(
    log_rhos: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    rewards: torch.Tensor,
    done: torch.Tensor,
    gamma: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace value targets and policy-gradient advantages (no gradient flows).

    Args:
        log_rhos: [B, T] ``log pi(a_t) - log mu(a_t)`` (target minus behaviour).
        values: [B, T] ``V(x_t)``; next_values: [B, T] ``V(x_{t+1})`` (bootstrap at the end).
        rewards: [B, T]; done: [B, T] bool, the episode ends after step t (no bootstrap, trace cut).
    Returns:
        (vs [B, T] value targets, pg_advantages [B, T]).

    Examples:
        >>> z = torch.zeros(1, 3)
        >>> vtrace(z, z, z, torch.ones(1, 3), torch.tensor([[0, 0, 1]]).bool())[0]
        tensor([[3., 2., 1.]])
    """
    with torch.no_grad():
        rho = log_rhos.exp()
        c_rho = rho.clamp(max=rho_bar)
        cs = rho.clamp(max=c_bar)
        disc = gamma * (~done.bool()).to(values.dtype)
        deltas = c_rho * (rewards + disc * next_values - values)
        acc = torch.zeros_like(values[..., -1])
        out = []
        for t in reversed(range(values.shape[-1])):
            acc = deltas[..., t] + disc[..., t] * cs[..., t] * acc
            out.append(acc)
        vs = torch.stack(out[::-1], dim=-1) + values
        vs_next = torch.cat([vs[..., 1:], next_values[..., -1:]], dim=-1)
        vs_next = torch.where(done.bool(), next_values, vs_next)
        adv = c_rho * (rewards + disc * vs_next - values)
    return vs, adv


def vtrace_losses(
    logp: torch.Tensor,
    values: torch.Tensor,
    vs: torch.Tensor,
    pg_adv: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Actor and critic losses of the IMPALA learner, token-mean over ``mask``.

    Args:
        logp: [B, T] log pi(a_t) with gradient; values: [B, T] V(x_t) with gradient.
        vs, pg_adv: [B, T] from :func:`vtrace`; mask: [B, T].
        num_tokens: the denominator (default ``mask.sum()``); pass the global token count
            divided by the data-parallel size when the batch is split across FSDP ranks.
    Returns:
        (policy_loss ``-mean(A_t log pi)``, value_loss ``0.5 mean((v_t - V)^2)``).
    """
    m = mask.to(logp.dtype)
    n = m.sum().clamp(min=1.0) if num_tokens is None else num_tokens
    pol = -(pg_adv.detach() * logp * m).sum() / n
    val = 0.5 * (((vs.detach() - values) ** 2) * m).sum() / n
    return pol, val
