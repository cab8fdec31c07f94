"""The diagnostics RL users read: response lengths, truncation and staleness of a trained batch,
reward per task of a rollout batch."""
from __future__ import annotations

import pytest
import torch

from streamrl.learner.diagnostics import batch_diagnostics, worker_task_rewards
from streamrl.rollout.metrics import task_rewards
from streamrl.tasks.registry import Problem


def test_batch_diagnostics_lengths_truncation_and_lags():
    lens = torch.tensor([2, 4, 4, 1, 3])  # two responses used the whole limit of 4 tokens
    versions = torch.tensor([7, 7] + [5, 6, 6, 7] + [6] * 4 + [7] + [7, 7, 7])
    d = batch_diagnostics({"response_lens": lens, "policy_version": versions}, version=7, max_new_tokens=4)
    lags = (7 - versions).double()
    assert d["learner/response_len_mean"] == pytest.approx(14 / 5)
    assert d["learner/response_len_p90"] == pytest.approx(float(torch.quantile(lens.double(), 0.9)))
    assert d["learner/truncated_frac"] == pytest.approx(2 / 5)
    assert d["learner/staleness_mean"] == pytest.approx(float(lags.mean()))
    assert d["learner/staleness_max"] == 2.0
    episodes = batch_diagnostics({"response_lens": lens, "policy_version": versions}, version=7, max_new_tokens=None)
    assert "learner/truncated_frac" not in episodes and episodes["learner/staleness_max"] == 2.0


def test_task_rewards_by_source_dataset_else_the_run_task():
    mix = [Problem("a", "1", fields={"source_dataset": "chain_sum"}),
           Problem("b", "2", fields={"source_dataset": "gcd"}), Problem("c", "3")]
    problems = [p for p in mix for _ in range(2)]
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.5]
    assert task_rewards(problems, rewards, "reasoning_gym") == {
        "rollout/task_reward/chain_sum": 0.5, "rollout/task_reward/gcd": 1.0, "rollout/task_reward/reasoning_gym": 0.25}


def test_worker_task_rewards_average_over_the_workers_reporting_a_task():
    latest = {"learner": {"learner/reward_mean": 0.9}, "rollout-0": {"rollout/task_reward/gcd": 0.2, "x": 1.0},
              "rollout-1": {"rollout/task_reward/gcd": 0.6, "rollout/task_reward/chain_sum": 0.1}}
    assert worker_task_rewards(latest) == {"rollout/task_reward/chain_sum": 0.1,
                                           "rollout/task_reward/gcd": pytest.approx(0.4)}
