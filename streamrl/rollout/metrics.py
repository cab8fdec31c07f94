"""Per-batch rollout metrics computed from a packed trajectory batch.

``versions_spanned``: with in-flight updates a long response is sampled by several policy
versions (PipelineRL). How many a response spans (``last - first + 1`` of its per-token
versions) tells how far behaviour drifts inside one response, next to the staleness rule that
judges a response by its oldest token.

``task_rewards``: the reward mean per task of a batch, so a mix of tasks shows which of them
the policy learns (a mean over the mix hides a task going down while another goes up).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

TASK_REWARD_PREFIX = "rollout/task_reward/"


def versions_spanned(policy_version: torch.Tensor, response_lens: torch.Tensor) -> dict[str, float]:
    """Versions each response spans; max and mean over the non-empty responses of a batch.

    policy_version: [sum(response_lens)] int, the version that sampled each response token
    (responses concatenated); response_lens: [N] int. Returns
    ``{"rollout/versions_spanned_max": ..., "rollout/versions_spanned_mean": ...}`` (0.0 when
    every response is empty).
    """
    lens = response_lens.to(torch.int64)
    if policy_version.numel() != int(lens.sum()):
        raise ValueError(f"policy_version has {policy_version.numel()} tokens, response_lens sum to {int(lens.sum())}")
    keep = lens > 0
    if not bool(keep.any()):
        return {"rollout/versions_spanned_max": 0.0, "rollout/versions_spanned_mean": 0.0}
    ends = lens.cumsum(0)[keep]
    first = policy_version[ends - lens[keep]]
    last = policy_version[ends - 1]
    spans = (last - first + 1).double()
    return {"rollout/versions_spanned_max": float(spans.max()), "rollout/versions_spanned_mean": float(spans.mean())}


def task_rewards(problems: Sequence[Any], rewards: Sequence[float], default_task: str) -> dict[str, float]:
    """``{"rollout/task_reward/<task>": mean reward}`` over a batch's samples, by task.

    A problem's task is its ``fields["source_dataset"]`` (the dataset of a reasoning-gym mix, the
    family of a long-sequence task), else ``default_task`` (the run's ``task.name``).
    problems, rewards: one per sample (a group's problem repeated).
    """
    sums: dict[str, list[float]] = {}
    for problem, reward in zip(problems, rewards):
        fields = getattr(problem, "fields", None) or {}
        acc = sums.setdefault(str(fields.get("source_dataset") or default_task), [0.0, 0.0])
        acc[0] += float(reward)
        acc[1] += 1.0
    return {f"{TASK_REWARD_PREFIX}{name}": total / n for name, (total, n) in sorted(sums.items())}
