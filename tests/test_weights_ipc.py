"""The ipc weights plane: plane selection, config errors, the fallback, record validation and the
slot/lease protocol on CPU; on a GPU, versions through CUDA IPC to a subscriber in another process.

The GPU tests share one subscriber subprocess (this file is its entry point: ``python
test_weights_ipc.py``, commands as JSON lines on stdin, one JSON reply line each), real Redis,
real lease files. They run in seconds: ``pytest -q -m gpu tests/test_weights_ipc.py``.
"""
from __future__ import annotations

import doctest
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from streamrl.config import ConfigError, load_config
from streamrl.coord.coordinator import Coordinator
from streamrl.weights import lease, planes
from streamrl.weights.adapter import adapt_specs, adapt_tensor
from streamrl.weights.ipc import IpcRecordError, VersionSlots, parse_record
from streamrl.weights.layout import Layout, ResidentTensors
from streamrl.weights.publisher import WeightPublisher, host_id
from streamrl.weights.subscriber import WeightSubscriber

SPECS = [
    ("model.embed_tokens.weight", torch.float32, (50, 32)),
    ("model.layers.0.mlp.experts.gate_up_proj", torch.float32, (4, 16, 32)),
    ("model.layers.0.mlp.experts.down_proj", torch.float32, (4, 32, 8)),
    ("model.norm.weight", torch.bfloat16, (33,)),  # 66 bytes: not a multiple of 8
    ("lm_head.weight", torch.float32, (50, 32)),
]
TARGET = "vllm"  # per-expert slices: non-contiguous pieces on the way in
TOTAL = Layout.plan(adapt_specs(SPECS, TARGET), 8192).total_bytes  # bytes of one version
CUDA = ["learner.device=cuda", "rollout.device=cuda"]


def make_tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _, dtype, shape in SPECS]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def engine_digests(tensors: list[torch.Tensor]) -> dict[str, str]:
    """Digests of what an engine holds after loading a version of ``tensors`` (their values now)."""
    return {n: digest(v) for (name, _, _), t in zip(SPECS, tensors) for n, v in adapt_tensor(name, t, TARGET)}


def expected(seed: int) -> dict[str, str]:
    """Digests of what an engine holds after loading the version published from ``seed``."""
    return engine_digests(make_tensors(seed))


# -- plane selection (CPU) -------------------------------------------------------------------------
def test_planes_examples():
    assert doctest.testmod(planes).failed == 0


@pytest.mark.parametrize("overrides, local, plane, why", [
    ([], True, "auto", "learner.device = 'cpu'"),
    (["learner.device=cuda"], True, "auto", "rollout.device = 'cpu'"),
    (CUDA, True, "ipc", None),
    (CUDA, False, "auto", "non-loopback"),
    (["placement.learner=[cuda:0]", "placement.rollout=[cuda:0]", "placement.colocate=[[learner, rollout]]"],
     True, "ipc", None),
    (["placement.learner=[cuda:0]", "placement.rollout=[cuda:0, cpu]"], True, "auto", "placement.rollout"),
    (["placement.learner=[node0:cuda:0]", "placement.rollout=[node1:cuda:0]"], True, "auto", "one host"),
    ([*CUDA, "eval.interval=5"], True, "auto", "eval.device = 'cpu'"),
    ([*CUDA, "eval.interval=5", "eval.device=cuda"], True, "ipc", None),
    ([*CUDA, "weights.checksum=crc32"], True, "auto", "weights.checksum"),
    ([*CUDA, "weights.data_plane=shm"], True, "shm", None),
    (["weights.data_plane=zmq"], False, "zmq", None),
    ([*CUDA, "weights.data_plane=ipc"], True, "ipc", None),
])
def test_auto_picks_ipc_only_when_both_ends_are_cuda_on_one_host(overrides, local, plane, why):
    got, reason = planes.select_plane(load_config(None, overrides), local_only=local)
    assert got == plane
    assert (reason is None) == (why is None) and (why is None or why in reason), reason


@pytest.mark.parametrize("overrides, needle", [
    ([], "config field 'learner.device' = 'cpu': CUDA IPC needs the learner on a CUDA device"),
    (["learner.device=cuda", "rollout.device=cpu"], "config field 'rollout.device' = 'cpu'"),
    ([*CUDA, "weights.checksum=crc32"], "config field 'weights.checksum' = 'crc32'"),
])
def test_explicit_ipc_off_cuda_is_a_one_line_config_error(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*overrides, "weights.data_plane=ipc"])
    assert needle in str(e.value) and "weights.data_plane = ipc" in str(e.value) and "\n" not in str(e.value)


