"""Fast pieces behind stuck detection and deadlines (default tier): the stall rule, a hung reward
plug-in under its deadline, the launcher's watchdog on a real SIGSTOPped process, the diagnosis."""
from __future__ import annotations

import json
import signal
import sys
import threading
import time

from streamrl.coord import liveness
from streamrl.coord.coordinator import Coordinator
from streamrl.coord.liveness import DeadlineExceeded, stall
from streamrl.launcher.diagnosis import Fault, diagnosis, resume_command, tail
from streamrl.launcher.process import ManagedProcess
from streamrl.launcher.runstate import RunState
from streamrl.launcher.watchdog import Watchdog
from streamrl.rollout.timed_reward import TimedReward, bound_plugins, reward_timeouts


def test_stall_rule_silence_and_working_phase():
    now = 1000.0
    beat = {"time": now - 1, "phase": liveness.GENERATING, "phase_since": now - 5}
    assert stall(beat, now, stuck_s=10, batch_s=60) is None
    frozen = stall({**beat, "time": now - 11}, now, stuck_s=10, batch_s=60)
    assert frozen.phase == "generating" and "no heartbeat for 11 s" in frozen.why and frozen.since == now - 11
    long = stall({**beat, "phase_since": now - 61}, now, stuck_s=10, batch_s=60)
    assert long.since == now - 61 and "deadlines.batch_s" in long.why
    # waiting is not stuck: the worker bounds its own waits (deadlines.admission_s)
    assert stall({**beat, "phase": liveness.WAITING_ADMISSION, "phase_since": now - 600}, now, 10, 60) is None
    assert stall(None, now, 10, 60) is None
    e = DeadlineExceeded("rollout-3", "admission of 2 prompt groups", 61.4, "deadlines.admission_s = 60 s")
    assert str(e) == "rollout-3: waited 61 s for admission of 2 prompt groups (deadline deadlines.admission_s = 60 s)"


def test_hung_reward_plugin_scores_zero_and_is_counted():
    release = threading.Event()

    def hangs(problem, response):  # a plug-in stuck on a service that never answers
        release.wait(30)
        return 1.0

    fns = bound_plugins(["exact_answer", "m:hangs"], [lambda p, r: 1.0, hangs], timeout_s=0.2)
    assert not isinstance(fns[0], TimedReward) and isinstance(fns[1], TimedReward)
    t0 = time.monotonic()
    assert fns[1](None, "x") == 0.0 and fns[1](None, "y") == 0.0
    assert time.monotonic() - t0 < 2.0
    assert reward_timeouts(fns) == 2
    release.set()
    quick = TimedReward(lambda p, r: 0.5, "m:quick", 1.0)
    assert quick(None, "x") == 0.5 and quick.timeouts == 0


def test_watchdog_restarts_a_frozen_worker(redis_url, run_id, tmp_path):
    coord = Coordinator(redis_url, run_id)
    state = RunState(coord, run_id)
    worker = ManagedProcess("rollout-0", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "w.log")
    worker.start()
    said: list[str] = []
    try:
        dog = Watchdog(state, stuck_s=2.0, batch_s=600.0, say=said.append)
        coord.heartbeat(0, {"pid": worker.pid, "phase": liveness.GENERATING, "phase_since": time.time()}, ttl_s=1.0)
        assert dog.check([worker]) == []  # fresh heartbeat: working
        worker.signal(signal.SIGSTOP)  # frozen: alive, silent; its heartbeat key expires
        deadline = time.monotonic() + 20
        found = []
        while not found:
            assert time.monotonic() < deadline, "the frozen worker was never reported"
            dog._next = 0.0  # check on every poll of this test
            dog._checked = time.monotonic()  # the test polls faster than the supervisor: no blind gap
            found = dog.check([worker])
            time.sleep(0.1)
        assert found[0][0] is worker and found[0][1].startswith("stuck in phase generating: no heartbeat")
        assert worker.proc.wait(10) == -signal.SIGKILL  # killed for the supervisor to restart
        report = json.loads(state.stuck()["rollout-0"])
        assert report["phase"] == "generating" and "no heartbeat" in report["why"]
        assert any("rollout-0 stuck in phase generating" in s for s in said)
    finally:
        worker.stop(grace_s=1)


