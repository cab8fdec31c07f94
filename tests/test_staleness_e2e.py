"""A tiny real run (streamrl-launch, embedded Redis, one learner, two workers) with adaptive staleness
(slow tier: about a minute on 2 CPU cores)."""
from __future__ import annotations

import json
import subprocess

import pytest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_adaptive_run_completes_and_reports_its_bound_within_the_user_bounds(tmp_path, repo, python):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [python, "-m", "streamrl.launcher.launch", "--config", str(repo / "configs/tiny.yaml"),
         "--learners", "1", "--rollers", "2", "--steps", "12", "--run-dir", str(run_dir),
         "learner.staleness=adaptive", "learner.staleness_min=1", "learner.max_staleness=3",
         "learner.staleness_interval=2"],
        cwd=repo, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 12
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 12
    bounds = [r["learner/staleness_bound"] for r in rows]
    assert all(1 <= b <= 3 for b in bounds), bounds
    assert all(abs(b - a) <= 1 for a, b in zip(bounds, bounds[1:])), bounds
    for key in ("learner/is_ess", "learner/kl_behaviour", "learner/response_len_mean", "learner/response_len_p90",
                "learner/truncated_frac", "learner/staleness_max", "learner/entropy"):
        assert key in rows[-1], key
    assert 0 < rows[-1]["learner/is_ess"] <= 1 and rows[-1]["learner/kl_behaviour"] >= 0
    assert any("rollout/task_reward/copy_digits" in r for r in rows)  # the workers' reward per task
    # every trained sample was within the ceiling: the intake drops only beyond it
    assert max(r["learner/staleness_max"] for r in rows) <= 3
