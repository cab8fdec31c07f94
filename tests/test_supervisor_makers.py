"""The supervisor ends a run whose rollout workers all failed even while helper processes
(evaluator, role servers) are still alive: they make no batches, so the learner would wait forever."""
from __future__ import annotations

import sys

from streamrl.coord.coordinator import Coordinator
from streamrl.launcher.process import ManagedProcess
from streamrl.launcher.runstate import RunState
from streamrl.launcher.supervisor import Supervisor


def test_all_workers_failed_ends_the_run_while_a_helper_lives(redis_url, run_id, tmp_path):
    worker = ManagedProcess("rollout-0", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "w.log")
    helper = ManagedProcess("evaluator", [sys.executable, "-c", "import time; time.sleep(120)"], tmp_path / "e.log",
                            makes_batches=False)
    sup = Supervisor(RunState(Coordinator(redis_url, run_id), run_id), learner=None, rollers=[worker, helper],
                     head=True, host="test", stop_grace_s=5.0)
    failures = sup.run()  # returns once the worker's failure is seen; shutdown() stops the helper
    assert failures == ["all rollout workers failed"]
    assert helper.proc is None or helper.proc.poll() is not None  # stopped with the run
