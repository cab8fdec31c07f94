"""Coordinator control plane over a real Redis: versions, GC, notifications, acks, heartbeats."""
from __future__ import annotations

import json
import threading
import time

import pytest

from streamrl.coord.coordinator import TABLE_CACHE, Coordinator
from streamrl.weights.manifest import TABLE_REF, Table


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


class _Waiting:
    """A pub/sub handle that tells the test when ``wait_version`` is blocked on it."""

    def __init__(self, pubsub):
        self.pubsub, self.blocked, self.messages = pubsub, threading.Event(), 0
        pubsub.get_message(timeout=1.0)  # consume the (ignored) subscribe confirmation: no early wake-up

    def get_message(self, timeout):
        self.blocked.set()
        msg = self.pubsub.get_message(timeout=timeout)
        self.messages += msg is not None
        return msg


def _wait_in_thread(c, after, **kw):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", c.wait_version(after, **kw)), daemon=True)
    t0 = time.monotonic()
    t.start()
    return t, out, t0


@pytest.mark.timeout(30)
def test_wait_version_wakes_on_pubsub(redis_url, run_id):
    c = Coordinator(redis_url, run_id)
    ps = _Waiting(c.subscribe_versions())
    # polling alone would take 10 s: only the notification can wake it sooner
    t, out, t0 = _wait_in_thread(c, -1, timeout_s=20, pubsub=ps, poll_s=10.0)
    assert ps.blocked.wait(5)  # the waiter read "no version" and blocks on pub/sub now
    c.publish_version(0, {}, keep=3)
    t.join(8)
    assert out.get("v") == 0 and time.monotonic() - t0 < 8 and ps.messages == 1
    assert c.wait_version(0, timeout_s=0.3, poll_s=0.1) is None


@pytest.mark.timeout(30)
def test_wait_version_wakes_by_polling_without_a_notification(redis_url, run_id):
    c = Coordinator(redis_url, run_id)
    ps = _Waiting(c.subscribe_versions())
    t, out, _ = _wait_in_thread(c, -1, timeout_s=20, pubsub=ps, poll_s=0.1)
    assert ps.blocked.wait(5)
    c.r.set(c.keys.version, 1)  # a version that is never announced on pub/sub
    t.join(10)
    assert out.get("v") == 1 and ps.messages == 0  # found by re-reading the key after a poll timeout


@pytest.mark.timeout(30)
def test_acks_heartbeats_ttl_and_timings(redis_url, run_id):
    c = Coordinator(redis_url, run_id)
    c.heartbeat(1, {"state": "running"}, ttl_s=0.3)
    c.heartbeat(2, {"state": "running"}, ttl_s=30)
    assert [w for w, hb in c.workers().items() if hb is not None] == [1, 2]
    time.sleep(0.5)
    assert [w for w, hb in c.workers().items() if hb is not None] == [2] and c.workers()[1] is None
    c.ack(1, 3)
    c.ack(2, 2)
    assert not c.wait_acks(3, [1, 2], timeout_s=0.1)
    c.ack(2, 4)
    assert c.wait_acks(3, [1, 2], timeout_s=1.0)
    c.put_weight_timings(2, {"weights/load_s": 0.5})
    assert c.weight_timings(2) == {"weights/load_s": 0.5}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch, per_step, staleness", [
    (8, 8, 0), (4, 8, 0), (3, 8, 0), (32, 8, 0), (32, 8, 4), (12, 8, 1), (64, 8, 4), (16, 8, 1), (5, 4, 1)])
def test_config_admission_check_matches_the_reservation_script(redis_url, run_id, batch, per_step, staleness):
    """The config's deadlock check (``_admission_deadlock``) predicts exactly what the Redis
    reservation script does: two workers reserve whole batches as long as it admits them, the
    learner trains ``per_step`` groups and advances the version whenever enough are reserved."""
    from streamrl.config import _admission_deadlock

    c = Coordinator(redis_url, run_id)
    c.r.set(c.keys.version, 0)
    reserved, stalled_at = 0, None
    for version in range(2 * batch + 2):
        c.r.set(c.keys.version, version)
        while c.try_reserve(batch, staleness, per_step):  # both workers alike: one counter
            reserved += batch
        if reserved < (version + 1) * per_step:
            stalled_at = version
            break
    assert stalled_at == _admission_deadlock(batch, per_step, staleness)


@pytest.mark.parametrize("batch, per_step, staleness, workers", [
    (32, 8, 4, 1), (32, 8, 6, 1), (32, 8, 7, 1), (32, 8, 8, 1), (8, 8, 2, 4), (8, 8, 4, 4), (4, 16, 4, 4),
    (2, 4, 1, 1), (12, 8, 2, 2), (12, 8, 3, 2)])
