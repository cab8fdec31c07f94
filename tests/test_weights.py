"""Weights: layout, checksums, adapter (unit), and the shm / ZeroMQ / gloo planes over real
Redis and real sockets: late joiner, lost notifications, corrupted buckets."""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from streamrl.coord.coordinator import Coordinator
from streamrl.weights.adapter import adapt_specs, adapt_tensor, unadapt
from streamrl.weights.layout import ChecksumError, Layout, checksum_region, checksum_regions
from streamrl.weights.manifest import TABLE_REF, ManifestJSON, Table, decode_table
from streamrl.weights.publisher import WeightPublisher
from streamrl.weights.subscriber import WeightSubscriber

SPECS = [
    ("model.embed_tokens.weight", torch.float32, (50, 32)),
    ("model.layers.0.mlp.experts.gate_up_proj", torch.float32, (4, 16, 32)),
    ("model.layers.0.mlp.experts.down_proj", torch.float32, (4, 32, 8)),
    ("model.layers.0.mlp.gate.weight", torch.float32, (4, 32)),
    ("model.norm.weight", torch.bfloat16, (33,)),
    ("lm_head.weight", torch.float32, (50, 32)),
]


def corrupt_replies(server, n: int) -> None:
    """Flip one byte of each of the next ``n`` buckets ``server`` (a BucketServer) sends, in a
    copy (the store stays intact), so a subscriber sees a checksum mismatch and must re-fetch."""
    lookup, left = server.lookup, [n]

    def corrupting(version: int, index: int):
        data = lookup(version, index)
        if data is None or left[0] == 0:
            return data
        left[0] -= 1
        payload = bytearray(data)
        payload[len(payload) // 2] ^= 0xFF
        return memoryview(payload)

    server.lookup = corrupting  # the server thread looks it up per request


def make_tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _, dtype, shape in SPECS]


def check_equal(got, tensors, target="hf"):
    want = {n: v for (name, _, _), t in zip(SPECS, tensors) for n, v in adapt_tensor(name, t, target)}
    got = dict(got)
    assert set(got) == set(want)
    for n, t in want.items():
        assert torch.equal(got[n], t), n


