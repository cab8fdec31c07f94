"""Router losses of MoE layers: load balancing (Switch / transformers) and z-loss (ST-MoE).

Both take the per-layer router logits ``[N, E]`` of one forward. When the batch is split over
data-parallel ranks, pass ``group``: the non-differentiable statistics (expert assignment
counts, token count) are all-reduced so every rank's surrogate has the gradient of the
*global* loss; multiply by the world size only if the caller's gradient reduction averages
over ranks (FSDP does: the trainer passes ``scale=world``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _global(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        t = t.clone()
        dist.all_reduce(t, group=group)
    return t


def load_balancing_loss(
    router_logits: list[torch.Tensor] | tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    token_mask: torch.Tensor | None = None,
    group=None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss over all layers (value of transformers'
    ``load_balancing_loss_func``): ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of
    top-k assignments to expert e and ``P_e`` the mean router probability, pooled over layers.

    Args:
        router_logits: per layer [N, E].
        token_mask: [N] 1 for real tokens (padding excluded), or None.
        group: process group whose ranks hold the other parts of the batch, or None.
    Returns:
        scalar; on one rank equal to the transformers loss.
    """
    dev = router_logits[0].device
    m = torch.ones(router_logits[0].shape[0], device=dev) if token_mask is None else token_mask.reshape(-1).float().to(dev)
    counts = torch.zeros(num_experts, device=dev)
    prob_sum = torch.zeros(num_experts, device=dev)
    rows = torch.zeros((), device=dev)
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)
        sel = torch.topk(p, top_k, dim=-1).indices
        counts = counts + torch.zeros(num_experts, device=dev).scatter_add_(
            0, sel.reshape(-1), m.repeat_interleave(top_k)).detach()
        prob_sum = prob_sum + (p * m[:, None]).sum(0)
        rows = rows + m.sum()
    counts, rows = _global(counts, group), _global(rows.detach(), group).clamp(min=1)
    return scale * num_experts * ((counts / rows) * (prob_sum / rows)).sum()


def router_z_loss(
    router_logits: list[torch.Tensor] | tuple[torch.Tensor, ...],
    token_mask: torch.Tensor | None = None,
    group=None,
    scale: float = 1.0,
) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens (and layers) of ``logsumexp(logits)^2``.

    Args:
        router_logits: per layer [N, E]; token_mask: [N] or None.
    Returns:
        scalar; keeps router logits small so the softmax stays well conditioned in bf16.
    """
    dev = router_logits[0].device
    m = torch.ones(router_logits[0].shape[0], device=dev) if token_mask is None else token_mask.reshape(-1).float().to(dev)
    total = sum((torch.logsumexp(lg.float(), -1) ** 2 * m).sum() for lg in router_logits)
    rows = _global((m.sum() * len(router_logits)).detach(), group).clamp(min=1)
    return scale * total / rows
