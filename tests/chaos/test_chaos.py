"""Chaos scenarios on real processes: SIGKILLed workers and learner, a Redis restart, fuzzed frames.

Each test runs ``streamrl-launch`` (1 learner rank, 2 rollout workers, the tiny model) against
a redis-server the test owns, injects one kind of fault mid-run, and asserts the outcome:
the run completes, the trajectory accounting balances with no trajectory trained twice, and
the final model is consistent (see ``check_consistent``).
"""
from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch
import zmq

from .conftest import check_consistent, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]


def test_worker_sigkilled_three_times(launch):
    steps = 400  # long enough for three worker restarts (each ~10-30 s of imports on 2 busy cores)
    run = launch("--max-restarts", "5", "--restart-backoff", "0.5", steps=steps)
    kills = []
    for i in range(3):
        pid = wait_for(lambda: run.worker_pid(0) not in (None, *kills) and run.worker_pid(0), 200,
                       f"worker 0 (incarnation {i + 1}) heartbeat", )
        wait_for(lambda: run.steps() >= 2, 120, "learner steps")
        assert run.proc.poll() is None and run.steps() < steps, "run ended before the fault could be injected"
        os.kill(pid, signal.SIGKILL)
        kills.append(pid)
    assert run.wait(280) == 0
    s = check_consistent(run, steps)
    acc = s["accounting"]
    assert set(acc["lost"]) <= {"stale"}, acc["lost"]  # only the staleness policy drops anything
    out = run.log.read_text()
    assert "rollout-0      exit codes [-9, -9, -9" in out and "restarts 3" in out


def _kill_learner_between_checkpoints(run, incarnation: int, killed: list[int]) -> None:
    """SIGKILL learner rank 0 of ``incarnation`` once it has journaled batches after its newest
    checkpoint (so the journal and the workers' retention both have something to recover)."""
    pid = wait_for(lambda: run.learner_rank_pid() not in (None, *killed) and run.learner_rank_pid(), 200,
                   f"learner incarnation {incarnation}")
    started_at = run.latest_checkpoint_step()  # it resumes from here (its replay lands after it)
    wait_for(lambda: run.journaled_after(incarnation, started_at) >= 1, 200,
             f"learner incarnation {incarnation}: a checkpoint of its own, then journal entries")
    assert run.proc.poll() is None, "run ended before the fault could be injected"
    os.kill(pid, signal.SIGKILL)  # the training process dies; torchrun reports the failure
    killed.append(pid)


def _lossless(s: dict) -> None:
    acc = s["accounting"]
    # nothing produced was lost: what the dead learner journaled is replayed, what it had not
    # journaled (read, or still on its socket) the workers resend; stale drops are the policy
    assert set(acc["lost"]) <= {"stale"}, acc["lost"]
    assert acc["produced"] == acc["trained"] + acc["pending_at_end"] + acc["lost_total"] + acc["rejected_trajectories"]


def test_learner_sigkilled_and_resumed(launch):
    steps = 80
    run = launch("--learner-restarts", "1", steps=steps)
    _kill_learner_between_checkpoints(run, 0, [])
    assert run.wait(280) == 0
    s = check_consistent(run, steps)
    assert s["resumed_from_step"] >= 4
    assert s["accounting"]["replayed_from_journal"] > 0  # accepted after the checkpoint, recovered from the journal
    _lossless(s)
    assert s["final_version"] > steps  # versions never went back: the resumed learner skipped ahead
    assert "restart 1/1 with --resume" in run.log.read_text()


@pytest.mark.timeout(900)
def test_learner_sigkilled_three_times(launch):
    steps = 160
    run = launch("--learner-restarts", "3", steps=steps)
    killed: list[int] = []
    for incarnation in range(3):
        _kill_learner_between_checkpoints(run, incarnation, killed)
    assert run.wait(600) == 0
    s = check_consistent(run, steps)
    _lossless(s)
    assert "restart 3/3 with --resume" in run.log.read_text()


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_torchrun_agent_sigkilled_takes_its_rank_and_the_run_resumes(launch):
    # SIGKILL the agent, not the rank: torchrun keeps ranks in their own sessions, so without
    # die_with_parent the old rank would keep training, holding the port and double-counting.
    steps = 80
    run = launch("--learner-restarts", "1", steps=steps)
    wait_for(lambda: run.journaled_after(0, 0) >= 1, 180, "a checkpoint, then journal entries after it")
    agent, rank = run.learner_pid(), run.learner_rank_pid()
    assert agent is not None and rank is not None and run.proc.poll() is None, "too late to inject the fault"
    os.kill(agent, signal.SIGKILL)
    wait_for(lambda: _exited(rank), 15, "the orphaned rank to exit")
    assert run.wait(280) == 0
    s = check_consistent(run, steps)
    assert s["resumed_from_step"] >= 4
    _lossless(s)
    assert "restart 1/1 with --resume" in run.log.read_text()


