"""``streamrl-bench e2e`` end to end on a short budget: both runs happen, figures are consistent."""
from __future__ import annotations

import json
import subprocess

import pytest


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_e2e_bench_reports_ratios(tmp_path, repo, python):
    out = tmp_path / "bench"
    proc = subprocess.run([python, "-m", "streamrl.bench.cli", "e2e", "--steps", "12", "--repeats", "1",
                           "--out", str(out), "--json"],
                          cwd=repo, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for run in ("sync", "async"):
        fig = result[run]
        assert fig["samples"] > 0 and fig["samples_per_s"] > 0 and 0 <= fig["learner_idle_pct"] <= 100
    assert result["sync"]["staleness_mean"] == 0  # sync is strictly on-policy
    assert result["speedup_async_vs_sync"] == pytest.approx(
        result["async"]["samples_per_s"] / result["sync"]["samples_per_s"])
    assert (out / "async_vs_sync.png").stat().st_size > 10_000
