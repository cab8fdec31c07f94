"""Per-batch rollout metrics computed from a packed trajectory batch.

``versions_spanned``: with in-flight updates a long response is sampled by several policy
versions (PipelineRL). How many a response spans (``last - first + 1`` of its per-token
versions) tells how far behaviour drifts inside one response, next to the staleness rule that
judges a response by its oldest token.
"""
from __future__ import annotations

import torch


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