def flip_byte(path, offset: int, mask: int) -> None:
    """XOR the byte at ``offset`` of the store file ``path`` with ``mask`` (a corrupted bucket)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ mask]))


# -- unit ----------------------------------------------------------------------------------
def test_layout_buckets_aligned_and_bounded():
    lay = Layout.plan(adapt_specs(SPECS, "vllm"), bucket_bytes=4096)
    lay.check()
    assert all(e["offset"] % 64 == 0 for e in lay.tensors)
    assert sum(b["count"] for b in lay.buckets) == len(lay.tensors)
    big = max(e["nbytes"] for e in lay.tensors)
    assert all(b["nbytes"] <= max(4096, big + 64) for b in lay.buckets)
    with pytest.raises(ValueError, match="bucket_bytes"):
        Layout.plan(SPECS, 0)


@pytest.mark.parametrize("algo", ["sum64", "crc32"])
def test_checksum_detects_single_byte_flip(algo):
    buf = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    ref = checksum_region(buf, algo)
    buf[12345] ^= 1
    assert checksum_region(buf, algo) != ref


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("algo", ["sum64", "crc32"])
def test_checksums_of_several_regions_at_once_equal_one_at_a_time(algo, device):
    """The batched path (one read back for all buckets on a GPU) gives the per-region digests,
    wrap-around of the int64 sums included (random bytes make the sums overflow)."""
    regions = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (8, 1 << 16, (1 << 20) + 64)]
    want = [checksum_region(r, algo) for r in regions]
    assert checksum_regions([r.to(device) for r in regions], algo) == want


def test_adapter_vllm_roundtrip_and_names():
    tensors = make_tensors(0)
    named = [(n, v) for (name, _, _), t in zip(SPECS, tensors) for n, v in adapt_tensor(name, t, "vllm")]
    names = [n for n, _ in named]
    assert names == [s[0] for s in adapt_specs(SPECS, "vllm")]
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names
    d = dict(named)
    gu = tensors[1]
    assert torch.equal(d["model.layers.0.mlp.experts.2.gate_proj.weight"], gu[2, :8])
    assert torch.equal(d["model.layers.0.mlp.experts.2.up_proj.weight"], gu[2, 8:])
    assert torch.equal(d["model.layers.0.mlp.experts.1.down_proj.weight"], tensors[2][1])
    back = unadapt(named)
    for (name, _, _), t in zip(SPECS, tensors):
        assert torch.equal(back[name], t)
    with pytest.raises(ValueError, match="naming target"):
        adapt_specs(SPECS, "trt")


# -- real Redis + sockets --------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("plane", ["shm", "zmq"])
def test_publish_fetch_bit_exact_vllm_names(redis_url, run_id, plane):
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="auto", bucket_bytes=8192, target="vllm")
    try:
        tensors = make_tensors(1)
        timings = pub.publish(0, SPECS, iter(tensors))
        assert timings["weights/buckets"] > 1
        sub = WeightSubscriber(coord, plane=plane)
        assert sub.newer_version() == 0
        check_equal(sub.fetch(0), tensors, "vllm")
        assert sub.timings["weights/bytes"] == timings["weights/bytes"]
        sub.close()
    finally:
        pub.close()



@pytest.mark.timeout(60)
def test_background_publish_announces_in_order_and_raises_a_failed_announcement(redis_url, run_id):
    """publish(background=True) returns before the announcement; versions still arrive in order and
    bit-exact, and an announcement that failed raises from the next publish (and from close)."""
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=8192)
    sub = WeightSubscriber(coord, plane="shm")
    try:
        first = pub.publish(0, SPECS, iter(make_tensors(1)), background=True)
        assert "weights/announce_s" not in first  # nothing announced before it
        tensors = make_tensors(2)
        assert pub.publish(1, SPECS, iter(tensors), background=True)["weights/announce_s"] > 0  # v0's
        pub.wait_announced()
        assert coord.manifest(0)["state"] == "complete" and sub.newer_version() == 1
        check_equal(sub.fetch(1), tensors)

        real = coord.publish_version

        def redis_went_away(*args, **kw):
            coord.publish_version = real
            raise ConnectionError("Redis went away")

        coord.publish_version = redis_went_away
        pub.publish(2, SPECS, iter(make_tensors(3)), background=True)  # its announcement fails
        with pytest.raises(ConnectionError, match="went away"):
            pub.publish(3, SPECS, iter(make_tensors(4)), background=True)
        assert coord.manifest(2)["state"] == "writing" and sub.newer_version() == 1  # v2 never became current
        pub.publish(4, SPECS, iter(make_tensors(5)), background=True)  # announces again
        pub.wait_announced()
        assert sub.newer_version() == 4
    finally:
        sub.close()
        pub.close()


def _many_small(seed: int) -> tuple[list, list[torch.Tensor]]:
    """Specs and tensors of a LoRA-like version: many small tensors of mixed dtypes and sizes
    (some not a multiple of 8 bytes), one non-contiguous, one above the packing size."""
    g = torch.Generator().manual_seed(seed)
    specs, tensors = [], []
    for i in range(40):
        dtype = torch.bfloat16 if i % 3 == 0 else torch.float32
        shape = (8, 3 + i) if i % 2 else (5 + i,)
        specs.append((f"m.{i}.lora_A.weight", dtype, shape))
        tensors.append(torch.randn(shape, generator=g).to(dtype))
    tensors[7] = torch.randn((10, 8), generator=g).t()  # non-contiguous [8, 10]
    specs.insert(20, ("m.big.weight", torch.float32, (300, 1024)))  # 1.2 MB: the chunked path
    tensors.insert(20, torch.randn((300, 1024), generator=g))
    return specs, tensors


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algo", ["sum64", "crc32"])
def test_packed_small_tensors_checksummed_like_the_subscriber(redis_url, run_id, algo):
    """Small tensors are memmoved and checksummed per run: every bucket's checksum is the one the
    subscriber computes over the store, across a recycled file (old bytes in the padding), and
    each version of the same specs (one layout plan) gets its own checksums."""
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=1 << 20, keep=1, checksum=algo)
    specs, _ = _many_small(0)
    try:
        sums = []
        for v in range(3):
            _, tensors = _many_small(v)
            pub.publish(v, specs, iter(tensors))
            m = coord.manifest(v)
            assert len(m["buckets"]) == 3
            store = pub.store.files[v].buf
            for b in m["buckets"]:
                assert checksum_region(store[b["offset"]: b["offset"] + b["nbytes"]], algo) == b["checksum"]
            sums.append([b["checksum"] for b in m["buckets"]])
            sub = WeightSubscriber(coord, plane="shm")
            got = dict(sub.fetch(v))
            assert [n for n, _, _ in specs] == list(got)
            for (name, _, _), t in zip(specs, tensors):
                assert torch.equal(got[name], t), name
            del got
            sub.close()
        assert sums[0] != sums[1] != sums[2]
    finally:
        pub.close()


@pytest.mark.timeout(60)
def test_one_bucket_version_is_announced_once_complete(redis_url, run_id):
    """A store version of one bucket skips the 'writing' manifest and the bucket event (nothing
    of it is readable before it is complete); a streaming subscriber still gets it."""
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=64 << 20)
    ps = coord.subscribe_versions()
    try:
        ps.get_message(timeout=1.0)  # the subscribe confirmation
        assert pub.publish(0, SPECS, iter(make_tensors(3)))["weights/buckets"] == 1
        assert coord.r.exists(coord.keys.weights_buckets(0)) == 0
        assert coord.r.get(coord.keys.weights_pending) is None
        msgs = [ps.get_message(timeout=0.5) for _ in range(2)]
        assert [m["data"] for m in msgs if m] == ["0"]  # no "begin:0"
        sub = WeightSubscriber(coord, plane="zmq")
        assert coord.wait_version(-1, timeout_s=5, include_pending=True, poll_s=0.01) == 0
        check_equal(sub.fetch(0), make_tensors(3))
        sub.close()
    finally:
        ps.close()
        pub.close()

def test_manifest_json_names_the_table_by_digest():
    """The table is encoded and hashed once per list; each manifest's JSON names it by digest."""
    enc = ManifestJSON()
    table = [{"name": "p", "shape": [6], "parts": {"names": ["a", "b"], "shapes": [[2], [2, 2]]}}]
    refs = []
    for v in range(3):
        m = {"version": v, "tensors": table, "buckets": [{"checksum": str(v)}], "host": "h\"x"}
        text, ref = enc.encode(m)
        refs.append(ref)
        assert json.loads(text) == {**{k: x for k, x in m.items() if k != "tensors"}, TABLE_REF: ref.digest}
        assert decode_table(ref.digest, ref.text) == table
    assert refs[0] is refs[1] is refs[2]  # one encoding per plan
    other = [dict(table[0], name="q")]  # a new plan: a new list, encoded anew, another digest
    text, ref = enc.encode({"version": 3, "tensors": other})
    assert decode_table(ref.digest, ref.text) == other and ref.digest != refs[0].digest
    assert enc.encode({"version": 4}) == (json.dumps({"version": 4}), None)
    with pytest.raises(ValueError, match="does not hash"):
        decode_table(ref.digest, refs[0].text)
    with pytest.raises(ValueError, match="expected a JSON list"):
        decode_table(Table.of("{}").digest, "{}")


