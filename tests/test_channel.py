"""Trajectory channel over real ZeroMQ sockets: ragged layouts, seq gaps, restarts, acks and
resends across a learner restart, endpoint discovery through a real Redis, and the credit and
retention bookkeeping on their own."""
from __future__ import annotations

import time

import pytest
import torch
import zmq
from tensordict import TensorDict

from streamrl.coord.coordinator import Coordinator
from streamrl.trajectory import make_id, pack_trajectories
from streamrl.transport.receiver import TrajectoryReceiver
from streamrl.transport.sender import TrajectorySender
from streamrl.transport.credits import CreditLedger, CreditWindow, pack_grant, unpack_grant

_counter = iter(range(10**9))


def batch(worker=3, lens=((2, 3), (1, 1)), routed=None, started=True, version=0):
    ids = [make_id(worker, next(_counter)) for _ in lens]
    return pack_trajectories(
        [[5] * p for p, _ in lens], [list(range(r)) for _, r in lens],
        [[-0.25] * r for _, r in lens], [[version] * r for _, r in lens],
        [1.0] * len(lens), [ids[0]] * len(lens), ids, worker, time.time(),
        started_at=time.time() - 1 if started else None,
        routed_experts=[torch.randint(0, 64, (r, *routed)) for _, r in lens] if routed else None,
    )


def receive(rx: TrajectoryReceiver, n: int, timeout_s: float = 20.0) -> list[TensorDict]:
    got: list[TensorDict] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += rx.poll(0.2)
    return got


@pytest.fixture
def pair():
    rx = TrajectoryReceiver("tcp://127.0.0.1:*", hwm=8)
    tx = TrajectorySender(rx.endpoint, worker_id=3, hwm=8)
    yield rx, tx
    tx.close()
    rx.close()


LAYOUTS = [
    dict(lens=((1, 1),)),  # smallest possible
    dict(lens=((7, 1), (1, 300), (40, 2))),  # very ragged
    dict(lens=((3, 5),) * 64, started=False),  # many, no optional fields
    dict(lens=((4, 9), (2, 1)), routed=(4, 2)),  # routing replay [R, L, k]
    dict(lens=((1, 2000),), routed=(48, 8)),  # one long MoE trajectory (~1.5 MB of expert ids)
]


def test_every_ragged_layout_roundtrips_intact(pair):
    rx, tx = pair
    sent = [batch(**kw) for kw in LAYOUTS]
    for td in sent:
        assert tx.send(td, timeout_s=10)
    got = receive(rx, len(sent))
    assert len(got) == len(sent)
    for a, b in zip(sent, got):
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    stats = rx.stats()
    assert stats["transport/rejected"] == 0 and stats["transport/seq_gaps"] == 0
    assert stats["transport/trajectories"] == sum(len(kw["lens"]) for kw in LAYOUTS)
    assert tx.flush(10) and tx.stats()["transport/in_flight_bytes"] == 0


def test_gaps_and_restarts_counted(pair):
    rx, tx = pair
    a = batch()
    assert tx.send(a, timeout_s=5)
    tx.seq += 3  # three messages "lost" between here and the learner
    b = batch()
    assert tx.send(b, timeout_s=5)
    got = receive(rx, 2)
    assert [int(t["traj_id"][0]) for t in got] == [int(a["traj_id"][0]), int(b["traj_id"][0])]
    assert rx.seq_gaps == 3
    # a new sender for the same worker id (a restarted worker) is a new session, not a gap
    tx2 = TrajectorySender(rx.endpoint, worker_id=3)
    try:
        assert tx2.send(batch(), timeout_s=5)
        assert len(receive(rx, 1)) == 1
        assert rx.restarts == 1 and rx.seq_gaps == 3
    finally:
        tx2.close()


