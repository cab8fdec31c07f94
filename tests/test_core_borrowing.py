"""Core borrowing (streamrl.core_lending): a CPU rollout worker decodes with the learner's threads
while the learner's published phase says it waits for data, gives them back within one decode
step once it says busy, and never borrows while the learner borrows the worker's.

Real Redis, the real rollout worker and hf_fast engine; the decode steps are released one at a
time by the test (a semaphore in front of ``engine.decode_step``) so each step's thread count is read
at a known learner phase. Every check waits on state (offers, worker state), never on a sleep."""
from __future__ import annotations

import queue
import socket
import threading
import time

import pytest
import torch

from streamrl.config import load_config
from streamrl.coord.coordinator import Coordinator
from streamrl.core_lending import (BORROWABLE_ENV, BUSY, IDLE_STATES, WAITING, CoreBorrower, CoreLender, LearnerPhase,
                                   make_core_borrower, make_learner_phase)
from tests.test_worker_heartbeat import gated_worker

LONG = ("rollout.max_new_tokens=8",)  # room for the three phases' decode steps


def _wait(cond, what, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what()
        time.sleep(0.02)


class SteppedDecode:
    """Holds the worker's decode loop before each step's hook (where it takes or gives back
    threads) until :meth:`step` releases one; records the decode thread's intra-op thread count
    in the step that follows."""

    def __init__(self, worker):
        self.go, self.seen, self.free = threading.Semaphore(0), queue.Queue(), threading.Event()
        engine, real_step, real_hook = worker.engine, worker.engine.decode_step, worker._step_hook

        def held_hook():
            if not self.free.is_set():
                assert self.go.acquire(timeout=60), "test never released the step"
            return real_hook()

        def recorded_step(span, greedy):
            self.seen.put(torch.get_num_threads())
            real_step(span, greedy)

        worker._step_hook, engine.decode_step = held_hook, recorded_step

    def step(self) -> int:
        self.go.release()
        return self.seen.get(timeout=60)

    def run_free(self) -> None:
        self.free.set()
        self.go.release(100)


@pytest.mark.timeout(120)
def test_worker_borrows_learner_threads_while_it_waits(repo, tmp_path, redis_url, run_id, monkeypatch):
    from streamrl.workers import rollout  # noqa: PLC0415 (installed layout of workers/)

    monkeypatch.setenv(BORROWABLE_ENV, "1")
    coord, worker, gate = gated_worker(repo, tmp_path, redis_url, run_id, gate_s=60, overrides=LONG)
    gate.set()
    borrower = worker.borrower
    assert borrower is not None and borrower.borrowable == 1
    borrower.host_load = None  # the shared test host's load must not decide; tested on its own below
    base = worker.threads
    phase = LearnerPhase(Coordinator(redis_url, run_id), threads=1)
    phase.set(BUSY)
    # the learner's own lender beside it: never both sides borrowing
    lender = CoreLender(Coordinator(redis_url, run_id), 1, lendable=worker.threads, poll_s=0.02).start()
    decode = SteppedDecode(worker)
    runner = threading.Thread(target=worker.run, daemon=True)
    try:
        runner.start()
        decode.go.release()  # the prefill's hook
        assert decode.step() == base  # the learner trains: the worker keeps its own threads

        phase.set(WAITING)  # the learner blocks for its next batch
        _wait(lambda: borrower.offer == 1, lambda: coord.r.get(borrower.key))
        assert decode.step() == base + 1  # the next decode step runs with the learner's thread
        assert worker.state == rollout.GENERATING
        _wait(lambda: lender.offer == 0, coord.workers)  # ... and the learner borrows nothing meanwhile

        phase.set(BUSY)  # a batch arrived: the learner trains again
        _wait(lambda: borrower.offer == 0, lambda: coord.r.get(borrower.key))
        assert decode.step() == base  # given back at the next decode step

        reported, real_metrics = [], borrower.metrics
        borrower.metrics = lambda: reported.append(real_metrics()) or reported[-1]  # what the worker reports
        coord.r.set(coord.keys.reserved, 10**6)  # no admission for a next batch
        decode.run_free()  # the batch finishes; the worker waits for admission (idle)
        _wait(lambda: worker.state in IDLE_STATES and reported, lambda: (worker.state, reported))
        assert borrower.threads == base
        _wait(lambda: lender.offer == worker.threads, coord.workers)  # now the learner may borrow
        m = reported[0]
        assert m["rollout/borrow_switches"] == 2 and 0 < m["rollout/borrowed_frac"] < 1
        assert 0 < m["rollout/borrowed_threads_mean"] < 1
    finally:
        worker.stopping = True
        decode.run_free()
        runner.join(30)
        lender.close()
        phase.close()
    assert not runner.is_alive() and worker.borrower.threads == base


@pytest.mark.timeout(120)
def test_lending_off_never_changes_worker_threads(repo, tmp_path, redis_url, run_id, monkeypatch):
    monkeypatch.setenv(BORROWABLE_ENV, "1")
    coord, worker, gate = gated_worker(repo, tmp_path, redis_url, run_id, gate_s=60,
                                       overrides=(*LONG, "placement.lend_idle_cores=false"))
    assert worker.borrower is None
    LearnerPhase(coord, threads=1).set(WAITING)  # a learner waiting on this host
    decode = SteppedDecode(worker)
    decode.run_free()
    gate.set()
    runner = threading.Thread(target=worker.run, daemon=True)
    try:
        runner.start()
        _wait(lambda: decode.seen.qsize() >= 4, lambda: worker.state)  # decode steps of its first batch
    finally:
        worker.stopping = True
        runner.join(30)
    seen = list(decode.seen.queue)
    assert seen and set(seen) == {worker.threads}


def test_borrower_only_from_a_waiting_learner_on_this_host(redis_url, run_id):
    coord = Coordinator(redis_url, run_id)
    borrower = CoreBorrower(coord, 1, borrowable=2)  # not started: polled by hand
    assert borrower.poll() == 0  # no learner phase published
    elsewhere = LearnerPhase(coord, threads=2, host="elsewhere")
    elsewhere.set(WAITING)
    assert borrower.poll() == 0  # another host's learner: not this host's cores
    here = LearnerPhase(coord, threads=2, host=socket.gethostname())
    here.set(WAITING)
    assert borrower.poll() == 2
    here.set(BUSY)
    assert borrower.poll() == 0
    here.set(WAITING)
    here.close()  # the learner left: nothing to borrow
    assert borrower.poll() == 0


def test_make_core_borrower_and_learner_phase_only_where_cores_can_be_lent(redis_url, run_id, monkeypatch):
    coord = Coordinator(redis_url, run_id)
    cfg = load_config("configs/smol-dense.yaml")
    assert make_core_borrower(cfg, coord) is None  # the placement gave it no share
    monkeypatch.setenv(BORROWABLE_ENV, "1")
    borrower = make_core_borrower(cfg, coord)
    try:
        assert borrower is not None and borrower.borrowable == 1
    finally:
        borrower.close()
    for override in ("placement.lend_idle_cores=false", "rollout.engine=hf"):  # off; no per-step hook
        assert make_core_borrower(load_config("configs/smol-dense.yaml", [override]), coord) is None
    phase = make_learner_phase(cfg, coord, local_ranks=1)
    assert phase is not None and phase.phase == BUSY  # a starting learner is not idle
    phase.close()
    assert make_learner_phase(load_config("configs/smol-dense.yaml", ["placement.lend_idle_cores=false"]),
                              coord, 1) is None


@pytest.mark.timeout(60)
def test_no_borrowing_while_other_processes_keep_the_cores_busy(redis_url, run_id):
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from streamrl.core_lending import HostLoad  # noqa: PLC0415

    coord = Coordinator(redis_url, run_id)
    LearnerPhase(coord, threads=1).set(WAITING)  # stale or not: the cores are what counts
    load = HostLoad.open()
    assert load is not None  # Linux: /proc/stat
    borrower = CoreBorrower(coord, 1, borrowable=1, host_load=load)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        _wait(lambda: borrower.poll() == 0 and borrower.others_busy > load.cpus - 0.5, lambda: borrower.others_busy)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
