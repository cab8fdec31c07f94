"""Group-relative advantages (GRPO and Dr.GRPO), per sequence and per token, and GAE.

Why :func:`token_group_advantages` is group-relative reward-to-go (rather than the
process-supervision GRPO of DeepSeekMath 4.1.3, which normalises every step reward by the
mean/std of all step rewards of the group and sums them):

* With the reward only on each response's last token, ``G[i, j] = R_i`` everywhere (with
  the hold-last-value padding) so ``A[i, j]`` is *exactly* :func:`group_advantages` of
  ``R``: the switch changes nothing for tasks without credit, and learning rate, clip and
  std settings tuned for GRPO carry over. Process supervision needs a set of "steps" that
  a per-token reward array cannot tell apart from zero-reward tokens.
* The baseline depends on the position, not on the token sampled there, so the gradient
  stays unbiased (up to GRPO's own leave-in mean); a position baseline removes the reward
  already collected before ``j`` from the comparison. With one constant sequence-mean
  baseline a correct last digit would still get a negative advantage whenever earlier
  digits carried most of the group's reward: credit for late tokens would be drowned by
  the early ones, the problem token credit is meant to solve.
* Groups share a prompt, so their members' response positions line up token by token.
"""
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


def token_group_advantages(token_rewards: torch.Tensor, response_positions: torch.Tensor, group_id: torch.Tensor,
                           normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Per-token group-relative reward-to-go advantages (token-level credit).

    Per trajectory ``i`` and response token ``j`` (counted from the response's first token):

    * return-to-go ``G[i, j] = sum_{j' >= j} r[i, j']``; past the end of a response, ``G``
      holds its last value ``G[i, len_i - 1]`` (a finished sequence collects nothing more);
    * baseline ``b[g, j] = mean_{i in g} G[i, j]``: the group's mean return-to-go at the same
      response position (at ``j = 0`` that is the mean *sequence* return);
    * scale ``s[g] = std_{i in g} G[i, 0]``: the std of the group's sequence returns
      (unbiased, as in :func:`group_advantages`);
    * ``A[i, j] = (G[i, j] - b[g, j]) / (s[g] + eps)``; 0 for a group whose sequence returns
      are all equal (as GRPO); ``normalize_std=False`` (Dr.GRPO) only centres.

    Why this estimator: see the module docstring.

    Args:
        token_rewards: [B, T] reward of each token (0 off the response).
        response_positions: [B, T] bool, True on each row's response tokens: one contiguous,
            non-empty run per row (e.g. ``to_padded``'s grid, or a response-aligned layout).
        group_id: [B] group of each trajectory.
        normalize_std: divide by the group's sequence-return std (GRPO); False centres only.

    Returns:
        [B, T] advantages, 0 off the response positions.

    Examples:
        >>> r = torch.tensor([[1., 0.], [0., 0.]])   # two samples of one prompt, 2 tokens each
        >>> token_group_advantages(r, torch.ones(2, 2, dtype=torch.bool), torch.tensor([7, 7]), False)
        tensor([[ 0.5000,  0.0000],
                [-0.5000,  0.0000]])
    """
    if token_rewards.shape != response_positions.shape or token_rewards.ndim != 2:
        raise ValueError(f"token_rewards {tuple(token_rewards.shape)} and response_positions "
                         f"{tuple(response_positions.shape)} must be the same [B, T] shape")
    pos = response_positions.bool()
    b = pos.shape[0]
    lens = pos.sum(1)
    if (lens < 1).any():
        raise ValueError("every row needs at least one response position")
    g, idx, valid = _aligned_return_to_go(token_rewards, pos, lens)
    width = g.shape[1]
    _, inverse = torch.unique(group_id, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    dtype = g.dtype
    count = torch.zeros(n_groups, dtype=dtype).index_add_(0, inverse, torch.ones(b, dtype=dtype))
    mean = torch.zeros(n_groups, width, dtype=dtype).index_add_(0, inverse, g) / count[:, None]
    centred = g - mean[inverse]
    if normalize_std:
        c0 = centred[:, 0]
        var = torch.zeros(n_groups, dtype=dtype).index_add_(0, inverse, c0**2) / (count - 1).clamp(min=1)
        std = var.sqrt()[inverse][:, None]
        adv = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    else:
        adv = centred
    out = torch.zeros_like(token_rewards)
    # Scatter back onto the grid; padded columns point at clamped indices and carry 0.
    out.scatter_add_(1, idx, adv * valid)
    return out


def _aligned_return_to_go(token_rewards: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return-to-go of each response aligned at its first token.

    Args:
        token_rewards: [B, T]; pos: [B, T] bool response positions (one run per row); lens: [B] run lengths.
    Returns:
        (G [B, W] holding its last value past each response's end, the grid column of each
        aligned position [B, W] (clamped), valid [B, W] bool), W = the longest response.
    """
    t = pos.shape[1]
    start = pos.int().argmax(1)  # first True of each row
    j = torch.arange(int(lens.max()))
    valid = j[None, :] < lens[:, None]  # [B, W] response-aligned
    idx = (start[:, None] + j[None, :]).clamp(max=t - 1)
    r = token_rewards.gather(1, idx) * valid
    # Reward-to-go: reverse cumulative sum; past the end hold the last token's value.
    g = r.flip(1).cumsum(1).flip(1)
    last = g.gather(1, (lens - 1)[:, None])
    return torch.where(valid, g, last), idx, valid


def gae_advantages(values: torch.Tensor, reward: torch.Tensor, response_lens: torch.Tensor, gamma: float,
                   lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lambda) advantages and lambda-returns of each response token.

    The per-token MDP of a response: reward 0 at every token but the last, which gets the
    sequence reward and ends the episode; ``values[i, j]`` is V at the position that predicts
    response token ``j`` (the critic role's ``values``). Computed by torchrl's
    ``generalized_advantage_estimate`` along the response.

    Args:
        values: [B, R] on the response grid (column j = response token j; anything past a
            response's end is ignored).
        reward: [B] sequence rewards. response_lens: [B] ints >= 1.
        gamma, lam: discount and GAE lambda.
    Returns:
        (advantages [B, R], returns [B, R] = advantages + values); 0 past each response's end.

    Examples:
        >>> a, g = gae_advantages(torch.tensor([[0.5, 0.5]]), torch.tensor([1.0]), torch.tensor([2]), 1.0, 1.0)
        >>> a.tolist(), g.tolist()
        ([[0.5, 0.5]], [[1.0, 1.0]])
    """
    from torchrl.objectives.value.functional import generalized_advantage_estimate  # noqa: PLC0415 (heavy)

    b, width = values.shape
    col = torch.arange(width)[None, :]
    lens = response_lens.to(torch.long)[:, None]
    inside = col < lens  # [B, R]
    last = col == lens - 1
    v = torch.where(inside, values.float(), torch.zeros(()))
    nxt = torch.cat([v[:, 1:], torch.zeros(b, 1)], dim=1)
    done = last | ~inside
    r = torch.where(last, reward.float()[:, None].expand(b, width), torch.zeros(()))
    adv, ret = generalized_advantage_estimate(gamma, lam, v[..., None], nxt[..., None], r[..., None],
                                              done[..., None], time_dim=-2)
    adv, ret = adv[..., 0], ret[..., 0]
    return adv * inside, ret * inside
