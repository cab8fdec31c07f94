"""Soak: the tiny run for ``SOAK_MINUTES`` (30) with a random fault every ``SOAK_FAULT_EVERY_S``
(120 s), then a clean stop (Ctrl-C) and the ledger. Only ``pytest -m soak`` runs it (no tier does).

Faults, drawn with ``SOAK_SEED`` (printed, to replay a run): a rollout worker SIGKILLed or
SIGSTOPped past ``deadlines.stuck_s``, Redis SIGSTOPped for 8 s or restarted empty, the learner's
rank SIGKILLed. After each the run must train again within ``RECOVER_S``; each prints a ``FAULT``
line with its detection and recovery times.
"""
from __future__ import annotations

import os
import random
import signal
import time

import pytest

from .conftest import check_ledger, fault_line, wait_for

MINUTES = float(os.environ.get("SOAK_MINUTES", "30"))
EVERY_S = float(os.environ.get("SOAK_FAULT_EVERY_S", "120"))
SEED = int(os.environ.get("SOAK_SEED", str(random.randrange(1 << 16))))
RECOVER_S = 240.0  # a learner restart (imports, checkpoint, journal replay) takes ~30-60 s on 2 busy cores
DEADLINES = ["deadlines.heartbeat_s=3", "deadlines.stuck_s=6"]
pytestmark = [pytest.mark.soak, pytest.mark.timeout(int(MINUTES * 60 + 2 * RECOVER_S + 300))]


def _worker_sigkill(run, rng, redis_srv) -> float:
    """SIGKILL a worker; detected when the learner notes it gone or a new one of that id beats."""
    w = rng.randrange(2)
    pid = wait_for(lambda: run.worker_pid(w), RECOVER_S, f"worker {w}")
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    wait_for(lambda: run.worker_pid(w) not in (None, pid), RECOVER_S, f"a new worker {w}")
    return t0


def _worker_sigstop(run, rng, redis_srv) -> float:
    """SIGSTOP a worker: the watchdog reports it stuck at deadlines.stuck_s and replaces it."""
    w = rng.randrange(2)
    pid = wait_for(lambda: run.worker_pid(w), RECOVER_S, f"worker {w}")
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        wait_for(lambda: run.worker_pid(w) not in (None, pid), RECOVER_S, f"worker {w} replaced")
    finally:
        try:
            os.kill(pid, signal.SIGCONT)  # killed by the watchdog by now
        except ProcessLookupError:
            pass
    return t0


def _redis_sigstop(run, rng, redis_srv) -> float:
    """Freeze Redis for 8 s (past the clients' 5 s socket timeout), then let it go on."""
    t0 = time.monotonic()
    os.kill(redis_srv.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(8.0)  # the fault's duration
    finally:
        os.kill(redis_srv.proc.pid, signal.SIGCONT)
    return t0


def _redis_restart(run, rng, redis_srv) -> float:
    """Restart Redis empty (no persistence) on the same port."""
    t0 = time.monotonic()
    redis_srv.stop()
    redis_srv.start()
    return t0


def _learner_sigkill(run, rng, redis_srv) -> float:
    """SIGKILL the learner's rank: torchrun fails, the launcher resumes it (checkpoint + journal)."""
    pid = wait_for(lambda: run.learner_rank_pid(), RECOVER_S, "the learner rank")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: run.learner_rank_pid() not in (None, pid), RECOVER_S, "a resumed learner")
    return t0


FAULTS = {"worker SIGKILL": _worker_sigkill, "worker SIGSTOP": _worker_sigstop, "Redis SIGSTOP 8 s": _redis_sigstop,
          "Redis restart": _redis_restart, "learner SIGKILL": _learner_sigkill}


def _inject(name: str, run, rng, redis_srv) -> tuple[float, float]:
    """Inject fault ``name``; returns (seconds until handled, seconds until the learner trained 3 more steps)."""
    before = run.steps()
    t0 = FAULTS[name](run, rng, redis_srv)
    handled = time.monotonic() - t0
    wait_for(lambda: run.proc.poll() is not None or run.steps() >= before + 3, RECOVER_S,
             f"3 learner steps after {name}")
    assert run.proc.poll() is None, f"the launcher exited after {name}"
    return handled, time.monotonic() - t0


def test_soak_random_faults_ledger_balanced(launch, redis_srv):
    """Deadline SOAK_MINUTES + ~13 min. A fault every SOAK_FAULT_EVERY_S; each is recovered from
    within RECOVER_S; after the clean stop nothing is lost but counted stale drops."""
    print(f"SOAK seed {SEED}: {MINUTES:g} min, a fault every {EVERY_S:g} s")
    rng = random.Random(SEED)
    run = launch("--max-restarts", "1000", "--restart-backoff", "0.5", "--learner-restarts", "1000",
                 steps=10**7, extra=DEADLINES)
    wait_for(lambda: run.steps() >= 3, RECOVER_S, "3 learner steps")
    start = time.monotonic()
    end, injected = start + MINUTES * 60, []
    while time.monotonic() + EVERY_S <= end:
        next_at = start + EVERY_S * (len(injected) + 1)
        while time.monotonic() < next_at:  # the schedule, not a wait for state
            assert run.proc.poll() is None, "the launcher exited between faults"
            time.sleep(1.0)
        name = rng.choice(sorted(FAULTS))
        handled, recovered = _inject(name, run, rng, redis_srv)
        injected.append(name)
        print("SOAK", name, f"handled {handled:.1f} s, training again {recovered:.1f} s after", flush=True)
    run.proc.send_signal(signal.SIGINT)  # Ctrl-C: the learner finishes its step and checkpoints
    assert run.wait(RECOVER_S) == 130
    s = run.summary()
    check_ledger(s)
    assert s["status"].startswith("stopped"), s["status"]
    fault_line(f"soak {MINUTES:g} min", 0.0, time.monotonic() - start, s, faults=injected, seed=SEED,
               steps=s["steps"])
