"""A tiny LoRA run of the copy task learns (reward >= 0.8): 2 FSDP learner ranks training
adapters only, 2 rollers merging adapter versions into their hf engines."""
from __future__ import annotations

import json
import subprocess

import pytest

LORA_RUN = ["--config", "configs/tiny.yaml", "--learners", "2", "--rollers", "2", "--steps", "300",
            "model.lora.enabled=true", "model.lora.r=8", "model.lora.alpha=16",
            "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,lm_head]", "learner.lr=1.5e-3"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_copy_run_reaches_reward_0_8(tmp_path, repo, python):
    run_dir = tmp_path / "lora"
    proc = subprocess.run([python, "-m", "streamrl.launcher.launch", *LORA_RUN, "--run-dir", str(run_dir)],
                          cwd=repo, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = rows[-20:]
    assert sum(r["learner/reward_mean"] for r in last) / len(last) >= 0.8, summary
    # the engines generated with the learner's policy: merged adapters, not the stale base
    assert sum(r["learner/behaviour_logprob_abs_diff"] for r in last) / len(last) < 0.05