def test_watchdog_does_not_count_its_own_blindness(redis_url, run_id, tmp_path):
    """A long gap between checks (Redis frozen for every process alike) restarts silence counting."""
    coord = Coordinator(redis_url, run_id)
    worker = ManagedProcess("rollout-1", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "w.log")
    worker.start()
    try:
        dog = Watchdog(RunState(coord, run_id), stuck_s=2.0, batch_s=600.0, say=lambda s: None)
        coord.heartbeat(1, {"pid": worker.pid, "phase": liveness.GENERATING, "time": 0}, ttl_s=30.0)
        coord.r.set(coord.keys.heartbeat(1), json.dumps({"pid": worker.pid, "phase": "generating",
                                                         "time": time.time() - 30}), ex=30)
        assert dog.check([worker]) == []  # first sight: 30 s of silence before it do not count
        assert worker.alive()
    finally:
        worker.stop(grace_s=1)


def test_diagnosis_names_the_first_fault_its_log_and_the_resume_command(tmp_path):
    log = tmp_path / "rollout-0.log"
    log.write_text("".join(f"line {i}\n" for i in range(50)))
    assert tail(log, 3) == ["line 47", "line 48", "line 49"]
    cmd = resume_command(["--config", "c.yaml", "--steps", "5", "--resume"])
    assert cmd == "streamrl-launch --config c.yaml --steps 5 --resume"
    text = diagnosis(["all rollout workers failed"],
                     [Fault(0.0, "rollout-0", "stuck in phase generating: no heartbeat for 61 s", log),
                      Fault(1.0, "rollout-0", "exited with code -9", log)], cmd)
    assert "the run failed: all rollout workers failed" in text
    assert "first fault: rollout-0 stuck in phase generating" in text and "| line 49" in text and "| line 29" not in text
    assert text.endswith(f"resume: {cmd}")


def test_monitor_shows_stuck_workers_phase_and_the_launchers_report(redis_url, run_id):
    from rich.console import Console

    from streamrl.config import Config
    from streamrl.monitor.snapshot import SnapshotBuilder
    from streamrl.monitor.source import RunSource
    from streamrl.monitor.ui import render

    coord = Coordinator(redis_url, run_id)
    cfg = Config()
    cfg.deadlines.batch_s = 60.0
    coord.put_config(cfg.to_dict())
    now = time.time()
    coord.heartbeat(0, {"pid": 1, "state": "generating", "phase": liveness.GENERATING, "phase_since": now - 90,
                        "incarnation": 1})  # beating, but one batch for 90 s > batch_s
    coord.heartbeat(1, {"pid": 2, "state": "waiting_admission", "phase": liveness.WAITING_ADMISSION,
                        "phase_since": now - 90, "incarnation": 1})  # waiting is not stuck
    RunState(coord, run_id).record_stuck("rollout-1", json.dumps(
        {"process": "rollout-1", "phase": "generating", "since": now - 200, "why": "no heartbeat for 61 s"}))
    source = RunSource(redis_url, run_id)
    snap = SnapshotBuilder(window_s=30).build(run_id, {}, source.refresh())
    rows = {w["id"]: w for w in snap["workers"]}
    assert rows[0]["status"] == "stuck" and rows[0]["phase"] == "generating" and rows[0]["phase_s"] >= 90
    assert rows[1]["status"] == "alive" and rows[1]["stuck"]["why"] == "no heartbeat for 61 s"
    console = Console(width=160, record=True)
    console.print(render(snap, redis_url))
    text = console.export_text()
    assert "stuck" in text and "rollout-1 was stuck in phase generating" in text


def test_a_plugin_that_always_hangs_is_bypassed_after_max_hung(monkeypatch):
    from streamrl.rollout import timed_reward

    monkeypatch.setattr(timed_reward, "MAX_HUNG", 2)
    never = threading.Event()
    fn = TimedReward(lambda p, r: never.wait(), "m:always", 0.05)
    scores = [fn(None, str(i)) for i in range(5)]
    assert scores == [0.0] * 5 and fn.timeouts == 5
    assert len(fn._hung) == 2  # no thread started once two hang
    never.set()


def test_resume_hint_only_with_a_checkpoint(tmp_path):
    from types import SimpleNamespace

    from streamrl.config import Config
    from streamrl.launcher.runner import _resume_hint

    cfg = Config()
    cfg.run.run_dir = str(tmp_path)
    launch = SimpleNamespace(head=True, argv=["--steps", "5"], cfg=cfg)
    assert _resume_hint(launch) is None  # nothing to resume from yet
    (tmp_path / "checkpoints" / "step_00000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000004" / "learner_state.json").write_text("{}")  # what marks it complete
    assert _resume_hint(launch) == "streamrl-launch --steps 5 --resume"
