"""streamrl-launch as real processes: the headline command, worker SIGKILL, learner failure, Ctrl-C."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from streamrl.coord.coordinator import Coordinator

pytestmark = pytest.mark.slow


def launcher(python, repo, run_dir, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [python, "-m", "streamrl.launcher.launch", "--config", str(repo / "configs/tiny.yaml"),
         "--run-dir", str(run_dir), *args],
        cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for(pred, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"launcher exited ({proc.returncode}) while waiting for {what}:\n{proc.stdout.read()}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def finish(proc: subprocess.Popen, timeout_s: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"launcher did not finish in {timeout_s} s:\n{out}")
    return out


def descendants(pid: int) -> list[int]:
    """Processes below ``pid`` (read from /proc), to find the learner ranks this test started."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.timeout(600)
def test_headline_command(tmp_path, repo, python):
    """The README's headline command, as written, on the 2-core machine."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    out = finish(launcher(python, repo, run_dir, "--learners", "4", "--rollers", "4", "--steps", "20"), 560)
    wall = time.monotonic() - t0
    assert "  OK" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["status"] == "completed"
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [
        "learner.log", "rollout-0.log", "rollout-1.log", "rollout-2.log", "rollout-3.log"]
    print(f"headline command: {wall:.1f} s wall, learner {summary['wall_s']:.1f} s")


@pytest.mark.timeout(400)
def test_sigkill_worker_restarts_rejoins_with_newest_weights(tmp_path, repo, python, redis_url, run_id):
    run_dir = tmp_path / "run"
    proc = launcher(python, repo, run_dir, "--learners", "1", "--rollers", "2", "--steps", "80",
                    "--redis-url", redis_url, "--run-id", run_id, "--restart-backoff", "0.5")
    coord = Coordinator(redis_url, run_id)
    try:
        hb = wait_for(lambda: (coord.current_version() >= 3 and (coord.workers().get(0) or {}).get("version", -1) >= 1
                               and coord.workers()[0]), 200, "learner version 3 and worker 0 running", proc)
        assert hb["incarnation"] == 1
        os.kill(hb["pid"], signal.SIGKILL)  # a process this test started (launcher -> worker)
        v_kill = coord.current_version()
        hb2 = wait_for(lambda: ((h := coord.workers().get(0)) and h["incarnation"] == 2 and h["version"] >= 0 and h),
                       120, "worker 0 restarted (incarnation 2) with weights loaded", proc)
        assert hb2["pid"] != hb["pid"]
        # The new incarnation loaded weights published after the kill: the newest at its (re)start.
        assert hb2["version"] > v_kill, (hb2, v_kill)
        v_running = coord.current_version()
        assert v_running < 80, "the run must still be going after the worker rejoined"
        out = finish(proc, 300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    assert "rollout-0 exited with -9; restart 1/3" in out
    assert "rollout-0      exit codes [-9, 0] restarts 1" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 80 and summary["status"] == "completed"
    assert coord.acks()[0] > hb2["version"] or coord.acks()[0] == summary["versions_published"] - 1


@pytest.mark.timeout(400)
def test_learner_failure_restarts_run_then_completes(tmp_path, repo, python, redis_url, run_id):
    """A learner rank SIGKILLed: without --learner-restarts the run stops with a named failure;
    with --learner-restarts 1 the learner (and workers) restart and the run completes."""
    run_dir = tmp_path / "run"
    proc = launcher(python, repo, run_dir, "--learners", "2", "--rollers", "1", "--steps", "30",
                    "--redis-url", redis_url, "--run-id", run_id, "--learner-restarts", "1")
    coord = Coordinator(redis_url, run_id)
    try:
        wait_for(lambda: coord.current_version() >= 2, 200, "learner version 2", proc)
        ranks = [p for p in descendants(proc.pid) if "streamrl.workers.learner" in cmdline(p)
                 and "torch.distributed.run" not in cmdline(p)]
        assert len(ranks) == 2, [cmdline(p) for p in descendants(proc.pid)]
        os.kill(ranks[1], signal.SIGKILL)
        out = finish(proc, 330)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    assert "learner exited with 1; restart 1/1" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["status"] == "completed"


@pytest.mark.timeout(300)
def test_learner_failure_stops_run_with_named_failure(tmp_path, repo, python, redis_url, run_id):
    run_dir = tmp_path / "run"
    proc = launcher(python, repo, run_dir, "--learners", "2", "--rollers", "1", "--steps", "500",
                    "--redis-url", redis_url, "--run-id", run_id)
    coord = Coordinator(redis_url, run_id)
    try:
        wait_for(lambda: coord.current_version() >= 2, 200, "learner version 2", proc)
        worker_pid = coord.workers()[0]["pid"]
        ranks = [p for p in descendants(proc.pid) if "streamrl.workers.learner" in cmdline(p)
                 and "torch.distributed.run" not in cmdline(p)]
        os.kill(ranks[-1], signal.SIGKILL)
        out = finish(proc, 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 3, out  # a fault it gave up on
    assert "FAILED: learner exited with code 1" in out, out
    # the diagnosis: the first fault, the tail of its log, the resume command
    assert "first fault: learner exited with code 1" in out and "last lines of" in out, out
    assert "resume: streamrl-launch" in out or "no checkpoint yet" in out, out
    assert not Path(f"/proc/{worker_pid}").exists() or "zombie" in Path(f"/proc/{worker_pid}/status").read_text()


@pytest.mark.timeout(300)
def test_sigint_stops_everything_learner_first(tmp_path, repo, python, redis_url, run_id):
    run_dir = tmp_path / "run"
    proc = launcher(python, repo, run_dir, "--learners", "1", "--rollers", "1", "--steps", "1000",
                    "--redis-url", redis_url, "--run-id", run_id)
    coord = Coordinator(redis_url, run_id)
    try:
        wait_for(lambda: coord.current_version() >= 2, 200, "learner version 2", proc)
        worker_pid = coord.workers()[0]["pid"]
        below = descendants(proc.pid)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        out = finish(proc, 90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # A stop on request, not a failure: exit 130 (the shell's Ctrl-C), the checkpoint and the
    # command that resumes it are named.
    assert proc.returncode == 130, out
    assert "FAILED" not in out, out
    assert "streamrl-launch: stopped on request (Ctrl-C)" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped: stopped on request (Ctrl-C)"  # the learner stopped itself and wrote it
    assert 2 <= summary["steps"] < 1000
    ckpt = run_dir / "checkpoints" / f"step_{summary['steps']:08d}"
    assert f"  checkpoint: {ckpt}" in out, out
    (resume,) = [line for line in out.splitlines() if line.startswith("  resume:")]
    assert resume.split()[1] == "streamrl-launch" and resume.endswith(" --resume")
    assert f"--run-dir {run_dir}" in resume and "--steps 1000" in resume
    # The live progress line (plain lines: stdout is a pipe) came from the learner's metrics.
    assert "streamrl-launch: step " in out and "samples/s" in out, out
    assert worker_pid in below
    alive = [p for p in below if Path(f"/proc/{p}").exists() and "zombie" not in Path(f"/proc/{p}/status").read_text()]
    assert alive == [], [cmdline(p) for p in alive]
