"""A rollout worker stays alive and "generating" to the learner while one batch takes far longer
than the heartbeat TTL (1k-token batches, and the first batch's compile, take minutes on a GPU:
heartbeats sent only between batches let the learner declare a busy worker gone and hand its
reservations out again). Real Redis, the real worker object and engine; only the batch is held
open, by a gate, for 3x the TTL."""
from __future__ import annotations

import argparse
import threading
import time

import pytest

from streamrl.config import load_config
from streamrl.coord.coordinator import Coordinator
from streamrl.learner.control import ControlPlane
from streamrl.learner.accounting import Ledger

TTL_S = 1.0


def gated_worker(repo, tmp_path, redis_url: str, run_id: str, gate_s: float, overrides: tuple = ()):
    """``(coord, worker, gate)``: the real rollout worker on the tiny config (hf_fast, plus
    ``overrides``) at version 0, whose batches wait for ``gate`` (at most ``gate_s``) before they
    generate; its trajectories go to an endpoint nobody listens on. The caller starts ``worker.run``."""
    from streamrl.workers import rollout  # noqa: PLC0415 (installed layout of workers/)

    cfg = load_config(str(repo / "configs/tiny.yaml"), [f"run.run_dir={tmp_path}", "rollout.engine=hf_fast",
                                                                *overrides])
    coord = Coordinator(redis_url, run_id)
    coord.put_config(cfg.to_dict())
    coord.set_endpoint("trajectories", "tcp://127.0.0.1:9")  # nobody listens: the batch is never delivered
    coord.r.set(coord.keys.version, 0)
    worker = rollout.RolloutWorker(argparse.Namespace(redis_url=redis_url, run_id=run_id, worker_id=0,
                                                      num_workers=1, device=None))
    worker.sync_weights = lambda: 0.0  # the version-0 weights are the ones it built
    worker.subscriber.loaded_version = 0
    gate, real_batch = threading.Event(), worker.roller.rollout_batch

    def held_batch(version, hook=None):
        gate.wait(gate_s)
        return real_batch(version, hook)

    worker.roller.rollout_batch = held_batch
    return coord, worker, gate


@pytest.mark.timeout(120)
def test_worker_beats_while_a_batch_outlasts_the_ttl(repo, tmp_path, redis_url, run_id, monkeypatch):
    from streamrl.workers import rollout  # noqa: PLC0415 (installed layout of workers/)

    monkeypatch.setattr(rollout, "HEARTBEAT_S", TTL_S / 5)
    coord, worker, gate = gated_worker(repo, tmp_path, redis_url, run_id, gate_s=30,
                                       overrides=(f"deadlines.heartbeat_s={TTL_S}",))
    cfg = worker.cfg
    runner = threading.Thread(target=worker.run, daemon=True)
    runner.start()
    plane = ControlPlane(coord, cfg.to_dict(), "tcp://127.0.0.1:9", Ledger(), admission=None)
    deadline = time.monotonic() + 30
    while plane.generating() != [0]:
        assert time.monotonic() < deadline, coord.workers()
        time.sleep(0.05)
    seen, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < 3 * TTL_S:  # three TTLs inside one batch
        assert plane.generating() == [0], coord.workers()
        seen += 1
        time.sleep(0.05)
    worker.stopping = True
    gate.set()
    runner.join(30)
    assert not runner.is_alive() and seen > 10