def wait_until(pred, timeout_s: float = 10.0, poll=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if poll is not None:
            poll()
        if pred():
            return True
        time.sleep(0.01)
    raise AssertionError("condition not reached in time")


def test_sender_retains_until_acked_and_resends_what_a_dead_learner_lost():
    rx = TrajectoryReceiver("tcp://127.0.0.1:*")
    port = rx.endpoint.rsplit(":", 1)[1]
    tx = TrajectorySender(rx.endpoint, worker_id=3, resync_s=0.2)
    try:
        first, lost = batch(), [batch(), batch()]
        assert tx.send(first, timeout_s=5)
        assert len(receive(rx, 1)) == 1
        rx.commit()  # durable: the worker may forget it
        wait_until(lambda: tx.retention.pending() == 0, poll=tx.service)
        assert tx.stats()["transport/acked_messages"] == 1 and tx.produced == 2
        # two more messages reach the learner's socket, and the learner dies before reading them
        for td in lost:
            assert tx.send(td, timeout_s=5)
        time.sleep(0.3)  # on localhost they are in the learner's socket within microseconds
        rx.sock.close(linger=0)  # ... which dies with them unread (the chaos suite's in_flight loss)
        assert tx.retention.pending() == 2  # nothing acknowledged them
        # a new learner incarnation on the same port learns nothing by itself; the worker's
        # HELLO (it holds unacknowledged messages) tells it where the sender's seq is
        rx = None
        while rx is None:  # the dead socket's port is released asynchronously
            try:
                rx = TrajectoryReceiver(f"tcp://127.0.0.1:{port}")
            except zmq.ZMQError:
                time.sleep(0.05)
        got: list[TensorDict] = []

        def pump():
            tx.service()
            got.extend(rx.poll(0.05))

        wait_until(lambda: len(got) == 2, poll=pump)
        assert [t["traj_id"].tolist() for t in got] == [t["traj_id"].tolist() for t in lost]
        assert tx.retention.resent == 2 and tx.produced == 6
        assert rx.produced[(3, tx.session)] == 6  # the count the ledger balances against
        wait_until(lambda: tx.retention.pending() == 0, poll=pump)  # the next poll acknowledged them
    finally:
        tx.close()
        rx.close()


def test_retention_bound_blocks_instead_of_dropping():
    rx = TrajectoryReceiver("tcp://127.0.0.1:*")
    tx = TrajectorySender(rx.endpoint, worker_id=3, retain_bytes=1)  # room for one message, alone
    try:
        assert tx.send(batch(lens=((2, 50),)), timeout_s=5)
        assert tx.send(batch(lens=((2, 50),)), timeout_s=0.3) is False  # unacknowledged: backpressure
        assert len(receive(rx, 1)) == 1
        rx.commit()
        assert tx.send(batch(lens=((2, 50),)), timeout_s=5)  # the ack made room
        assert tx.retention.acked == 1 and tx.retention.pending() == 1
    finally:
        tx.close()
        rx.close()


def test_retention_and_ack_bookkeeping():
    from streamrl.transport.retention import Retained, Retention, pack_ack, unpack_ack

    assert unpack_ack(pack_ack(7, [3, 5])) == (7, [3, 5]) and unpack_ack(pack_grant(1, 2)) is None
    assert len(pack_ack(0, [])) != 16  # never mistaken for a grant
    r = Retention(max_bytes=100)
    for seq in range(4):
        r.keep(seq, Retained(None, 30, seq + 1))
    assert r.bytes == 120 and not r.has_room(1)
    assert r.on_ack(horizon=3, seqs=[0, 2]) == 1  # seq 1 was read by nobody: lost, resend it
    assert r.pending() == 2 and r.bytes == 60 and r.lost[0].produced == 2
    item = r.pop_lost()
    r.keep(9, item)  # sent again under a new seq
    assert r.pending() == 2 and r.bytes == 60 and list(r._items) == [3, 9]
    with pytest.raises(ValueError, match="retention"):
        Retention(0)


@pytest.mark.parametrize("mutate,reason", [
    (lambda td: td["worker_id"].fill_(99), "worker_mismatch"),
    (lambda td: td["policy_version"].fill_(7), "future_version"),
])
def test_invalid_batches_are_counted_not_raised(pair, mutate, reason):
    rx, tx = pair
    rx.max_version = 5
    bad = batch()
    mutate(bad)
    assert tx.send(bad, timeout_s=5)
    good = batch()
    assert tx.send(good, timeout_s=5)
    got = receive(rx, 1)
    assert len(got) == 1 and torch.equal(got[0]["traj_id"], good["traj_id"])
    assert rx.rejected[reason] == 1 and rx.stats()[f"transport/rejected_{reason}"] == 1


def test_endpoint_discovered_through_redis(redis_url, run_id):
    learner_coord = Coordinator(redis_url, run_id)
    worker_coord = Coordinator(redis_url, run_id)
    rx = TrajectoryReceiver("tcp://127.0.0.1:*")
    learner_coord.set_endpoint("trajectories", rx.endpoint)
    tx = TrajectorySender(worker_coord.wait_endpoint("trajectories", timeout_s=10), worker_id=4)
    try:
        td = batch(worker=4)
        assert tx.send(td, timeout_s=5)
        got = receive(rx, 1)
        assert len(got) == 1 and torch.equal(got[0]["traj_id"], td["traj_id"])
    finally:
        tx.close()
        rx.close()


def test_send_times_out_without_a_learner():
    # nothing listens there: the initial credit lets one batch queue, then send() times out
    tx = TrajectorySender("tcp://127.0.0.1:1", worker_id=1, resync_s=0.1, initial_credit_bytes=1000)
    try:
        assert tx.send(batch(worker=1), timeout_s=0.3) is True
        t0 = time.monotonic()
        assert tx.send(batch(worker=1), timeout_s=0.3) is False
        assert time.monotonic() - t0 < 2.0 and tx.seq == 1 and tx.stats()["transport/hellos"] >= 2
    finally:
        tx.close()


def test_credit_window_and_ledger_bookkeeping():
    assert not CreditWindow(None).may_send(1)  # no initial window: wait for the first grant
    assert CreditWindow(10).may_send(10) and CreditWindow(10).may_send(11)  # nothing in flight
    w = CreditWindow()
    w.grant(0, 100)
    assert w.may_send(100) and w.may_send(101)  # nothing in flight: any size may go
    w.sent_message(60)
    assert w.may_send(40) and not w.may_send(41)
    w.grant(60, 100)
    assert w.in_flight() == 0 and w.may_send(10_000)  # one oversized message may go alone
    w.grant(10**9, 100)
    assert w.consumed == w.sent  # a learner cannot credit more than was sent
    assert unpack_grant(pack_grant(5, 7)) == (5, 7) and unpack_grant(b"short") is None

    led = CreditLedger(window=100, max_peers=2)
    led.consume(b"a", 10)
    assert [p for p, _ in led.pending_grants()] == [b"a"]  # first contact is answered at once
    led.consume(b"a", 10)
    assert led.pending_grants() == []  # < window/4 since the last grant: batched
    assert unpack_grant(dict(led.pending_grants(everything=True))[b"a"]) == (20, 100)
    led.resync(b"b", 500)
    led.consume(b"c", 1)  # LRU: the oldest peer is forgotten, memory stays bounded
    assert set(p for p, _ in led.pending_grants(everything=True)) == {b"b", b"c"}
    with pytest.raises(ValueError, match="window"):
        CreditLedger(window=0)