def test_config_admission_wait_note_matches_the_reservation_script(redis_url, run_id, batch, per_step, staleness,
                                                                   workers):
    """``admission_wait_note`` warns exactly when the Redis reservation script makes a worker wait
    in a balanced pipeline: workers finish their batches in turn, and when one finishes, the
    learner has trained every full step of what was delivered before that batch."""
    from streamrl.config import admission_wait_note

    c = Coordinator(redis_url, run_id)
    c.r.set(c.keys.version, 0)
    # start-up: every worker asks for a batch (one that is refused already waits)
    waited = not all([c.try_reserve(batch, staleness, per_step) for _ in range(workers)])
    delivered = 0
    for _ in range(8 * workers):  # the worker whose batch is done asks for its next one at once
        c.r.set(c.keys.version, delivered // per_step)  # steps trained from earlier batches
        delivered += batch
        if not c.try_reserve(batch, staleness, per_step):
            waited = True
            break
    assert waited == (admission_wait_note(batch, per_step, staleness, workers) is not None)


def test_wait_config_waits_for_a_config_stored_late_and_names_the_run_when_none_comes(redis_url, run_id):
    """A process that starts while Redis restarts empty waits for the launcher to re-store the config."""
    c = Coordinator(redis_url, run_id)
    stored = threading.Event()

    def store_later():
        c.r.set(c.keys.config, '{"run": {"name": "late"}}')
        stored.set()

    timer = threading.Timer(0.3, store_later)
    timer.start()
    try:
        assert c.wait_config(timeout_s=30) == {"run": {"name": "late"}}
        assert stored.is_set()
    finally:
        timer.cancel()
    with pytest.raises(TimeoutError, match=f"no config in Redis for run {run_id}-other"):
        Coordinator(redis_url, f"{run_id}-other").wait_config(timeout_s=0.2)


@pytest.mark.timeout(30)
def test_manifests_name_tables_that_readers_cache_boundedly(redis_url, run_id):
    """publish_version stores a named table when Redis lacks it; a reader resolves each digest
    once and keeps at most TABLE_CACHE tables."""
    c, reader = Coordinator(redis_url, run_id), Coordinator(redis_url, run_id)
    for v in range(TABLE_CACHE + 2):
        table = Table.of(json.dumps([{"name": f"t{v}", "shape": [v]}]))
        c.publish_version(v, {}, keep=TABLE_CACHE + 4, encoded=json.dumps({TABLE_REF: table.digest, "v": v}), table=table)
        assert reader.manifest(v) == {"v": v, "tensors": [{"name": f"t{v}", "shape": [v]}]}
    assert len(reader._tables) == TABLE_CACHE
    assert reader.manifest(0)["tensors"] == [{"name": "t0", "shape": [0]}]  # evicted: read again


@pytest.mark.timeout(30)
def test_tensor_tables_live_as_long_as_a_retained_version_names_them(redis_url, run_id):
    """A layout's table is deleted once no retained version names it (expired by the publish script,
    or by gc_versions after a jump), stored again when a layout comes back, and re-asserted with the
    last manifest after Redis lost the run's state."""
    c = Coordinator(redis_url, run_id)
    a, b = Table.of('[{"name": "a"}]'), Table.of('[{"name": "b"}]')

    def publish(v: int, table: Table) -> None:
        c.publish_version(v, {}, keep=2, encoded=json.dumps({TABLE_REF: table.digest, "v": v}), table=table)

    def stored() -> set[str]:
        return {key.rsplit(":", 1)[1] for key in c.r.keys(c.keys.weights_table("*"))}

    publish(0, a)
    publish(1, a)
    publish(2, b)  # retained 1 and 2: both tables named
    assert stored() == {a.digest, b.digest}
    publish(3, b)  # retained 2 and 3: a is named by none
    assert stored() == {b.digest} and c.r.zrange(c.keys.weights_tables, 0, -1) == [b.digest]
    publish(4, a)  # layout a again: the publish stores its table anew
    assert stored() == {a.digest, b.digest}
    publish(10, a)  # a jump: gc_versions expires 3, the last version that named b
    assert stored() == {a.digest}
    reader = Coordinator(redis_url, run_id)
    assert reader.manifest(4)["tensors"] == reader.manifest(10)["tensors"] == [{"name": "a"}]
    c.r.delete(*c.r.keys(f"streamrl:{run_id}:*"))  # Redis lost the run's state
    assert c.reassert_version() and stored() == {a.digest}
    assert c.r.zscore(c.keys.weights_tables, a.digest) == 10
    publish(11, b)
    publish(12, b)  # 10 expires: a goes with it
    assert stored() == {b.digest}


@pytest.mark.timeout(30)
def test_table_gc_skipped_in_a_steady_layout_still_drops_what_no_version_names(redis_url, run_id):
    """The publish script skips its table GC when the expiring version named the new version's
    table (known for the coordinator's own versions); a layout change, or versions another
    coordinator published (a restarted learner), still drop the tables no retained version names."""
    a, b = Table.of('[{"name": "a"}]'), Table.of('[{"name": "b"}]')

    def publish(c: Coordinator, v: int, table: Table) -> None:
        c.publish_version(v, {}, keep=2, encoded=json.dumps({TABLE_REF: table.digest, "v": v}), table=table)

    def stored(c: Coordinator) -> set[str]:
        return {key.rsplit(":", 1)[1] for key in c.r.keys(c.keys.weights_table("*"))}

    c = Coordinator(redis_url, run_id)
    for v in range(5):  # from v2 on the expiring version named a: no table GC
        publish(c, v, a)
    assert stored(c) == {a.digest} and c.r.zscore(c.keys.weights_tables, a.digest) == 4
    publish(c, 5, b)
    publish(c, 6, b)  # 4, the last version naming a, expires
    assert stored(c) == {b.digest}
    restarted = Coordinator(redis_url, run_id)  # knows none of the retained versions
    publish(restarted, 7, a)
    publish(restarted, 8, a)  # 6, the last version naming b, expires
    assert stored(c) == {a.digest} and c.r.zrange(c.keys.weights_tables, 0, -1) == [a.digest]
