"""Coordinator control plane over a real Redis: versions, GC, notifications, acks, heartbeats."""
from __future__ import annotations

import time

import pytest

from streamrl.coord.coordinator import Coordinator


@pytest.mark.timeout(30)
def test_versions_manifests_gc_and_streaming_events(redis_url, run_id):
    c = Coordinator(redis_url, run_id)
    assert c.current_version() == -1 and c.pending_version() == -1
    c.begin_version(0, {"state": "writing"})
    assert c.current_version() == -1 and c.pending_version() == 0
    c.bucket_ready(0, 0, "11")
    c.bucket_ready(0, 1, "22")
    events, last = c.bucket_events(0, "0", block_ms=100)
    assert events == [(0, "11"), (1, "22")]
    assert c.bucket_events(0, last, block_ms=50)[0] == []
    for v in range(5):
        c.publish_version(v, {"state": "complete", "v": v}, keep=2)
    assert c.current_version() == 4
    assert c.manifest(4)["v"] == 4 and c.manifest(3) is not None
    assert c.manifest(2) is None and c.manifest(0) is None
    assert c.r.exists(c.keys.weights_buckets(0)) == 0  # bucket streams are collected too


@pytest.mark.timeout(30)
def test_wait_version_wakes_on_pubsub_and_by_polling(redis_url, run_id):
    c = Coordinator(redis_url, run_id)
    ps = c.subscribe_versions()
    time.sleep(0.05)
    c.publish_version(0, {}, keep=3)
    t0 = time.monotonic()
    assert c.wait_version(-1, timeout_s=5, pubsub=ps, poll_s=2.0) == 0
    assert time.monotonic() - t0 < 1.0
    assert c.wait_version(0, timeout_s=0.3, poll_s=0.1) is None
    c.r.set(c.keys.version, 1)  # a version that was never announced on pub/sub
    assert c.wait_version(0, timeout_s=5, pubsub=ps, poll_s=0.1) == 1


@pytest.mark.timeout(30)
def test_acks_heartbeats_ttl_and_timings(redis_url, run_id):
    c = Coordinator(redis_url, run_id)
    c.heartbeat(1, {"state": "running"}, ttl_s=0.3)
    c.heartbeat(2, {"state": "running"}, ttl_s=30)
    assert c.live_workers() == [1, 2]
    time.sleep(0.5)
    assert c.live_workers() == [2] and c.workers()[1] is None
    c.ack(1, 3)
    c.ack(2, 2)
    assert not c.wait_acks(3, [1, 2], timeout_s=0.1)
    c.ack(2, 4)
    assert c.wait_acks(3, [1, 2], timeout_s=1.0)
    c.put_weight_timings(2, {"weights/load_s": 0.5})
    assert c.weight_timings(2) == {"weights/load_s": 0.5}