def _lose_run_state(coord: Coordinator) -> None:
    """What a restart of the embedded Redis (no persistence) does to this run: its keys are gone."""
    keys = list(coord.r.scan_iter(match=f"streamrl:{coord.keys.run}:*"))
    if keys:
        coord.r.delete(*keys)


@pytest.mark.timeout(60)
def test_tensor_table_is_stored_once_and_manifests_name_it(redis_url, run_id):
    """Each version's stored manifest names the layout's table by digest (small), the table is one
    key, and a reader resolves it once per digest and caches it."""
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", keep=2)
    try:
        for v in range(3):
            pub.publish(v, SPECS, iter(make_tensors(v)))
        raw = json.loads(coord.r.get(coord.keys.manifest(2)))
        digest = raw[TABLE_REF]
        assert "tensors" not in raw and coord.r.keys(coord.keys.weights_table("*")) == [coord.keys.weights_table(digest)]
        reader = Coordinator(redis_url, run_id)
        assert reader.manifest(2) == json.loads(json.dumps(coord.last_published[1]))
        assert reader.manifest(1)["tensors"] is reader.manifest(2)["tensors"]  # decoded once
        coord.r.delete(coord.keys.weights_table(digest))
        assert reader.manifest(2) is not None  # cached by digest
        assert Coordinator(redis_url, run_id).manifest(2) is None  # a new reader: unavailable, not an error
        pub.publish(3, SPECS, iter(make_tensors(3)))  # the script finds the table missing: stored again
        assert Coordinator(redis_url, run_id).manifest(3)["tensors"] == coord.last_published[1]["tensors"]
        coord.r.set(coord.keys.weights_table(digest), coord.r.get(coord.keys.weights_table(digest)).replace("0", "1", 1))
        with pytest.raises(ValueError, match="does not hash"):
            Coordinator(redis_url, run_id).manifest(3)
    finally:
        pub.close()