def test_redis_restarted_mid_run(launch, redis_srv):
    steps = 60
    run = launch(steps=steps)
    wait_for(lambda: run.steps() >= 5, 180, "5 learner steps")
    redis_srv.stop()
    time.sleep(2.0)  # everything is disconnected for a while
    redis_srv.start()  # same port, empty: no persistence
    assert run.wait(280) == 0
    s = check_consistent(run, steps)
    acc = s["accounting"]
    assert s["redis_reasserts"] >= 1
    assert set(acc["lost"]) <= {"stale"} and acc["duplicated"] == 0, acc
    logs = run.run_dir / "logs"
    learner_log = (logs / "learner.log").read_text()
    assert "unreachable" in learner_log and "re-asserting" in learner_log
    for w in (0, 1):
        text = (logs / f"rollout-{w}.log").read_text()
        assert text.count("=== start") == 1, f"rollout-{w} restarted"  # survived, no crash


def _frames(worker: int, **bad):
    """A valid trajectory message of ``worker``, then broken as asked."""
    from streamrl.trajectory import SCHEMA_VERSION, pack_trajectories
    from streamrl.transport.codec import encode

    n = 8
    td = pack_trajectories([[1, 2, 3]] * n, [[4, 5]] * n, [[-0.5, -0.25]] * n, [[bad.get("version", 0)] * 2] * n,
                           [0.5] * n, [worker << 40 | 1] * n, [(worker << 40) | (1000 + i + random.randrange(1 << 30))
                                                               for i in range(n)], worker, time.time())
    if "reward" in bad:
        td["reward"][0] = bad["reward"]
    if "logprob" in bad:
        td["behaviour_logprobs"][1] = bad["logprob"]
    meta = {"worker_id": worker, "session": random.randrange(1 << 62), "seq": 0,
            "trajectory_schema": bad.get("schema", SCHEMA_VERSION), "sent_at": time.time()}
    return encode(dict(td.items()), "trajectories", meta)


def test_fuzzed_frames_during_a_run(launch):
    # Long enough that the run is still reading its socket when the last fuzzed message lands:
    # on an idle machine a tiny step takes ~0.1 s, and the fuzz below takes ~3 s to send.
    steps = 150
    run = launch(steps=steps, extra=["transport.max_message_bytes=262144"])
    endpoint = wait_for(lambda: run.coord.r.get(run.coord.keys.endpoint("trajectories")), 120, "endpoint")
    wait_for(lambda: run.steps() >= 3, 180, "3 learner steps")
    ctx = zmq.Context()
    rng = random.Random(0)

    def send(frames) -> None:  # one fresh peer per message: its own credit window and pipe
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 500
        sock.connect(endpoint)
        sock.send_multipart(frames)
        time.sleep(0.05)
        sock.close()

    try:
        for _ in range(30):  # random bytes, random frame counts
            send([rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(1, 5))])
        good = _frames(900)
        send(good[:1])  # header without its buffers
        send([good[0]] + [b"\x00" * 3 for _ in good[1:]])  # buffers of the wrong size
        send(_frames(900, schema=99))
        send(_frames(900, version=10**9))  # future policy version
        send(_frames(900, reward=float("nan")))
        send(_frames(900, logprob=float("inf")))
        send([good[0], b"\x00" * 200_000, b"\x00" * 200_000])  # frames fit, the message is oversized
        send(_frames(900))  # well-formed, but worker 900 never registered
    finally:
        ctx.destroy(linger=0)
    assert run.wait(280) == 0
    s = check_consistent(run, steps)
    t = s["transport"]
    acc = s["accounting"]
    assert t["transport/rejected"] >= 20
    for reason in ("bad_schema_version", "future_version", "non_finite", "oversized"):
        assert any(k.startswith("transport/rejected_") and reason in k and v >= 1 for k, v in t.items()), (reason, t)
    assert acc["rejected_messages"].get("unknown_worker", 0) >= 1
    assert set(acc["lost"]) <= {"stale"}, acc["lost"]
    assert torch.isfinite(torch.tensor(s["reward_last"]))
