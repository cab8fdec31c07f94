"""What a trained batch looked like, in the figures RL users read: response lengths and staleness.

Host-side numbers from the packed batch (:mod:`streamrl.trajectory`), computed on rank 0 after
the step; the step's own figures (entropy, clip fraction, ESS, behaviour KL) come from the loss
(:mod:`streamrl.learner.step_loss`).
"""
from __future__ import annotations

import torch


def batch_diagnostics(batch, version: int, max_new_tokens: int) -> dict[str, float]:
    """Response length and staleness figures of a trained batch.

    ``learner/response_len_mean`` and ``_p90`` (tokens per response), ``learner/truncated_frac``
    (responses that used all ``max_new_tokens``: cut at the limit, unless the end-of-sequence
    token fell exactly on it), ``learner/staleness_mean`` (mean version lag of the tokens at
    training time, ``version`` being the version trained on) and ``learner/staleness_max``.

    batch: ``response_lens`` [B] and ``policy_version`` [R = sum(response_lens)].
    """
    lens = batch["response_lens"].to(torch.float64)
    lag = version - batch["policy_version"].to(torch.float64)
    if not lens.numel():
        return {}
    return {
        "learner/response_len_mean": float(lens.mean()),
        "learner/response_len_p90": float(torch.quantile(lens, 0.9)),
        "learner/truncated_frac": float((lens >= max_new_tokens).to(torch.float64).mean()),
        "learner/staleness_mean": float(lag.mean()) if lag.numel() else 0.0,
        "learner/staleness_max": float(lag.max()) if lag.numel() else 0.0,
    }
