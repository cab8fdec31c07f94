"""Group-relative advantages (GRPO and Dr.GRPO)."""
from __future__ import annotations

import torch


def group_advantages(reward: torch.Tensor, group_id: torch.Tensor, normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Advantage of each trajectory relative to its prompt group.

    Args:
        reward: [B] scalar rewards.
        group_id: [B] group of each trajectory (same prompt).
        normalize_std: GRPO divides by the group std; Dr.GRPO (False) only centres.

    Returns:
        [B] advantages; zero for groups whose rewards are all equal.

    Examples:
        >>> group_advantages(torch.tensor([1., 0., 2., 2.]), torch.tensor([0, 0, 1, 1]), False)
        tensor([ 0.5000, -0.5000,  0.0000,  0.0000])
    """
    _, inverse = torch.unique(group_id, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    count = torch.zeros(n_groups, dtype=reward.dtype).index_add_(0, inverse, torch.ones_like(reward))
    mean = torch.zeros(n_groups, dtype=reward.dtype).index_add_(0, inverse, reward) / count
    centred = reward - mean[inverse]
    if not normalize_std:
        return centred
    var = torch.zeros(n_groups, dtype=reward.dtype).index_add_(0, inverse, centred**2) / (count - 1).clamp(min=1)
    std = var.sqrt()[inverse]
    # A group whose rewards are all equal carries no signal: 0, never 0/0.
    return torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
