"""configs/tiny-lora.yaml learns: LoRA adapters on the frozen tiny MoE copy 4 digits, mean reward >= 0.8
over the run's last tenth of steps (exact copies score 1; docs/lora.md, "Learning")."""
from __future__ import annotations

import json
import subprocess

import pytest
import yaml

CONFIG = "configs/tiny-lora.yaml"


def test_lora_config_keeps_its_shape(repo):
    cfg = yaml.safe_load((repo / CONFIG).read_text())
    assert cfg["model"]["lora"]["enabled"] is True
    assert cfg["task"] == {"name": "copy_digits", "num_digits": 4}
    assert cfg["run"]["steps"] >= 100  # the slow test reports the last 100 steps' mean too


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_copy_reaches_reward_0_8(tmp_path, repo, python):
    run_dir = tmp_path / "lora"
    argv = [python, "-m", "streamrl.launcher.launch", "--config", CONFIG, "--learners", "1", "--rollers", "1",
            "--run-dir", str(run_dir)]
    proc = subprocess.run(argv, cwd=repo, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    steps = yaml.safe_load((repo / CONFIG).read_text())["run"]["steps"]
    assert summary["steps"] == steps, summary
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps
    # Only the adapters are published: a few KiB per version, not the base model.
    assert max(r["weights/bytes"] for r in rows if "weights/bytes" in r) < 200_000
    # What the run learned: the reward over its last tenth (40 steps; the summary's reward_last). The
    # reward still rises to the end of a run, so the last 100 steps' mean sits below it and near the bar:
    # 0.997, 0.842, 0.837, 0.918 and 0.772 in five runs (400 steps, load ~1-2 on 2 cores); the last of
    # them ended at 0.840 over its last 40 steps
    last = [r["learner/reward_mean"] for r in rows[-(steps // 10):]]
    mean = sum(last) / len(last)
    assert mean >= 0.8, (mean, summary["reward_first"], sum(r["learner/reward_mean"] for r in rows[-100:]) / 100)
