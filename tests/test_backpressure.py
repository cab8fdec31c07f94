"""A stalled learner slows the workers and memory stays bounded (real sockets, measured RSS)."""
from __future__ import annotations

import threading
import time

import torch

from streamrl.bench.transport import make_batch
from streamrl.trajectory import make_id
from streamrl.transport.receiver import TrajectoryReceiver
from streamrl.transport.sender import TrajectorySender
from streamrl.transport.codec import Limits

MB = 1024 * 1024


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class Worker(threading.Thread):
    """Sends ``n`` distinct batches of ~``size`` bytes with blocking sends; counts progress."""

    def __init__(self, endpoint, n, size, **kw):
        super().__init__(daemon=True)
        self.tx = TrajectorySender(endpoint, worker_id=1, **kw)
        self.base = make_batch(size)
        self.n, self.sent, self.error = n, 0, None
        self.ids = []

    def run(self):
        try:
            b = self.base["traj_id"].numel()
            for i in range(self.n):
                td = self.base.clone(recurse=False)
                td["traj_id"] = torch.arange(b) + make_id(1, i * b)
                self.ids.append(td["traj_id"])
                self.tx.send(td)  # blocks while the learner is backed up
                self.sent += 1
        except BaseException as e:  # surfaced by the test
            self.error = e


def wait_until(pred, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "state not reached in time"
        time.sleep(0.01)


def drain(rx, n, timeout_s=60):
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += rx.poll(0.2)
    return got


def test_stalled_learner_blocks_worker_with_bounded_memory():
    credit = 4 * MB
    rx = TrajectoryReceiver("tcp://127.0.0.1:*", hwm=8, limits=Limits(), credit_bytes=credit)
    n, size = 40, 2 * MB  # 80 MB would queue if nothing pushed back
    w = Worker(rx.endpoint, n, size, hwm=8, initial_credit_bytes=credit)
    rss0 = rss_bytes()
    w.start()
    # the learner is "training": it does not read. Wait for the state that matters: the worker
    # has used its window and cannot send the next batch without a grant
    wait_until(lambda: w.sent >= 1 and not w.tx.credit.may_send(size), 30)
    stalled_sent, stalled_inflight = w.sent, w.tx.credit.in_flight()
    grown = rss_bytes() - rss0
    # at most a window of credit (or one message when nothing is in flight) left the worker
    assert stalled_sent <= credit // size + 1, stalled_sent
    assert stalled_inflight <= credit + size
    assert grown < 40 * MB, f"RSS grew {grown / MB:.0f} MB while the learner stalled"
    assert w.is_alive() and w.sent == stalled_sent  # no grant, no progress: it is blocked, not done
    # the learner resumes: everything arrives, in order, and the worker finishes
    got = drain(rx, n)
    w.join(30)
    assert w.error is None and w.sent == n and not w.is_alive()
    assert len(got) == n
    assert all(torch.equal(g["traj_id"], i) for g, i in zip(got, w.ids))
    assert rx.seq_gaps == 0 and rx.stats()["transport/rejected"] == 0
    assert w.tx.stats()["transport/blocked_s"] > 0  # it really waited for the learner
    w.tx.close()
    rx.close()


def test_hwm_is_the_second_fence_when_credit_is_huge():
    # Credits effectively off: ZeroMQ HWMs (+ kernel socket buffers) still stop the worker.
    rx = TrajectoryReceiver("tcp://127.0.0.1:*", hwm=2, credit_bytes=1 << 40)
    n, size = 60, 1 * MB
    w = Worker(rx.endpoint, n, size, hwm=2, initial_credit_bytes=1 << 40)
    w.start()
    time.sleep(2.0)
    stalled_sent = w.sent
    assert stalled_sent < 30, f"{stalled_sent} of {n} MB queued behind a stalled learner"
    got = drain(rx, n)
    w.join(30)
    assert w.error is None and len(got) == n
    w.tx.close()
    rx.close()
