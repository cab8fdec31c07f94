"""tools/gpu/on_each_gpu.sh: several GPU jobs of one device call, one per GPU, as many at a time as GPUs.

The script reads the GPU count from ``nvidia-smi``; here a stand-in on PATH reports two GPUs, and
each job records the GPU it was given and the moments it ran, so the test sees the placement and
that no two jobs shared a GPU at once.
"""
from __future__ import annotations

import os
import subprocess

SCRIPT = "tools/gpu/on_each_gpu.sh"


def _run(tmp_path, repo, *jobs: str, gpus: int = 2) -> subprocess.CompletedProcess:
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo {g}\n" for g in range(gpus)))
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", str(repo / SCRIPT), *jobs], env=env, capture_output=True, text=True, timeout=60)


def test_jobs_get_a_gpu_each_their_own_folders_and_waves_never_share_a_gpu(tmp_path, repo):
    log = tmp_path / "spans"
    # each job: its GPU, start and end times (a file marks the end so the next wave can only start after it)
    job = (f'echo "$CUDA_VISIBLE_DEVICES $(date +%s%N) start" >> {log}; sleep 0.3; '
           f'echo "$CUDA_VISIBLE_DEVICES $(date +%s%N) end" >> {log}; echo "$RACE_DIR" > "$OUT/race_dir"')
    proc = _run(tmp_path, repo, job, job, job, job, job)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    assert [(out / f"job{k}" / "race_dir").read_text().strip() for k in range(5)] == [f"/tmp/race-job{k}" for k in range(5)]
    assert all((out / f"job{k}" / "rc").read_text().strip() == "0" for k in range(5))
    busy: dict[str, int] = {}
    for line in sorted(log.read_text().splitlines(), key=lambda s: (int(s.split()[1]), s.split()[2] == "start")):
        gpu, _, what = line.split()
        busy[gpu] = busy.get(gpu, 0) + (1 if what == "start" else -1)
        assert busy[gpu] in (0, 1), f"two jobs on GPU {gpu} at once"
    assert set(busy) == {"0", "1"}  # both GPUs were used


def test_a_failed_job_fails_the_call_and_is_named(tmp_path, repo):
    proc = _run(tmp_path, repo, "true", "exit 3")
    assert proc.returncode == 1
    assert "job1 exit 3: exit 3" in proc.stdout and "job0 exit 0: true" in proc.stdout


def test_no_gpu_and_no_job_are_refused(tmp_path, repo):
    assert _run(tmp_path, repo).returncode == 2
    proc = _run(tmp_path, repo, "true", gpus=0)
    assert proc.returncode == 2 and "no GPU found" in proc.stderr