@pytest.mark.timeout(60)
def test_lost_tensor_table_comes_back_with_the_learner(redis_url, run_id):
    """After Redis lost the run's state, the learner's re-assertion writes the last manifest and its
    table (a subscriber fetches that version), and the next publish stores the table if it is gone."""
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", keep=2)
    sub = WeightSubscriber(Coordinator(redis_url, run_id), plane="shm")
    try:
        pub.publish(0, SPECS, iter(make_tensors(0)))
        _lose_run_state(coord)
        assert coord.reassert_version() and coord.current_version() == 0
        check_equal(sub.fetch(0), make_tensors(0))
        _lose_run_state(coord)  # lost again before the learner noticed: the publish itself recovers
        pub.publish(1, SPECS, iter(make_tensors(1)))
        check_equal(sub.fetch(1), make_tensors(1))
    finally:
        sub.close()
        pub.close()


@pytest.mark.timeout(60)
def test_stored_manifest_is_the_published_one_when_specs_change(redis_url, run_id):
    """The manifest in Redis decodes to the publisher's (its table is spliced in from a cache),
    also after the specs change and the plan with them."""
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", keep=2)
    sub = WeightSubscriber(coord, plane="shm")
    try:
        for v, specs in enumerate([SPECS, SPECS, SPECS[:3], SPECS]):
            tensors = make_tensors(v)[: len(specs)]
            pub.publish(v, specs, iter(tensors))
            assert coord.manifest(v) == json.loads(json.dumps(coord.last_published[1]))
            assert [e["name"] for e in coord.manifest(v)["tensors"]] == [n for n, _, _ in adapt_specs(specs, "hf")]
            got = dict(sub.fetch(v))
            assert len(got) == len(specs) and all(torch.equal(got[n], t) for (n, _, _), t in zip(specs, tensors))
        assert coord.manifest(1) is None and sorted(pub.store.files) == [2, 3]
    finally:
        sub.close()
        pub.close()


@pytest.mark.timeout(30)
def test_publish_version_script_survives_a_flushed_script_cache(redis_url, run_id):
    """publish_version is one Lua script: a Redis that lost its scripts (a restart) gets it
    loaded again; versions not one apart leave one beyond keep, which the fallback GC collects."""
    coord = Coordinator(redis_url, run_id)
    coord.publish_version(0, {"v": 0}, keep=2)
    coord.r.script_flush()
    coord.publish_version(1, {"v": 1}, keep=2)
    coord.publish_version(4, {"v": 4}, keep=2)  # expires 2 (none) in the script; 0 is left for gc_versions
    assert coord.current_version() == 4 and coord.manifest(4) == {"v": 4}
    assert coord.r.zrange(coord.keys.weights_versions, 0, -1) == ["1", "4"]
    assert coord.manifest(0) is None and coord.manifest(1) == {"v": 1}


