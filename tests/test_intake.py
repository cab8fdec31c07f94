"""The learner's intake without trajectory sockets: the in-process feed, a real Redis control plane,
a real journal on disk. Dedup, staleness drops with refunds, journal replay after a crash, version
rebase, the learner gate, acknowledgements, and a Checkpointer round trip."""
from __future__ import annotations

import time

import pytest
import torch

from streamrl.config import load_config
from streamrl.coord.coordinator import Coordinator
from streamrl.learner.intake import Intake
from streamrl.trajectory import concat_trajectories, make_id, pack_trajectories, split_trajectories
from tests.local_feed import LocalFeed

GROUP = 4  # trajectories per group
STEP = 2  # groups per step


@pytest.fixture
def cfg(repo, tmp_path):
    return load_config(str(repo / "configs/tiny.yaml"), [
        f"run.run_dir={tmp_path / 'run'}", f"rollout.group_size={GROUP}", f"learner.groups_per_step={STEP}",
        "learner.max_staleness=1", "rollout.prompts_per_batch=2"])


@pytest.fixture
def coord(redis_url, run_id):
    c = Coordinator(redis_url, run_id)
    for w in (0, 1):
        c.heartbeat(w, {"pid": 0})  # registered workers pass the learner gate
    return c


class Worker:
    """Makes batches with the rollout worker's id layout: a group id, then its trajectory ids."""

    def __init__(self, wid: int, incarnation: int = 1):
        self.wid, self.inc, self.counter = wid, incarnation, 0

    def batch(self, groups: int = 1, version: int = 0):
        gids, tids = [], []
        for _ in range(groups):
            self.counter += 1
            gid = make_id(self.wid, self.counter, self.inc)
            for _ in range(GROUP):
                self.counter += 1
                gids.append(gid)
                tids.append(make_id(self.wid, self.counter, self.inc))
        n = len(tids)
        return pack_trajectories([[1, 2]] * n, [[3, 4]] * n, [[-0.1, -0.2]] * n, [[version] * 2] * n,
                                 [1.0] * n, gids, tids, self.wid, 0.0)


def make_intake(cfg, coord, tmp_path, feed=None) -> tuple[Intake, LocalFeed]:
    feed = feed or LocalFeed()
    intake = Intake(cfg, coord, feed, tmp_path / "ck", "local://", starve_timeout_s=3)
    return intake, feed


def test_duplicates_are_dropped_by_id_and_every_message_is_acknowledged(cfg, coord, tmp_path):
    intake, feed = make_intake(cfg, coord, tmp_path)
    intake.open(0, replay=False)
    w = Worker(0)
    a, b = w.batch(), w.batch()
    feed.send(a)
    feed.send(a)  # a resend of the same trajectories
    mixed = concat_trajectories([split_trajectories(a)[0], *split_trajectories(b)])  # one seen id, four new
    feed.send(mixed)
    intake.receive(0)
    assert intake.ledger.accepted == 2 * GROUP and intake.seen.duplicates == GROUP + 1
    assert feed.acked == [(0, 0, 0), (0, 0, 1), (0, 0, 2)]  # duplicates are acknowledged too: nothing resent
    batch = intake.next_batch(version=0)
    assert sorted(batch["traj_id"].tolist()) == sorted(a["traj_id"].tolist() + b["traj_id"].tolist())
    acc = intake.accounting()
    assert acc["produced"] == 2 * GROUP and acc["trained"] == 2 * GROUP and acc["duplicates_dropped"] == GROUP + 1
    assert acc["balanced"] and acc["lost"] == {} and acc["duplicated"] == 0


