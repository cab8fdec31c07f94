"""Chaos harness: a real ``streamrl-launch`` subprocess against a real redis-server the test owns.

The test owns Redis (``--redis-url``) so it can restart it and read the run's keys after the
launcher exited. Processes are found through Redis heartbeats (workers publish their pid) and
/proc (the launcher's children); every kill is by pid or process group of a process this test
started (directly or through its launcher), never by name.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamrl.coord.coordinator import Coordinator
from streamrl.launcher.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]
# Small and quick: 4 groups of 8 per step, steps long enough to inject faults into.
FAST = ["learner.groups_per_step=4", "rollout.group_size=8", "rollout.prompts_per_batch=2",
        "checkpoint.save_interval=4", "checkpoint.keep_last=2"]


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def wait_for(pred, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@dataclass
class Run:
    proc: subprocess.Popen
    run_dir: Path
    run_id: str
    coord: Coordinator
    log: Path

    def steps(self) -> int:
        f = self.run_dir / "metrics.jsonl"
        return sum(1 for _ in f.open()) if f.exists() else 0

    def learner_pid(self) -> int | None:
        """The torchrun agent (session leader of the learner job), a child of the launcher."""
        for c in children(self.proc.pid):
            if "torch.distributed.run" in cmdline(c):
                return c
        return None

    def learner_rank_pid(self) -> int | None:
        """Learner rank 0 (a child of the torchrun agent; torch puts ranks in their own session)."""
        agent = self.learner_pid()
        for c in children(agent) if agent else []:
            if "streamrl.workers.learner" in cmdline(c):
                return c
        return None

    def latest_checkpoint_step(self) -> int:
        """Step of the newest complete checkpoint (0 if none)."""
        from streamrl.learner.run_checkpoint import latest_checkpoint

        ck = latest_checkpoint(self.run_dir / "checkpoints")
        return int(ck.name.split("_")[1]) if ck is not None else 0

    def journaled_after(self, incarnation: int, step: int) -> int:
        """Batches learner ``incarnation`` (0 = the first) journaled after a checkpoint newer than
        ``step`` (one it wrote itself when ``step`` is where it started): what a crash now must
        recover from the journal and from the workers' retention."""
        journal = self.run_dir / "checkpoints" / "journal"
        segs = sorted(journal.glob(f"after_*_{incarnation:04d}")) if journal.is_dir() else []
        segs = [g for g in segs if int(g.name.split("_")[1]) > step]
        return len(list(segs[-1].glob("[0-9]*.safetensors"))) if segs else 0

    def worker_pid(self, wid: int) -> int | None:
        hb = self.coord.workers().get(wid)
        if hb is None or "pid" not in hb:
            return None
        pid = int(hb["pid"])
        # only a process our launcher started (a child of it), and still alive
        return pid if pid in children(self.proc.pid) else None

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            print(self.log.read_text()[-3000:])

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())


@pytest.fixture
def redis_srv(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def launch(tmp_path, redis_srv):
    """``launch(*args)`` starts streamrl-launch; teardown stops whatever is left of it."""
    runs: list[Run] = []

    def start(*args: str, steps: int, rollers: int = 2, extra=()) -> Run:
        run_dir = tmp_path / "run"
        run_id = f"chaos-{os.getpid()}-{len(runs)}-{int(time.time())}"
        log = tmp_path / "launch.log"
        cmd = [sys.executable, "-m", "streamrl.launcher.launch", "--config", str(REPO / "configs/tiny.yaml"),
               "--learners", "1", "--rollers", str(rollers), "--steps", str(steps), "--run-dir", str(run_dir),
               "--redis-url", redis_srv.url, "--run-id", run_id, *args, *FAST, *extra]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        run = Run(proc, run_dir, run_id, Coordinator(redis_srv.url, run_id), log)
        runs.append(run)
        return run

    yield start
    for run in runs:
        if run.proc.poll() is None:
            kids = children(run.proc.pid)
            run.proc.send_signal(signal.SIGTERM)  # the launcher stops its children in order
            try:
                run.proc.wait(60)
            except subprocess.TimeoutExpired:
                for pid in kids:  # each child leads its own process group
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                run.proc.kill()
                run.proc.wait()


def check_consistent(run: Run, steps: int) -> dict:
    """What every chaos scenario asserts about the finished run; returns the summary."""
    s = run.summary()
    acc = s["accounting"]
    print("ACCOUNTING", json.dumps({k: s.get(k) for k in ("status", "steps", "final_version", "resumed_from_step",
                                                         "redis_reasserts")}), json.dumps(acc))
    assert s["status"] == "completed" and s["steps"] == steps
    assert acc["balanced"], acc  # accepted == trained + pending + lost; produced >= that + rejected
    assert acc["duplicated"] == 0  # no trajectory trained twice
    # every trajectory the workers handed to the transport is accounted for
    assert acc["produced"] == acc["trained"] + acc["pending_at_end"] + acc["lost_total"] + acc["rejected_trajectories"]
    assert acc["trained"] == steps * 4 * 8  # groups_per_step * group_size per step, no more, no less
    # the published version in Redis is the learner's final one, with a complete manifest
    assert run.coord.current_version() == s["final_version"] >= steps
    manifest = run.coord.manifest(s["final_version"])
    assert manifest is not None and manifest["state"] == "complete"
    # the final checkpoint exists and loads (same model, exact step)
    from streamrl.config import load_config
    from streamrl.learner.run_checkpoint import latest_checkpoint, load_checkpoint
    from streamrl.learner.trainer import Trainer

    cfg = load_config(str(REPO / "configs/tiny.yaml"), [f"run.run_dir={run.run_dir}", *FAST])
    ck = latest_checkpoint(run.run_dir / "checkpoints")
    assert ck is not None and ck.name == f"step_{steps:08d}"
    state, _, _ = load_checkpoint(ck, Trainer(cfg))
    assert state["step"] == steps and state["run"]["version"] == s["final_version"]
    assert state["intake"]["ledger"]["trained"] == acc["trained"]
    return s


def fault_line(name: str, detected_s: float, recovered_s: float, s: dict, **more) -> None:
    """Print the ``FAULT`` line docs/faults.md's measured table is made from (``more``: case details)."""
    acc = s["accounting"]
    print("FAULT", json.dumps({"case": name, "detected_s": round(detected_s, 1), "recovered_s": round(recovered_s, 1),
                               "ledger": {k: acc[k] for k in ("produced", "trained", "pending_at_end", "lost_total",
                                                              "rejected_trajectories", "duplicated")},
                               "lost": acc["lost"], **more}))


def check_ledger(s: dict, lost_ok: set[str] = frozenset({"stale"})) -> dict:
    """The ledger of a finished or cleanly stopped run's summary ``s``: every trajectory produced
    is trained, pending or dropped by a counted reason in ``lost_ok``; none trained twice."""
    acc = s["accounting"]
    print("ACCOUNTING", json.dumps({k: s.get(k) for k in ("status", "steps", "final_version")}), json.dumps(acc))
    assert acc["balanced"] and acc["duplicated"] == 0, acc
    assert acc["produced"] == acc["trained"] + acc["pending_at_end"] + acc["lost_total"] + acc["rejected_trajectories"]
    assert acc["trained"] == s["steps"] * 4 * 8  # groups_per_step * group_size (FAST) per step
    assert set(acc["lost"]) <= set(lost_ok), acc["lost"]
    return acc
