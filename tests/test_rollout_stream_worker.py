"""The rollout worker in streaming mode with a real Redis, a real weights publisher and real
ZeroMQ sockets: stopping drains the stream and leaves no reservation behind; refused admission
with nothing in flight runs into ``deadlines.admission_s``."""
from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import pytest

from streamrl.bench.rollout import _Drain
from streamrl.config import load_config
from streamrl.coord.coordinator import Coordinator
from streamrl.coord.liveness import DeadlineExceeded
from streamrl.models.factory import build_model
from streamrl.trajectory import validate_trajectories
from streamrl.transport.sender import TrajectorySender

GROUP, PER_MESSAGE, PER_STEP, STALENESS = 2, 2, 2, 4


@contextmanager
def _streaming_worker(redis_url, run_id, repo, monkeypatch, *extra):
    """A streaming worker with version 0 loaded and a sender to a draining receiver: yields
    ``(worker, coord, sender)``; closes the sender, receiver, engine, metrics and publisher on the way out."""
    from streamrl.weights.factory import make_publisher
    from streamrl.workers.rollout import RolloutWorker

    monkeypatch.chdir(repo)
    cfg = load_config("configs/tiny.yaml", [
        "rollout.engine=hf_fast", "rollout.streaming=true", f"rollout.group_size={GROUP}",
        f"rollout.prompts_per_batch={PER_MESSAGE}", "rollout.max_new_tokens=6",
        f"learner.groups_per_step={PER_STEP}", f"learner.max_staleness={STALENESS}", *extra])
    coord = Coordinator(redis_url, run_id)
    coord.put_config(cfg.to_dict())
    model, _ = build_model(cfg.model, seed=cfg.run.seed)
    publisher = make_publisher(coord, run_id, cfg)
    worker = RolloutWorker(argparse.Namespace(redis_url=redis_url, run_id=run_id, worker_id=0, num_workers=1,
                                              device=None))
    publisher.publish(0, [(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()],
                      (p.detach() for _, p in model.named_parameters()))
    worker.sync_weights()
    assert worker.subscriber.loaded_version == 0
    drain = _Drain()
    sender = TrajectorySender(drain.endpoint, 0, hwm=64)
    try:
        yield worker, coord, sender
    finally:
        sender.close()
        drain.close()
        worker.engine.close()
        worker.metrics.close()
        publisher.close()


def _held(coord) -> int:
    reserved, refunded = coord.r.mget([coord.keys.reserved, coord.keys.refunded])
    return int(reserved or 0) - int(refunded or 0)


def _totals() -> dict:
    return {"tokens": 0, "trajectories": 0, "wait_s": 0.0, "t_start": time.perf_counter()}


@pytest.mark.timeout(120)
def test_stop_drains_the_stream_and_holds_only_what_was_sent(redis_url, run_id, repo, monkeypatch):
    with _streaming_worker(redis_url, run_id, repo, monkeypatch) as (worker, coord, sender):
        sent, send = [], worker._send

        def counted(snd, td):  # the signal arrives after the third message
            sent.append(td)
            if len(sent) == 3:
                worker.stopping = True
            return send(snd, td)

        worker._send = counted
        worker._stream(sender, _totals())
    assert len(sent) >= 3 and worker.roller.in_flight == 0
    groups = 0
    for td in sent:
        validate_trajectories(td)
        gid = td["group_id"].tolist()
        assert all(gid.count(g) == GROUP for g in set(gid))  # whole groups only
        groups += len(set(gid))
    assert groups <= (STALENESS + 1) * PER_STEP  # admission control bounded what was reserved
    assert _held(coord) == groups  # everything reserved was delivered; nothing left held
    assert worker.progress["batches"] == len(sent) and worker.progress["trajectories"] == groups * GROUP
    assert "rollout/slot_occupancy" in worker.roller.last_metrics


@pytest.mark.timeout(120)
def test_refused_with_nothing_in_flight_runs_into_the_admission_deadline(redis_url, run_id, repo, monkeypatch):
    budget = (STALENESS + 1) * PER_STEP
    deadline = "deadlines.admission_s=0.3"
    with _streaming_worker(redis_url, run_id, repo, monkeypatch, deadline) as (worker, coord, sender):
        assert coord.try_reserve(budget, STALENESS, PER_STEP)  # another worker holds the whole budget
        with pytest.raises(DeadlineExceeded, match="admission_s"):
            worker._stream(sender, _totals())
    assert _held(coord) == budget  # the worker neither took nor gave back any
    assert worker.state == "waiting_admission"