def test_explicit_ipc_off_cuda_fails_the_dry_run(capsys, repo):
    from streamrl.launcher import launch

    assert launch.main(["--config", str(repo / "configs/tiny.yaml"), "weights.data_plane=ipc", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("streamrl-launch: config field 'learner.device' = 'cpu'") and "\n" not in err, err


@pytest.mark.timeout(60)
def test_auto_falls_back_to_shm_and_logs_why_once(redis_url, run_id, caplog):
    from streamrl.weights.factory import make_publisher, make_subscriber

    cfg = load_config(None, ["weights.bucket_mb=1"])
    coord = Coordinator(redis_url, run_id)
    with caplog.at_level(logging.INFO, logger="streamrl.weights.factory"):
        pub = make_publisher(coord, run_id, cfg)
    try:
        why = [r.getMessage() for r in caplog.records if "not ipc" in r.getMessage()]
        assert len(why) == 1 and "learner.device = 'cpu'" in why[0], why
        assert pub.plane == "auto" and pub.server is not None
        pub.publish(0, SPECS, iter(make_tensors(1)))
        sub = make_subscriber(coord, cfg, worker_id=0)
        got = {n: digest(t) for n, t in sub.fetch(0)}
        assert got == {n: digest(v) for (name, _, _), t in zip(SPECS, make_tensors(1))
                       for n, v in adapt_tensor(name, t, "hf")}
        sub.close()
    finally:
        pub.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_ipc_publisher_without_cuda_is_refused(run_id):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        WeightPublisher(None, run_id, plane="ipc")


# -- the record from Redis (CPU) -------------------------------------------------------------------
GOOD = {"uuid": "1f2e3d4c-0000-1111-2222-333344445555", "handle": "00" * 66, "size": 4096, "offset": 512,
        "ref_counter": b"/torch_123_456_0".hex(), "ref_counter_offset": 7, "event": "ab" * 64, "event_sync": True}


def test_a_good_record_decodes():
    rec = parse_record(dict(GOOD), total=4096)
    assert rec["handle"] == bytes(66) and rec["ref_counter"] == b"/torch_123_456_0" and rec["offset"] == 512


@pytest.mark.parametrize("change, field", [
    ({"size": 100}, "cannot hold a version"),
    ({"size": "4096"}, "'size'"),
    ({"offset": -1}, "'offset'"),
    ({"ref_counter_offset": 10000}, "'ref_counter_offset'"),
    ({"ref_counter_offset": True}, "'ref_counter_offset'"),
    ({"handle": "zz"}, "'handle'"),
    ({"handle": ""}, "'handle'"),
    ({"handle": None}, "'handle'"),
    ({"event": "ab" * 63}, "'event'"),
    ({"ref_counter": b"../etc/passwd".hex()}, "'ref_counter'"),
    ({"event_sync": 1}, "'event_sync'"),
    ({"uuid": "GPU 0; rm -rf"}, "'uuid'"),
    ({"uuid": None}, "'uuid'"),
])
def test_a_malformed_record_is_rejected_naming_the_field(change, field):
    with pytest.raises(IpcRecordError, match=field):
        parse_record({**GOOD, **change}, total=4096)
    with pytest.raises(IpcRecordError, match="not a mapping"):
        parse_record(["not", "a", "dict"], total=4096)


def _ipc_manifest(version: int, record, host: str, path: str) -> dict:
    layout = Layout.plan(adapt_specs(SPECS, "hf"), 8192)
    for b in layout.buckets:
        b["checksum"] = "0"
    return {"version": version, "state": "complete", "plane": "ipc", "target": "hf", "checksum": "sum64",
            "total_bytes": layout.total_bytes, "host": host, "tensors": layout.tensors, "buckets": layout.buckets,
            "path": path, "ipc": record}


@pytest.mark.timeout(60)
def test_subscriber_rejects_a_malformed_record_from_redis(redis_url, run_id, tmp_path):
    """A bad record from Redis is a clear IpcRecordError before torch or the lease sees it; a good
    record this process cannot map (another host, no CUDA) says how to fix the config."""
    coord = Coordinator(redis_url, run_id)
    path = str(tmp_path / "v.lease")
    bad = {**GOOD, "size": 1 << 20, "ref_counter_offset": 1 << 40}  # would write far outside torch's counter file
    coord.publish_version(0, _ipc_manifest(0, bad, host_id(), path))
    coord.publish_version(1, _ipc_manifest(1, "garbage", host_id(), path))
    coord.publish_version(2, _ipc_manifest(2, {**GOOD, "size": 1 << 20}, "elsewhere/boot", path))
    sub = WeightSubscriber(coord, plane="shm")  # a forced host plane still follows the manifest's ipc
    try:
        with pytest.raises(IpcRecordError, match="'ref_counter_offset'"):
            sub.fetch(0)
        with pytest.raises(IpcRecordError, match="not a mapping"):
            sub.fetch(1)
        with pytest.raises(IpcRecordError, match="set weights.data_plane to auto or shm"):
            sub.fetch(2)
        assert not Path(path).exists() and sub.loaded_version == -1
    finally:
        sub.close()


# -- slots and leases (CPU) ------------------------------------------------------------------------
def test_the_buffer_goes_to_the_next_version_and_a_late_reader_finds_the_old_one_gone(tmp_path):
    slots = VersionSlots("r", directory=tmp_path)
    assert [slots.claim(v) for v in (0, 1, 2)] == [0, 0, 0]
    assert slots.take_retired() == [0, 1] and not slots.path(1).exists() and slots.path(2).exists()
    with pytest.raises(lease.LeaseGone):  # a reader that comes late finds v1 gone, never v2's bytes
        lease.acquire_read(slots.path(1))
    slots.close()
    assert not list(tmp_path.iterdir())


def test_claim_waits_while_a_reader_leases_the_buffers_version(tmp_path, caplog):
    """The publisher waits for the reader's copy, then takes the buffer; on a deadline it names the version."""
    slots = VersionSlots("r", directory=tmp_path, wait_s=0.2)
    slots.claim(0)
    fd, _ = lease.acquire_read(slots.path(0))
    with pytest.raises(TimeoutError, match=r"v\[0\] stayed leased"):
        slots.claim(1)
    assert slots.held == [0] and slots.retained == {0} and slots.path(0).exists()
    slots.wait_s = 10.0
    threading.Timer(0.3, os.close, (fd,)).start()  # the reader finishes its copy
    t0 = time.monotonic()
    assert slots.claim(1) == 0 and 0.2 < time.monotonic() - t0 < 5
    assert slots.take_retired() == [0] and not slots.retained and slots.held == [1]
    assert sum("waits for a slot" in r.getMessage() for r in caplog.records) == 2  # once per claim
    slots.close()


def test_two_slots_alternate_and_reuse_the_oldest_unleased_version(tmp_path):
    slots = VersionSlots("r", n=2, directory=tmp_path)
    assert [slots.claim(v) for v in (0, 1, 2)] == [0, 1, 0]
    assert slots.take_retired() == [0] and not slots.path(0).exists() and slots.path(2).exists()
    slots.close()
    assert not list(tmp_path.iterdir())


def test_with_two_slots_a_leased_version_keeps_its_slot_until_the_lease_ends(tmp_path):
    """The reader leases v0; v1, v2, v3 all go to the other slot; v0's slot is reused only after."""
    slots = VersionSlots("r", n=2, directory=tmp_path)
    slots.claim(0)
    fd, _ = lease.acquire_read(slots.path(0))
    assert [slots.claim(v) for v in (1, 2, 3)] == [1, 1, 1]
    assert slots.held == [0, 3] and slots.retained == {0} and slots.take_retired() == [1, 2]
    os.close(fd)
    assert slots.claim(4) == 0 and slots.take_retired() == [0] and not slots.retained


@pytest.mark.parametrize("value", [0, 3])
def test_ipc_buffers_is_one_or_two(value):
    with pytest.raises(ConfigError, match=f"'weights.ipc_buffers' = {value}: must be 1 or 2"):
        load_config(None, [f"weights.ipc_buffers={value}"])


def test_a_stale_lease_file_of_an_earlier_incarnation_is_replaced(tmp_path):
    old = VersionSlots("r", directory=tmp_path)
    old.claim(5)
    fd, key = lease.acquire_read(old.path(5))  # a reader of the crashed incarnation keeps its lease
    new = VersionSlots("r", directory=tmp_path)
    new.claim(5)
    assert os.stat(new.path(5)).st_ino != key[1]
    os.close(fd)
    new.close()


# -- GPU: a subscriber in another process ------------------------------------------------------------
def _child() -> int:
    """Subscriber process: one JSON command per stdin line, one JSON reply per stdout line; it
    exits when stdin closes."""
    sub, held = None, None

    class Engine:
        def load_weights(self, named):
            self.params = {n: t.clone() for n, t in named}  # device to device

    engine = Engine()
    for line in sys.stdin:
        cmd = json.loads(line)
        op, reply = cmd["op"], {"ok": True}
        if op == "run":
            if sub is not None:
                sub.close()
            sub = WeightSubscriber(Coordinator(cmd["redis"], cmd["run"]))
        elif op == "load":
            engine.params = {}
            reply["v"] = sub.load(engine, 1, cmd["v"])  # None when the version is gone
            reply["digests"] = {n: digest(t) for n, t in engine.params.items()}
            reply["devices"] = sorted({str(t.device) for t in engine.params.values()})
        elif op == "hold":
            held = list(sub.fetch(cmd["v"]))
            bases = list(sub._devices._bases.values())
            reply["zero_copy"] = all(any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() for b in bases)
                                     for _, t in held)
        elif op == "check":
            reply["digests"] = {n: digest(t) for n, t in held}
        elif op == "release":
            held = None  # the last views die: the lease ends (after the GPU sync)
        print(json.dumps(reply), flush=True)
    return 0


class Child:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def ask(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"subscriber process exited (rc {self.proc.poll()}) on {op}"
        return json.loads(line)


@pytest.fixture(scope="module")
def child():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    c = Child()
    yield c
    c.proc.stdin.close()
    c.proc.wait(timeout=30)


@pytest.fixture(params=[1], ids=lambda n: f"{n}buf")
def ipc(request, child, redis_url, run_id):
    """``(publisher, coordinator, child)`` on a fresh run; the child subscribes to it. The publisher
    has one device buffer (the default) unless the test parametrizes ``ipc`` indirectly."""
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="ipc", bucket_bytes=8192, target=TARGET, ipc_buffers=request.param)
    child.ask("run", redis=redis_url, run=run_id)
    yield pub, coord, child
    pub.close()


def on_gpu(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A learner's tensors: on the GPU but for the small bf16 one, which stays on the CPU like the
    scaling tensor of a LoRA version (it must travel into the device buffer too)."""
    return [t if t.dtype == torch.bfloat16 else t.cuda() for t in tensors]


def publish(pub: WeightPublisher, v: int) -> None:
    pub.publish(v, SPECS, iter(on_gpu(make_tensors(100 + v))))


def slot_digest(pub: WeightPublisher, v: int) -> str:
    return digest(pub.store.files[v].region(0, TOTAL))


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_round_trip_bit_exact_in_another_process(ipc):
    """Three versions through one device buffer: each loads bit-exact on the GPU in the other
    process, every version reuses the buffer (same handle), and the publisher's extra GPU memory
    is one version's bytes."""
    pub, coord, child = ipc
    sources = {v: on_gpu(make_tensors(100 + v)) for v in range(3)}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for v in range(3):
        pub.publish(v, SPECS, iter(sources[v]))
        got = child.ask("load", v=v)
        assert got["v"] == v and got["digests"] == expected(100 + v) and got["devices"][0].startswith("cuda")
        assert coord.acks()[1] == v and coord.manifest(v)["plane"] == "ipc"
    # a buffer is (allocation handle, offset): the caching allocator may carve both buffers out of one segment
    records = [(coord.manifest(v)["ipc"]["handle"], coord.manifest(v)["ipc"]["offset"]) for v in range(3)]
    assert records[0] == records[1] == records[2]
    assert torch.cuda.memory_allocated() - before <= TOTAL + 1024


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_a_background_publish_holds_the_weights_of_its_call(ipc):
    """The learner's publish: the copies are only queued (no host wait) and the learner updates its
    weights in place at once, behind a long kernel so the copies are still pending; the version
    still holds the weights of the call, bit-exact in the other process."""
    pub, coord, child = ipc
    for v in range(3):
        sources = on_gpu(make_tensors(100 + v))
        big = torch.randn(4096, 4096, device="cuda")
        torch.cuda.synchronize()
        for _ in range(8):  # ~10 ms of work queued ahead of the copies
            big = big @ big / 64
        timings = pub.publish(v, SPECS, iter(sources), background=True)
        assert timings["weights/gpu_wait_s"] == 0.0
        for t in sources:
            t.add_(1)  # the next optimizer step, queued after the copies
        pub.wait_announced()
        assert child.ask("load", v=v)["digests"] == expected(100 + v)
        assert coord.acks()[1] == v


class CountedResident(ResidentTensors):
    """Resident tensors that count how often a publish takes them one by one."""
    taken = 0

    def __iter__(self):
        self.taken += 1
        return super().__iter__()


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_resident_tensors_replay_their_copies_bit_exact(ipc):
    """The one-GPU learner's publish: the same resident tensors every version, updated in place
    right after each publish. The first version takes them one by one and records its copies;
    every later version replays them (the tensors are not taken again), and every version loads
    bit-exact with the values of its call."""
    pub, coord, child = ipc
    tensors = on_gpu(make_tensors(100))  # the test reads them through this list: not counted
    resident = CountedResident(tensors)
    for v in range(5):
        want = engine_digests(tensors)
        timings = pub.publish(v, SPECS, resident, background=True)
        assert timings["weights/peak_tensor_bytes"] == max(t.nbytes for t in tensors)
        for t in tensors:
            t.add_(1)  # the next optimizer step, queued after the copies
        pub.wait_announced()
        assert child.ask("load", v=v)["digests"] == want
        assert resident.taken == 1  # v0 records the copies; v1.. replay them


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_resident_tensors_that_need_a_copy_are_taken_every_version(ipc):
    """A non-contiguous resident tensor is copied through a temporary: nothing is recorded, each
    version takes every tensor again, and each loads bit-exact."""
    pub, coord, child = ipc
    tensors = on_gpu(make_tensors(100))
    tensors[0] = tensors[0].t().contiguous().t()  # same shape and values, transposed storage
    resident = CountedResident(tensors)
    for v in range(4):
        want = engine_digests(tensors)
        pub.publish(v, SPECS, resident, background=True)
        assert pub.store.files[v].plan is None
        for t in tensors:
            t.add_(1)
        pub.wait_announced()
        assert child.ask("load", v=v)["digests"] == want
    assert resident.taken == 4


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_a_version_is_never_torn_while_the_worker_holds_it(ipc):
    """The worker holds v0's views (its lease): publishing v1 waits, v0's bytes stay exactly what
    the worker verified; once the views are freed v1 takes the buffer and loads bit-exact."""
    pub, coord, child = ipc
    publish(pub, 0)
    v0_buf, before = pub.store.files[0].buf, slot_digest(pub, 0)
    assert child.ask("hold", v=0)["zero_copy"]  # views of the publisher's buffer, not copies
    th = threading.Thread(target=publish, args=(pub, 1))
    th.start()
    th.join(0.3)
    assert th.is_alive() and coord.manifest(1) is None and pub.store.retained == {0}  # the learner waits
    assert slot_digest(pub, 0) == before
    assert child.ask("check")["digests"] == expected(100)
    child.ask("release")
    th.join(10)
    assert not th.is_alive() and sorted(pub.store.files) == [1] and pub.store.files[1].buf is v0_buf
    assert child.ask("load", v=1)["digests"] == expected(101)


@pytest.mark.gpu
@pytest.mark.timeout(60)
@pytest.mark.parametrize("ipc", [2], indirect=True, ids=["2buf"])
def test_with_two_buffers_the_learner_publishes_while_the_worker_holds_a_version(ipc):
    """``weights.ipc_buffers: 2``: the worker holds v0's views while v1, v2 and v3 are published
    without waiting: they all go to the other buffer, and v0's bytes stay what the worker verified."""
    pub, coord, child = ipc
    publish(pub, 0)
    before = slot_digest(pub, 0)
    assert child.ask("hold", v=0)["zero_copy"]
    for v in (1, 2, 3):
        publish(pub, v)
    assert sorted(pub.store.files) == [0, 3] and pub.store.retained == {0}
    assert slot_digest(pub, 0) == before
    assert child.ask("check")["digests"] == expected(100)
    child.ask("release")
    assert child.ask("load", v=3)["digests"] == expected(103)


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_a_reader_late_for_a_retired_version_loads_the_next_one(ipc):
    """A worker that saw v0 announced but comes to load it after v1 took the buffer gets nothing
    for v0 (never v1's bytes under v0's name) and then loads v1."""
    pub, coord, child = ipc
    publish(pub, 0)
    publish(pub, 1)
    assert sorted(pub.store.files) == [1] and coord.manifest(0) is not None  # v0 is announced but retired
    assert child.ask("load", v=0) == {"ok": True, "v": None, "digests": {}, "devices": []}
    assert child.ask("load", v=1)["digests"] == expected(101)


if __name__ == "__main__":
    sys.exit(_child())