def test_stale_groups_are_dropped_counted_and_refunded(cfg, coord, tmp_path):
    intake, feed = make_intake(cfg, coord, tmp_path)
    intake.open(0, replay=False)
    intake.start(version=5)
    w = Worker(0)
    feed.send(w.batch(groups=1, version=2))  # 3 versions behind v5 with max_staleness 1: stale
    feed.send(w.batch(groups=STEP, version=4))
    intake.receive(0)
    refunded_before = int(coord.r.get(coord.keys.refunded) or 0)
    batch = intake.next_batch(version=5)
    assert batch["policy_version"].min() == 4 and int(batch["traj_id"].numel()) == STEP * GROUP
    assert intake.buffer.dropped_stale == GROUP and intake.admission.refunded["stale"] == 1
    assert int(coord.r.get(coord.keys.refunded)) == refunded_before + 1  # the reservation went back
    acc = intake.accounting()
    assert acc["balanced"] and acc["lost"] == {"stale": GROUP} and acc["produced"] == 3 * GROUP


def test_unregistered_workers_are_rejected_and_counted(cfg, coord, tmp_path):
    intake, feed = make_intake(cfg, coord, tmp_path)
    intake.open(0, replay=False)
    feed.send(Worker(9).batch())
    intake.receive(0)
    assert intake.ledger.accepted == 0 and intake.accounting()["rejected_messages"] == {"unknown_worker": 1}
    assert feed.acked == [(9, 0, 0)]


def test_journal_replay_after_a_crash_loses_and_repeats_nothing(cfg, coord, tmp_path):
    # incarnation 1: admits two batches, checkpoints, admits two more, trains one step, dies
    one, feed = make_intake(cfg, coord, tmp_path)
    one.open(0, replay=False)
    w = Worker(0)
    before = [w.batch(version=4), w.batch(version=4)]
    after = [w.batch(version=4), w.batch(version=4)]
    for td in before:
        feed.send(td)
    one.receive(0)
    saved = one.state_dict()
    one.on_checkpoint(step=4)
    for td in after:
        feed.send(td)
    one.receive(0)
    trained_by_the_dead = one.next_batch(version=4)["traj_id"].tolist()
    # incarnation 2: the checkpoint, then the journal; the worker resends the batch it had not
    # seen acknowledged (same trajectory ids)
    two, _ = make_intake(cfg, coord, tmp_path, feed)  # same feed: the worker's sender outlives the learner
    two.load_state_dict(saved)
    two.open(4, replay=True)
    assert two.ledger.replayed == 2 * GROUP and two.buffer.pending_trajectories() == 4 * GROUP
    feed.send(after[1])
    two.receive(0)
    assert two.seen.duplicates == GROUP
    trained = two.next_batch(version=4)["traj_id"].tolist() + two.next_batch(version=5)["traj_id"].tolist()
    every = [t for td in before + after for t in td["traj_id"].tolist()]
    assert sorted(trained) == sorted(every)  # each exactly once in the surviving lineage
    assert set(trained_by_the_dead) <= set(trained)  # its step was rolled back with the model
    assert two.ledger.duplicated == 0 and two.accounting()["balanced"]


def test_rebase_counts_the_lost_branch_as_fresh_and_older_data_by_its_true_lag(cfg, coord, tmp_path):
    intake, feed = make_intake(cfg, coord, tmp_path)
    intake.open(0, replay=False)
    # resumed from a v10 checkpoint; the lost incarnation had published up to v15; continue at v16
    intake.rebase(newest_old=15, ancestor=10, new_version=16)
    w = Worker(1)
    feed.send(w.batch(groups=1, version=8))  # 2 behind the v10 model: stale at max_staleness 1
    feed.send(w.batch(groups=STEP, version=14))  # sampled from the lost branch: fresh
    intake.receive(0)
    batch = intake.next_batch(version=16)
    assert batch["policy_version"].min() == 14 and intake.buffer.dropped_stale == GROUP


