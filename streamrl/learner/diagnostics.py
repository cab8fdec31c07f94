"""What a trained batch looked like, in the figures RL users read: response lengths and staleness.

Host-side numbers from the packed batch (:mod:`streamrl.trajectory`), computed on rank 0 after
the step; the step's own figures (entropy, clip fraction, ESS, behaviour KL) come from the loss
(:mod:`streamrl.learner.step_loss`). Trajectories do not carry their task, so the reward per
task comes from the workers, which know it (:func:`worker_task_rewards`).
"""
from __future__ import annotations

import torch

from streamrl.rollout.metrics import TASK_REWARD_PREFIX


def batch_diagnostics(batch, version: int, max_new_tokens: int | None) -> dict[str, float]:
    """Response length and staleness figures of a trained batch.

    ``learner/response_len_mean`` and ``_p90`` (tokens per response), ``learner/truncated_frac``
    (responses that used all ``max_new_tokens``: cut at the limit, unless the end-of-sequence
    token fell exactly on it; left out with ``max_new_tokens`` None, e.g. multi-turn episodes,
    whose responses hold several turns), ``learner/staleness_mean`` (mean version lag of the
    tokens at training time, ``version`` being the version trained on) and ``learner/staleness_max``.

    batch: ``response_lens`` [B] and ``policy_version`` [R = sum(response_lens)].
    """
    lens = batch["response_lens"].to(torch.float64)
    lag = version - batch["policy_version"].to(torch.float64)
    if not lens.numel():
        return {}
    out = {
        "learner/response_len_mean": float(lens.mean()),
        "learner/response_len_p90": float(torch.quantile(lens, 0.9)),
        "learner/staleness_mean": float(lag.mean()) if lag.numel() else 0.0,
        "learner/staleness_max": float(lag.max()) if lag.numel() else 0.0,
    }
    if max_new_tokens is not None:
        out["learner/truncated_frac"] = float((lens >= max_new_tokens).to(torch.float64).mean())
    return out


def worker_task_rewards(latest: dict[str, dict[str, float]]) -> dict[str, float]:
    """The rollout workers' latest reward per task (``rollout/task_reward/<task>``), averaged over
    the workers reporting it, for the learner's metrics.jsonl and TensorBoard.

    latest: metrics per process (:meth:`~streamrl.coord.coordinator.Coordinator.latest_metrics`).
    """
    per_task: dict[str, list[float]] = {}
    for process, metrics in latest.items():
        if process.startswith("rollout-"):
            for key, value in metrics.items():
                if key.startswith(TASK_REWARD_PREFIX):
                    per_task.setdefault(key, []).append(value)
    return {key: sum(v) / len(v) for key, v in sorted(per_task.items())}