@pytest.mark.timeout(60)
def test_late_joiner_gets_newest_and_old_versions_are_collected(redis_url, run_id):
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=8192, keep=2)
    try:
        for v in range(4):
            pub.publish(v, SPECS, iter(make_tensors(10 + v)))
        sub = WeightSubscriber(coord, plane="auto")  # joins after 4 versions
        v = sub.newer_version()
        assert v == 3
        check_equal(sub.fetch(v), make_tensors(13))
        sub.mark_loaded(9, v)
        assert coord.acks()[9] == 3
        assert coord.manifest(0) is None and coord.manifest(1) is None  # GC'd
        assert sorted(pub.store.files) == [2, 3]
        assert sub.fetch(1) is None  # a collected version is reported gone, not an error
    finally:
        pub.close()


@pytest.mark.timeout(60)
def test_missed_notifications_converge_by_polling(redis_url, run_id):
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=8192)
    sub_coord = Coordinator(redis_url, run_id)
    ps = sub_coord.subscribe_versions()
    try:
        pub.publish(0, SPECS, iter(make_tensors(0)))
        ps.unsubscribe()  # the subscriber's channel drops: every later notification is lost
        ps.get_message(timeout=0.1)

        def later():
            time.sleep(0.3)
            pub.publish(1, SPECS, iter(make_tensors(1)))

        th = threading.Thread(target=later)
        th.start()
        t0 = time.monotonic()
        v = sub_coord.wait_version(0, timeout_s=10, pubsub=ps, poll_s=0.2)
        th.join()
        assert v == 1 and time.monotonic() - t0 < 5
        sub = WeightSubscriber(sub_coord)
        check_equal(sub.fetch(v), make_tensors(1))
    finally:
        pub.close()


@pytest.mark.timeout(60)
def test_corrupted_zmq_bucket_is_refetched(redis_url, run_id):
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="zmq", bucket_bytes=8192)
    try:
        tensors = make_tensors(4)
        pub.publish(0, SPECS, iter(tensors))
        sub = WeightSubscriber(coord, plane="zmq", streams=1)
        corrupt_replies(pub.server, 1)
        check_equal(sub.fetch(0), tensors)
        assert sub.checksum_failures == 1
        corrupt_replies(pub.server, 10)  # persistent corruption: raises, returns nothing
        with pytest.raises(ChecksumError):
            sub.fetch(0)
        sub.close()
    finally:
        pub.close()


class _Engine:
    def __init__(self):
        self.loads = 0
        self.params = None

    def load_weights(self, named):
        self.params = {n: t.clone() for n, t in named}
        self.loads += 1


@pytest.mark.timeout(60)
def test_corrupted_shm_bucket_is_never_loaded(redis_url, run_id):
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=8192)
    try:
        pub.publish(0, SPECS, iter(make_tensors(5)))
        path = coord.manifest(0)["path"]
        flip_byte(path, coord.manifest(0)["buckets"][1]["offset"] + 3, 0x40)  # inside the second bucket
        sub = WeightSubscriber(coord, plane="shm")
        engine = _Engine()
        with pytest.raises(ChecksumError):
            sub.load(engine, 1)
        assert engine.loads == 0 and sub.loaded_version == -1 and 1 not in coord.acks()
        pub.publish(1, SPECS, iter(make_tensors(6)))  # the next version heals it
        assert sub.load(engine, 1) == 1 and engine.loads == 1
        check_equal(engine.params.items(), make_tensors(6))
    finally:
        pub.close()


@pytest.mark.timeout(60)
def test_streaming_fetch_overlaps_publish(redis_url, run_id):
    """A subscriber that starts on a version still being written gets the complete version."""
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="zmq", bucket_bytes=4096)
    try:
        tensors = make_tensors(7)

        def slow():  # gather stalls between tensors, like collectives on a busy learner
            for t in tensors:
                time.sleep(0.05)
                yield t

        th = threading.Thread(target=pub.publish, args=(0, SPECS, slow()))
        th.start()
        sub = WeightSubscriber(Coordinator(redis_url, run_id), plane="zmq")
        v = sub.coord.wait_version(-1, timeout_s=10, include_pending=True, poll_s=0.01)
        assert v == 0
        assert sub.coord.current_version() == -1  # still writing when the fetch starts
        check_equal(sub.fetch(v), tensors)
        th.join()
        sub.close()
    finally:
        pub.close()


