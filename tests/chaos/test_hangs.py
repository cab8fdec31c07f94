"""Chaos scenarios for processes that stop without dying, on real processes and a real Redis.

Each test runs ``streamrl-launch`` (1 learner rank, 2 rollout workers, the tiny model; see
``conftest.launch``) with short deadlines (config overrides), injects one hang, waits on the
state that shows it was handled (log lines, Redis keys), and checks the finished run with
``check_consistent``: completed, ledger balanced (produced = trained + pending + counted drops),
nothing trained twice. Each test states its deadline (``pytest.mark.timeout``) and prints a
``FAULT`` line with its detection and recovery times for the fault table in docs/faults.md.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from .conftest import check_consistent, children, cmdline, wait_for

pytestmark = [pytest.mark.chaos]
SHORT = ["deadlines.heartbeat_s=3", "deadlines.stuck_s=6"]


def _log(run, name: str) -> str:
    path = run.run_dir / "logs" / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _fault_line(name: str, detected_s: float, recovered_s: float, s: dict) -> None:
    acc = s["accounting"]
    print("FAULT", json.dumps({"case": name, "detected_s": round(detected_s, 1), "recovered_s": round(recovered_s, 1),
                               "ledger": {k: acc[k] for k in ("produced", "trained", "pending_at_end", "lost_total",
                                                              "rejected_trajectories", "duplicated")},
                               "lost": acc["lost"]}))


@pytest.mark.timeout(240)
def test_worker_sigstopped_past_its_deadline_is_detected_refunded_and_replaced(launch):
    """Deadline 240 s. Worker 0 SIGSTOPped: the learner refunds its groups once its heartbeat is
    3 s old, the launcher reports it stuck at 6 s and kills it, a new worker 0 takes its place."""
    steps = 400  # a tiny step takes ~0.15 s: long enough to detect (6 s) and replace (~15 s of imports)
    run = launch("--max-restarts", "3", "--restart-backoff", "0.5", steps=steps, extra=SHORT)
    pid = wait_for(lambda: run.worker_pid(0), 150, "worker 0 heartbeat")
    wait_for(lambda: run.steps() >= 2, 150, "2 learner steps")
    assert run.proc.poll() is None and run.steps() < steps, "run ended before the fault could be injected"
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: "rollout-0 stuck in phase" in run.log.read_text(), 60, "the launcher reporting worker 0 stuck")
        detected = time.monotonic() - t0
        wait_for(lambda: "worker 0 left" in _log(run, "learner"), 30, "the learner refunding worker 0's groups")
    finally:
        try:
            os.kill(pid, signal.SIGCONT)  # too late: the launcher has killed it
        except ProcessLookupError:
            pass
    new = wait_for(lambda: run.worker_pid(0) not in (None, pid) and run.worker_pid(0), 150, "a new worker 0")
    recovered = time.monotonic() - t0
    assert run.wait(200) == 0
    s = check_consistent(run, steps)
    assert set(s["accounting"]["lost"]) <= {"stale"}, s["accounting"]["lost"]
    report = json.loads(run.coord.r.hget(f"streamrl:{run.run_id}:launch:stuck", "rollout-0"))
    assert report["pid"] == pid and "no heartbeat" in report["why"] and report["phase"]
    assert new != pid and "rollout-0      exit codes [-9" in run.log.read_text()
    _fault_line("worker SIGSTOP", detected, recovered, s)


def _unreachable_in_every_log(run) -> bool:
    return all("unreachable" in _log(run, name) for name in ("learner", "rollout-0", "rollout-1"))


@pytest.mark.timeout(240)
def test_redis_sigstopped_every_process_waits_named_and_resumes(launch, redis_srv):
    """Deadline 240 s. Redis SIGSTOPped until every process logged that it waits for it (its
    calls time out and retry for up to deadlines.redis_outage_s = 60 s), then SIGCONTed."""
    steps = 300  # long enough that the run is still going when Redis is back (~10 s of outage)
    run = launch(steps=steps, extra=SHORT)
    wait_for(lambda: run.steps() >= 3, 150, "3 learner steps")
    assert run.proc.poll() is None and run.steps() < steps, "run ended before the fault could be injected"
    t0 = time.monotonic()
    os.kill(redis_srv.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: _unreachable_in_every_log(run), 50, "every process naming the Redis it waits for")
        detected = time.monotonic() - t0
    finally:
        os.kill(redis_srv.proc.pid, signal.SIGCONT)
    wait_for(lambda: all("reachable again" in _log(run, n) for n in ("learner", "rollout-0", "rollout-1")), 60,
             "every process reaching Redis again")
    recovered = time.monotonic() - t0
    assert run.wait(200) == 0
    s = check_consistent(run, steps)
    assert set(s["accounting"]["lost"]) <= {"stale"}, s["accounting"]["lost"]
    for w in (0, 1):
        assert _log(run, f"rollout-{w}").count("=== start") == 1, f"rollout-{w} restarted"  # waited, never died
    assert "stuck in phase" not in run.log.read_text()  # an outage of Redis is nobody's stall
    _fault_line("Redis SIGSTOP", detected, recovered, s)


@pytest.mark.timeout(240)
def test_hanging_reward_plugin_is_timed_out_scored_and_counted(launch):
    """Deadline 240 s. A reward plug-in whose 1st, 3rd and 5th calls never return, under
    deadlines.reward_s = 1 s: each is scored 0.0, counted in rollout/reward_timeouts, and the run
    completes."""
    steps = 20
    rewards = "rollout.rewards=task=1.0,tests.chaos.hanging_reward:sometimes_hangs=0.5"
    t0 = time.monotonic()
    run = launch(steps=steps, extra=[*SHORT, "deadlines.reward_s=1", rewards])
    wait_for(lambda: all("gave no score within 1 s" in _log(run, f"rollout-{w}") for w in (0, 1)), 150,
             "both workers timing out the plug-in")
    detected = time.monotonic() - t0
    assert run.wait(200) == 0
    s = check_consistent(run, steps)
    metrics = run.coord.latest_metrics()
    for w in (0, 1):
        assert metrics[f"rollout-{w}"]["rollout/reward_timeouts"] == 3, metrics[f"rollout-{w}"]
        assert _log(run, f"rollout-{w}").count("=== start") == 1  # timed out, never restarted
    assert set(s["accounting"]["lost"]) <= {"stale"}, s["accounting"]["lost"]
    _fault_line("reward plug-in hangs", detected, time.monotonic() - t0, s)


def _rank_pid(run, rank: int) -> int | None:
    """Learner rank ``rank`` (a child of the torchrun agent, told apart by its RANK variable)."""
    agent = run.learner_pid()
    for pid in children(agent) if agent else []:
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and "streamrl.workers.learner" in cmdline(pid):
            return pid
    return None


@pytest.mark.timeout(420)
def test_one_learner_rank_of_two_sigstopped_the_job_restarts_from_its_checkpoint(launch):
    """Deadline 420 s. Learner rank 1 of 2 SIGSTOPped after a checkpoint: rank 0's next collective
    fails after deadlines.collective_s = 20 s, the job fails, the launcher restarts it with
    --resume (--learner-restarts 1), and the run completes with nothing trained twice."""
    steps = 60
    run = launch("--learners", "2", "--learner-restarts", "1", steps=steps,
                 extra=[*SHORT, "deadlines.collective_s=20"])
    wait_for(lambda: run.latest_checkpoint_step() >= 4, 240, "a checkpoint")
    pid = wait_for(lambda: _rank_pid(run, 1), 30, "learner rank 1")
    assert run.proc.poll() is None and run.steps() < steps, "run ended before the fault could be injected"
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: "restart 1/1 with --resume" in run.log.read_text(), 150, "the learner job restarted")
        detected = time.monotonic() - t0
    finally:
        try:
            os.kill(pid, signal.SIGCONT)  # the old job's rank: killed with its agent by now
        except ProcessLookupError:
            pass
    assert run.wait(240) == 0
    s = check_consistent(run, steps)
    assert s["resumed_from_step"] >= 4
    assert set(s["accounting"]["lost"]) <= {"stale"}, s["accounting"]["lost"]
    _fault_line("learner rank SIGSTOP", detected, time.monotonic() - t0, s)
