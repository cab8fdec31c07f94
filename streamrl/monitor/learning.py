"""The monitor's learning section: the figures that say whether the run learns, not how fast it runs.

Window means of the learner's step diagnostics (response lengths and truncation, entropy, the
importance weights' ESS, clip fraction, behaviour KL, staleness and its admission bound) and the
workers' latest reward per task. Present in a snapshot only when the learner reports them.
"""
from __future__ import annotations

from typing import Any, Callable

from streamrl.rollout.metrics import TASK_REWARD_PREFIX

LEARNING_KEYS = {
    "response_len_mean": "learner/response_len_mean", "response_len_p90": "learner/response_len_p90",
    "truncated_frac": "learner/truncated_frac", "entropy": "learner/entropy", "is_ess": "learner/is_ess",
    "clip_frac": "learner/clip_frac", "kl_behaviour": "learner/kl_behaviour",
    "staleness_max": "learner/staleness_max", "staleness_bound": "learner/staleness_bound",
}


def learning_section(latest: dict[str, float], window_mean: Callable[[str], float | None],
                     worker_latest: list[dict[str, float]]) -> dict[str, Any]:
    """``{"learning": {...}}``, or ``{}`` when the learner reports none of :data:`LEARNING_KEYS`.

    latest: the learner's latest metrics; window_mean(key): the key's mean over the window (or
    None); worker_latest: each rollout worker's latest metrics (their ``rollout/task_reward/...``
    are averaged over the workers that report a task).
    """
    if not any(key in latest for key in LEARNING_KEYS.values()):
        return {}
    out: dict[str, Any] = {name: window_mean(key) for name, key in LEARNING_KEYS.items()}
    per_task: dict[str, list[float]] = {}
    for metrics in worker_latest:
        for key, value in metrics.items():
            if key.startswith(TASK_REWARD_PREFIX):
                per_task.setdefault(key[len(TASK_REWARD_PREFIX):], []).append(value)
    out["task_reward"] = {task: sum(v) / len(v) for task, v in sorted(per_task.items())}
    return {"learning": out}
