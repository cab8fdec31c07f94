"""Fast pieces behind the chaos scenarios (default tier): journal, ledger, version rebase, Redis reconnect."""
from __future__ import annotations

import logging
import threading
import time

import pytest
import redis
import torch

from streamrl.coord.coordinator import Coordinator
from streamrl.launcher.redis_server import RedisServer
from streamrl.learner.accounting import Ledger
from streamrl.learner.buffer import StalenessBuffer
from streamrl.learner.journal import Journal
from streamrl.trajectory import make_id, pack_trajectories, split_id


def batch(worker: int, inc: int, first_counter: int, groups: int = 2, gsize: int = 4, version: int = 0):
    """Ids laid out like the rollout worker's: a group id then ``gsize`` trajectory ids per group."""
    gids, tids, c = [], [], first_counter
    for _ in range(groups):
        gid = make_id(worker, c, inc)
        c += 1
        for _ in range(gsize):
            gids.append(gid)
            tids.append(make_id(worker, c, inc))
            c += 1
    n = len(tids)
    return pack_trajectories([[1, 2]] * n, [[3]] * n, [[-0.1]] * n, [[version]] * n, [1.0] * n, gids, tids,
                             worker, 0.0)


def test_id_layout_round_trips():
    assert split_id(make_id(3, 42, incarnation=7)) == (3, 7, 42)


def test_journal_replays_after_checkpoint_and_rotates(tmp_path):
    j = Journal(tmp_path, 0)
    j.append(batch(0, 1, 1))
    j.rotate(4)  # checkpoint at step 4 covers the first entry
    j.append(batch(0, 1, 11))
    j2 = Journal(tmp_path, 4)  # the restarted incarnation
    got = list(j2.replay(4))
    assert len(got) == 1 and torch.equal(got[0]["traj_id"], batch(0, 1, 11)["traj_id"])
    assert j2.incarnation == 1
    (j.segment / "00000000.safetensors").write_bytes(b"torn")  # a damaged entry is counted, not fatal
    j3 = Journal(tmp_path, 4)
    assert list(j3.replay(4)) == [] and j3.unreadable == 1


def test_ledger_balances_against_produced_and_detects_double_training():
    led = Ledger()
    led.known_workers.add(0)
    b1, b3 = batch(0, 1, 1), batch(0, 1, 21)  # 8 trajectories each
    led.on_accept(b1)
    led.on_accept(b3)
    led.on_train(b1)
    # the sender reports 24 produced: one 8-trajectory message never reached the learner
    led.on_produced({(0, 77): 24, (5, 1): 100})  # worker 5 never registered: not counted
    s = led.summary(pending=8, stale=0, overflow=0)
    assert s["balanced"] and s["trained"] == 8 and s["produced"] == 24 and s["lost"] == {"in_flight": 8}
    led.on_train(b1)
    assert led.duplicated == 8
    restored = Ledger()
    restored.load_state_dict(led.state_dict(), led.trained_ids_tensor().tolist())
    assert restored.summary(8, 0, 0) == led.summary(8, 0, 0)


def test_rebase_keeps_true_lag_for_old_data_and_fresh_for_the_lost_branch():
    buf = StalenessBuffer(group_size=4, max_staleness=2)
    # checkpoint at v10, the lost incarnation published up to v15, the learner continues at v16
    buf.rebase(newest_old=15, ancestor=10, new_version=16)
    old, lost_branch = batch(0, 1, 1, groups=1, version=7), batch(0, 1, 11, groups=1, version=14)
    assert buf.effective_version(old) == 13 and buf.effective_version(lost_branch) == 16
    buf.add(old)
    buf.add(lost_branch)
    assert buf.drop_stale(16) == 1  # v7 is 3 behind the v10 model: stale, counted
    assert buf.dropped_stale == 4 and buf.complete_groups() == 1
    state = buf.export_state()
    again = StalenessBuffer(4, 2)
    again.load_state(*state)
    assert again.rebases == buf.rebases


@pytest.mark.timeout(60)
def test_coordinator_survives_a_redis_restart_with_one_log_line_each_way(tmp_path, run_id, caplog):
    server = RedisServer(tmp_path).start()
    try:
        coord = Coordinator(server.url, run_id, outage_s=20)
        coord.publish_version(3, {"state": "complete", "x": 1})
        server.stop()
        threading.Timer(1.0, server.start).start()
        with caplog.at_level(logging.WARNING, logger="streamrl.coord.coordinator"):
            assert coord.current_version() == -1  # back, but empty (no persistence)
        msgs = [r.getMessage() for r in caplog.records]
        assert sum("unreachable" in m for m in msgs) == 1 and sum("reachable again" in m for m in msgs) == 1
        assert coord.reassert_version() and coord.current_version() == 3 and coord.manifest(3)["x"] == 1
        coord.set_capacity(12)
        assert int(coord.r.get(coord.keys.reserved)) == 12 and int(coord.r.get(coord.keys.refunded)) == 0
        coord.raise_counter("k", 5)
        coord.raise_counter("k", 2)
        assert coord.r.get("k") == "5"
        server.stop()
        short = Coordinator(server.url, run_id, outage_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(redis.ConnectionError):  # bounded: raises, never hangs
            short.current_version()
        assert time.monotonic() - t0 < 10
    finally:
        server.stop()