def test_checkpointer_round_trips_the_intake_and_progress(cfg, coord, tmp_path):
    from streamrl.learner.checkpoint_manager import Checkpointer, RunProgress
    from streamrl.learner.trainer import Trainer

    trainer = Trainer(cfg)
    coord.heartbeat(0, {"pid": 0})  # again: building the trainer may take longer than a heartbeat TTL
    intake, feed = make_intake(cfg, coord, tmp_path)
    intake.open(0, replay=False)
    w = Worker(0)
    feed.send(w.batch(groups=3))
    intake.receive(0)
    intake.next_batch(version=0)
    run = RunProgress(step=1, version=1, samples=8, rewards=[0.5])
    ck = Checkpointer(cfg, trainer, {"run": run, "intake": intake})
    path = ck.save(1)
    assert path.name == "step_00000001"
    intake2, _ = make_intake(cfg, coord, tmp_path)
    run2 = RunProgress()
    Checkpointer(cfg, trainer, {"run": run2, "intake": intake2}).restore(ck.find("latest"))
    assert run2 == run
    assert intake2.buffer.pending_trajectories() == GROUP and intake2.ledger.trained == STEP * GROUP
    assert intake2.ledger.trained_ids == intake.ledger.trained_ids and torch.equal(
        intake2.seen.state_dict()["ids"], intake.seen.state_dict()["ids"])
    assert intake2.accounting() == intake.accounting()


@pytest.mark.parametrize("state, reserved, refunded", [("generating", 2, 2), ("backpressure", 2, 2),
                                                       ("waiting_admission", 2, 0), ("generating", 0, 0)])
def test_a_departed_worker_refunds_the_batch_it_held_and_never_more(cfg, coord, tmp_path, state, reserved, refunded):
    """A worker whose heartbeat expires while it holds a batch (decoding it, or blocked sending it)
    gets that batch refunded at once; one that was waiting for admission held nothing, and a refund
    is never larger than what is reserved and unaccounted."""
    intake, _ = make_intake(cfg, coord, tmp_path)
    intake.open(0, replay=False)
    intake.start(version=0)
    coord.r.set(coord.keys.version, 0)  # version 0 is out (the learner publishes it before it waits)
    if reserved:
        assert coord.try_reserve(reserved, max_staleness=1, groups_per_step=STEP)
    coord.heartbeat(1, {"pid": 0, "state": "waiting_admission"})  # a live worker that stays
    coord.heartbeat(0, {"pid": 0, "state": state}, ttl_s=0.3)
    accounted = intake.admission.accounted_groups(0, intake.buffer)
    intake.control.tick(0, accounted, force=True)
    assert intake.control.alive() == {0, 1}
    deadline = time.monotonic() + 10
    while coord.workers()[0] is not None:  # its heartbeat runs out
        assert time.monotonic() < deadline
    intake.control.tick(0, accounted, force=True)
    assert intake.control.alive() == {1} and intake.ledger.workers_left == 1
    assert intake.admission.refunded["worker_left"] == refunded
    assert coord.held_groups() == reserved - refunded


@pytest.mark.parametrize("state, reserved, refunded", [("generating", 4, 0), ("waiting_admission", 4, 4),
                                                       ("starting", 0, 0)])
def test_a_starving_learner_refunds_only_leaked_reservations(cfg, coord, tmp_path, monkeypatch, state, reserved,
                                                            refunded):
    """A batch of long responses takes minutes: while a worker generates, its reservation is on the
    way and must not be handed out again. When every worker waits for admission, what is held and
    unaccounted leaked and is given back, once. A worker still starting (compiling, loading a model)
    holds nothing: refunding then would admit batches nobody reserved, for the whole run."""
    import streamrl.learner.intake as intake_mod

    monkeypatch.setattr(intake_mod, "REFUND_AFTER_S", 0.3)
    for w in (0, 1):
        coord.heartbeat(w, {"pid": 0, "state": state})
    intake, _ = make_intake(cfg, coord, tmp_path)  # starves (stops the run) after 3 s
    intake.open(0, replay=False)
    intake.start(version=0)
    coord.r.set(coord.keys.version, 0)  # version 0 is out (the learner publishes it before it waits)
    for _ in range(reserved // 2):  # batches of 2 groups the workers reserved (and, waiting, lost)
        assert coord.try_reserve(2, max_staleness=1, groups_per_step=STEP)
    assert intake.next_batch(version=0) is None and coord.stop_reason() == "starved"
    assert intake.admission.refunded["starving"] == refunded
    assert coord.held_groups() == reserved - refunded