@pytest.mark.timeout(90)
def test_gloo_collective_plane(redis_url, run_id):
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="gloo", bucket_bytes=8192, collective_world=2, target="vllm")
    try:
        sub = WeightSubscriber(Coordinator(redis_url, run_id), collective_rank=1)
        results = {}

        def publish_all():
            for v in range(2):
                results[v] = pub.publish(v, SPECS, iter(make_tensors(20 + v)))

        th = threading.Thread(target=publish_all)
        th.start()
        # The receiver thread starts at the first fetch attempt and joins the group.
        deadline = time.monotonic() + 60
        got = None
        while got is None and time.monotonic() < deadline:
            v = coord.pending_version()
            if v >= 0:
                got = sub.fetch(v) if v == 0 else None
            time.sleep(0.01)
        th.join(timeout=60)
        check_equal(got, make_tensors(20), "vllm")
        assert sub._receiver.take(1, 30) is not None
        check_equal(sub.fetch(1), make_tensors(21), "vllm")
        sub.close()
    finally:
        pub.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_nccl_collective_plane(redis_url, run_id):
    """NCCL broadcast from cuda:0 (publisher) to cuda:1 (subscriber); needs 2 GPUs (one
    NCCL communicator cannot hold two ranks on one device)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="nccl", bucket_bytes=8192, collective_world=2, device="cuda:0")
    try:
        sub = WeightSubscriber(Coordinator(redis_url, run_id), collective_rank=1, device="cuda:1")
        tensors = [t.to("cuda:0") for t in make_tensors(30)]
        th = threading.Thread(target=pub.publish, args=(0, SPECS, iter(tensors)))
        th.start()
        got = None
        deadline = time.monotonic() + 60
        while got is None and time.monotonic() < deadline:
            if coord.pending_version() >= 0:
                got = sub.fetch(0)
            time.sleep(0.01)
        th.join(timeout=60)
        check_equal(((n, t.cpu()) for n, t in got), make_tensors(30))
        sub.close()
    finally:
        pub.close()


@pytest.mark.timeout(60)
def test_factory_from_config(redis_url, run_id):
    from streamrl.config import load_config
    from streamrl.weights.factory import make_publisher, make_subscriber

    cfg = load_config(None, ["weights.data_plane=zmq", "weights.target=vllm", "weights.bucket_mb=1"])
    coord = Coordinator(redis_url, run_id)
    pub = make_publisher(coord, run_id, cfg)
    try:
        pub.publish(0, SPECS, iter(make_tensors(40)))
        sub = make_subscriber(coord, cfg, worker_id=0)
        assert sub.plane == "zmq"
        check_equal(sub.fetch(0), make_tensors(40), "vllm")
        sub.close()
    finally:
        pub.close()


# -- fast paths: reused mappings, in-place zmq frames, page-locked store --------------------
@pytest.mark.timeout(60)
def test_reused_mapping_sees_recycled_bytes_and_catches_corruption(redis_url, run_id):
    """The subscriber keeps its mapping of a store file across versions (the publisher
    recycles the file under a new name); every fetch still sees the current bytes, and a
    byte flipped in the recycled file is caught, never loaded."""
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=8192, keep=1)
    sub = WeightSubscriber(coord, plane="shm")
    try:
        seen = set()
        for v in range(4):  # keep=1: from v2 on, each version reuses the spare file
            pub.publish(v, SPECS, iter(make_tensors(50 + v)))
            check_equal(sub.fetch(v), make_tensors(50 + v))
            seen.add(id(sub._readers.open(coord.manifest(v)["path"], coord.manifest(v)["total_bytes"])))
        assert len(seen) == 2 and len(sub._readers._files) <= 2  # two files, mapped once each
        pub.publish(4, SPECS, iter(make_tensors(54)))
        m = coord.manifest(4)
        flip_byte(m["path"], m["buckets"][-1]["offset"] + 5, 0x01)
        engine = _Engine()
        with pytest.raises(ChecksumError):
            sub.load(engine, 1, 4)
        assert engine.loads == 0 and sub.loaded_version == -1
    finally:
        sub.close()
        pub.close()


def test_reader_cache_drops_unlinked_files(tmp_path):
    from streamrl.weights.store import ReaderCache

    cache = ReaderCache(capacity=2)
    paths = []
    for i in range(3):
        p = tmp_path / f"f{i}.bin"
        p.write_bytes(bytes([i]) * 4096)
        paths.append(p)
    a = cache.open(paths[0], 4096)
    assert cache.open(paths[0], 4096) is a and int(a.buf[0]) == 0
    paths[0].unlink()
    cache.open(paths[1], 4096)
    assert len(cache._files) == 1  # the unlinked file's mapping was released
    cache.open(paths[2], 4096)
    cache.open(paths[1], 4096)
    assert len(cache._files) == 2
    with pytest.raises(FileNotFoundError):
        cache.open(paths[2], 8192)  # shorter than the manifest says: a file being recycled
    cache.close()
    assert not cache._files


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_copies_in_flight_survive_source_reuse(redis_url, run_id):
    """The store copies are asynchronous (one wait per bucket): every tensor is produced in
    one GPU scratch buffer that the next tensor overwrites at once, as a gather's freed memory
    is reused, and each version still lands bit-exact (the overwrite queues behind the copy)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=1 << 20, keep=1)
    sub = WeightSubscriber(coord, plane="shm")
    scratch = torch.empty(1 << 22, dtype=torch.uint8, device="cuda")

    def through_scratch(tensors):
        big = torch.randn(1 << 20, device="cuda")  # queued work ahead of every copy
        for t in tensors:
            big.mul_(1.0001)
            view = scratch[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t.cuda())
            yield view
    try:
        for v in range(3):
            tensors = make_tensors(70 + v)
            pub.publish(v, SPECS, through_scratch(tensors))
            assert pub.store.files[v].pinned
            check_equal(sub.fetch(v), tensors)
    finally:
        sub.close()
        pub.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_tensors_dma_into_pinned_store(redis_url, run_id):
    """GPU learner tensors go straight into the page-locked store with a GPU checksum (a
    66-byte bf16 tensor takes the bounce path); a CUDA subscriber loads them bit-exact, and
    a flipped byte is still caught."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=8192, keep=1, target="vllm")
    sub = WeightSubscriber(coord, plane="shm", device="cuda")
    try:
        for v in range(3):  # v2 lands in a recycled (already pinned) file
            tensors = [t.cuda() for t in make_tensors(60 + v)]
            pub.publish(v, SPECS, iter(tensors))
            assert pub.store.files[v].pinned
            got = [(n, t.to("cuda")) for n, t in sub.fetch(v)]
            check_equal(((n, t.cpu()) for n, t in got), make_tensors(60 + v), "vllm")
        assert all(fd_vf[1].pinned for fd_vf in sub._readers._files.values())
        m = coord.manifest(2)
        flip_byte(m["path"], m["buckets"][0]["offset"] + 9, 0x10)
        with pytest.raises(ChecksumError):
            sub.fetch(2)
    finally:
        sub.close()
        pub.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_subscriber_zmq_frames_pinned_and_verified(redis_url, run_id):
    """Over ZeroMQ a CUDA subscriber page-locks each verified bucket for the H2D load;
    a corrupted reply is still re-fetched and the loaded bytes are exact."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="zmq", bucket_bytes=8192)
    sub = WeightSubscriber(coord, plane="zmq", streams=1, device="cuda")
    try:
        tensors = make_tensors(70)
        pub.publish(0, SPECS, iter(tensors))
        corrupt_replies(pub.server, 1)
        got = [(n, t.to("cuda")) for n, t in sub.fetch(0)]
        assert sub.checksum_failures == 1 and sub._pinned_frames
        check_equal(((n, t.cpu()) for n, t in got), tensors)
    finally:
        sub.close()
        pub.close()
