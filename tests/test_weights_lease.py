"""Read leases on the shared-memory weights store: an engine only ever loads the bytes its
subscriber verified, however many versions the publisher recycles meanwhile.

Real Redis, real /dev/shm files, real ``flock``; the cross-process cases run the subscriber in
a real subprocess (this file is also its entry point: ``python test_weights_lease.py MODE``).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from streamrl.coord.coordinator import Coordinator
from streamrl.weights import lease
from streamrl.weights.adapter import adapt_tensor
from streamrl.weights.publisher import WeightPublisher
from streamrl.weights.subscriber import WeightSubscriber

REPO = Path(__file__).resolve().parents[1]
SPECS = [
    ("model.embed_tokens.weight", torch.float32, (64, 32)),
    ("model.layers.0.mlp.experts.gate_up_proj", torch.float32, (4, 16, 32)),
    ("model.layers.0.mlp.gate.weight", torch.float32, (4, 32)),
    ("model.norm.weight", torch.bfloat16, (33,)),
    ("lm_head.weight", torch.float32, (64, 32)),
]
BUCKET = 8192  # several buckets per version


def make_tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _, dtype, shape in SPECS]


def engine_view(seed: int) -> dict[str, torch.Tensor]:
    """What an engine must hold after loading the version published from ``seed``."""
    return {n: v for (name, _, _), t in zip(SPECS, make_tensors(seed)) for n, v in adapt_tensor(name, t, "hf")}


def digests(named) -> dict[str, str]:
    return {n: hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in named}


def bit_exact(got: dict[str, torch.Tensor], seed: int) -> bool:
    want = engine_view(seed)
    return set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


class CopyEngine:
    def __init__(self):
        self.params: dict[str, torch.Tensor] = {}

    def load_weights(self, named):
        self.params = {n: t.clone() for n, t in named}


def publish(pub: WeightPublisher, v: int) -> None:
    pub.publish(v, SPECS, iter(make_tensors(100 + v)))


# -- the race, in one process: deterministic ordering ----------------------------------------
@pytest.mark.timeout(60)
def test_engine_loads_exactly_the_verified_version_while_three_newer_are_published(redis_url, run_id):
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=BUCKET, keep=1)
    sub = WeightSubscriber(coord, plane="shm")
    try:
        publish(pub, 0)
        path0 = Path(coord.manifest(0)["path"])
        tensors = sub.fetch(0)  # every bucket verified; the engine has not read a byte yet
        for v in (1, 2, 3):  # keep=1: without the lease v0's file is recycled for v2
            publish(pub, v)
        engine = CopyEngine()
        engine.load_weights(tensors)
        assert bit_exact(engine.params, 100)  # the bytes it verified, not v2's
        assert 0 in pub.store.retained and path0.exists() and 0 not in pub.store.collected
        assert pub.stats()["weights/retained_versions"] == 1  # collected only once the lease is released
        del tensors  # the load is over: the last view of v0 dies, and the lease with it
        pub.collect()
        assert 0 not in pub.store.retained and 0 in pub.store.collected and not path0.exists()
        # the store recycles again: the next publishes reuse the spares (v0's and v2's files, freed
        # together) instead of new files, and never hold more files than while v0 was leased
        publish(pub, 4)
        publish(pub, 5)
        assert len(list(pub.store.dir.glob(f"streamrl-{run_id}-*.bin"))) <= 3
        assert sub.load(engine, 1, 5) == 5 and bit_exact(engine.params, 105)
    finally:
        sub.close()
        pub.close()


@pytest.mark.timeout(60)
def test_files_freed_together_are_all_recycled(redis_url, run_id):
    """A reader leases every other version until the next publish (as workers that load at
    batch boundaries do): each leased file is freed at the same GC as the next one. Both become
    spares, so after the first versions every version reuses a file (pages faulted in and
    page-locked once). With a single spare, every other version got a fresh file."""
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=BUCKET, keep=1)
    sub = WeightSubscriber(coord, plane="shm")
    try:
        inodes, held = [], None
        for v in range(16):
            publish(pub, v)  # GC: v-1 retires, and the file held until now is freed with it
            inodes.append(os.stat(pub.store.files[v].path).st_ino)
            held = list(sub.fetch(v)) if v % 2 == 0 else None
            assert v < 2 or bit_exact(dict(held or sub.fetch(v)), 100 + v)
        assert len(set(inodes)) <= 3, inodes  # v0, v1, v2 made files; v3-v15 reused them
    finally:
        del held
        sub.close()
        pub.close()


class UnleasedSubscriber(WeightSubscriber):
    """Maps the store file without taking a read lease: the race the lease exists for."""

    def _open_store(self, path: str, total: int) -> torch.Tensor:
        return self._readers.open(path, total).buf


@pytest.mark.timeout(60)
def test_without_the_lease_the_same_race_loads_unverified_bytes(redis_url, run_id):
    """A subscriber that maps the store without a read lease, under the same schedule: the
    engine ends with bytes of a later version that were never verified. This is what the
    test above guards against."""
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=BUCKET, keep=1)
    sub = UnleasedSubscriber(coord, plane="shm")
    try:
        publish(pub, 0)
        tensors = sub.fetch(0)
        for v in (1, 2, 3):
            publish(pub, v)
        assert not pub.store.retained  # nothing protects v0's file: recycled for v2
        engine = CopyEngine()
        engine.load_weights(tensors)
        assert not bit_exact(engine.params, 100)
        assert bit_exact(engine.params, 102)  # v0's verified slot now holds v2's bytes
    finally:
        sub.close()
        pub.close()


@pytest.mark.timeout(60)
def test_retained_files_are_bounded_and_readers_keep_their_bytes(redis_url, run_id):
    """Past ``max_retained`` the oldest leased file is unlinked, never recycled: its readers
    still see exactly the bytes they verified."""
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=BUCKET, keep=1, max_retained=1)
    sub = WeightSubscriber(coord, plane="shm")
    try:
        held = {}
        for v in range(3):
            publish(pub, v)
            held[v] = list(sub.fetch(v))  # an engine that keeps the views as its weights
        for v in range(3, 7):
            publish(pub, v)  # recycling goes on around the held files
        for v, named in held.items():
            assert bit_exact(dict(named), 100 + v), v
        assert sorted(pub.store.retained) == [2] and {0, 1} <= set(pub.store.collected)
        names = list(pub.store.dir.glob(f"streamrl-{run_id}-*.bin"))
        assert len(names) <= pub.keep + 1 + 1  # keep + max_retained + the spare
    finally:
        sub.close()
        pub.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_engine_loads_its_verified_version_from_the_page_locked_store(redis_url, run_id):
    """The CUDA subscriber's store mapping is page-locked and the engine's load is a DMA from
    the leased views: the same race, the same bit-exact result."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=BUCKET, keep=1)
    sub = WeightSubscriber(coord, plane="shm", device="cuda")
    try:
        publish(pub, 0)
        tensors = sub.fetch(0)
        for v in (1, 2, 3):
            publish(pub, v)
        got = {n: t.to("cuda") for n, t in tensors}  # H2D DMA from the leased, page-locked views
        assert bit_exact({n: t.cpu() for n, t in got.items()}, 100)
        assert 0 in pub.store.retained
        del tensors
        pub.collect()
        assert 0 in pub.store.collected
    finally:
        sub.close()
        pub.close()


# -- the lock protocol itself ------------------------------------------------------------------
def test_reader_that_loses_the_race_to_a_recycle_reads_nothing(tmp_path):
    """Publisher locks first and renames the file away: a reader that opened the path before
    the rename gets LeaseGone once it can lock, never a lease on the recycled file."""
    path = tmp_path / "v0.bin"
    path.write_bytes(b"\0" * 4096)
    fd = lease.try_exclusive(path)
    assert fd is not None
    out: list = []

    def reader():
        try:
            out.append(lease.acquire_read(path))
        except lease.LeaseGone as e:
            out.append(e)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.05)  # the reader opened the path and waits for the lock
    os.rename(path, tmp_path / "spare.bin")
    os.close(fd)
    t.join(5)
    assert len(out) == 1 and isinstance(out[0], lease.LeaseGone)
    # and the other order: a reader's lease makes the publisher keep the file
    rfd, _ = lease.acquire_read(tmp_path / "spare.bin")
    assert lease.try_exclusive(tmp_path / "spare.bin") is None
    os.close(rfd)
    wfd = lease.try_exclusive(tmp_path / "spare.bin")
    assert wfd is not None
    os.close(wfd)


# -- real subprocesses ---------------------------------------------------------------------------
def _child(mode: str, redis_url: str, run: str, go: str) -> int:
    """Subscriber process. ``block``: load v0 into an engine whose load waits for file ``go``;
    ``hold``: fetch v0 and keep the views (a lease) until killed."""
    coord = Coordinator(redis_url, run)
    sub = WeightSubscriber(coord, plane="shm")

    def say(**kw):
        print(json.dumps(kw), flush=True)

    if mode == "hold":
        tensors = list(sub.fetch(0))
        say(state="leased", n=len(tensors))
        time.sleep(300)
        return 1

    class BlockingEngine:
        def load_weights(self, named):
            say(state="verified")  # fetch returned: every bucket matched its checksum
            while not os.path.exists(go):
                time.sleep(0.01)
            self.params = {n: t.clone() for n, t in named}

    engine = BlockingEngine()
    assert sub.load(engine, 7, 0) == 0
    say(state="loaded", digests=digests(engine.params.items()))
    sys.stdin.read()  # stay alive (lease released already) until the test closes stdin
    sub.close()
    return 0


def _spawn(mode, redis_url, run_id, go):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, __file__, mode, redis_url, run_id, str(go)], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)


def _expect(proc, state: str) -> dict:
    line = proc.stdout.readline()  # bounded by the test timeout
    assert line, f"subscriber exited (rc={proc.poll()}) before {state!r}"
    msg = json.loads(line)
    assert msg["state"] == state, msg
    return msg


def _kill(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


@pytest.mark.timeout(90)
def test_subprocess_engine_blocked_mid_load_gets_its_verified_bytes(redis_url, run_id, tmp_path):
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=BUCKET, keep=1)
    go = tmp_path / "go"
    proc = None
    try:
        publish(pub, 0)
        proc = _spawn("block", redis_url, run_id, go)
        _expect(proc, "verified")
        for v in (1, 2, 3):
            publish(pub, v)
        go.touch()
        got = _expect(proc, "loaded")["digests"]
        assert got == digests(engine_view(100).items())  # bit-exact v0, never v2's bytes
        assert 0 in pub.store.retained  # kept while the child loaded it
        pub.collect()  # the child is alive, its load is over and its lease released
        assert 0 not in pub.store.retained and 0 in pub.store.collected
        proc.stdin.close()
        assert proc.wait(30) == 0
    finally:
        if proc is not None:
            _kill(proc)
        pub.close()


@pytest.mark.timeout(90)
def test_sigkilled_lease_holder_does_not_block_gc(redis_url, run_id, tmp_path):
    """No TTL to wait for: the kernel drops a dead process's lock with its descriptors."""
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=BUCKET, keep=1)
    proc = None
    try:
        publish(pub, 0)
        path0 = Path(coord.manifest(0)["path"])
        proc = _spawn("hold", redis_url, run_id, tmp_path / "unused")
        _expect(proc, "leased")
        publish(pub, 1)
        publish(pub, 2)
        assert 0 in pub.store.retained and path0.exists()  # alive: kept
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        pub.collect()
        assert 0 not in pub.store.retained and 0 in pub.store.collected and not path0.exists()
    finally:
        if proc is not None:
            _kill(proc)
        pub.close()


# -- weights.verify_threads ----------------------------------------------------------------------
def test_verify_threads_config_is_validated_and_wired(redis_url, run_id, monkeypatch):
    from streamrl.config import ConfigError, load_config
    from streamrl.weights import subscriber as subscriber_mod
    from streamrl.weights.factory import make_subscriber

    with pytest.raises(ConfigError, match=r"weights\.verify_threads.*0"):
        load_config(None, ["weights.verify_threads=0"])
    with pytest.raises(ValueError, match="verify_threads"):
        WeightSubscriber(Coordinator(redis_url, run_id), verify_threads=0)
    cfg = load_config(None, ["weights.data_plane=shm", "weights.verify_threads=3"])
    coord = Coordinator(redis_url, run_id)
    pub = WeightPublisher(coord, run_id, plane="shm", bucket_bytes=BUCKET)
    sub = make_subscriber(coord, cfg, worker_id=0)
    seen: list[int] = []
    real = subscriber_mod.checksum_region

    def spy(buf, algo):
        seen.append(torch.get_num_threads())
        return real(buf, algo)

    monkeypatch.setattr(subscriber_mod, "checksum_region", spy)
    before = torch.get_num_threads()
    try:
        assert sub.verify_threads == 3
        publish(pub, 0)
        engine = CopyEngine()
        assert sub.load(engine, 0, 0) == 0 and bit_exact(engine.params, 100)
        assert seen and set(seen) == {3}
        assert torch.get_num_threads() == before  # the engine's own setting is back
    finally:
        sub.close()
        pub.close()


if __name__ == "__main__":
    sys.exit(_child(*sys.argv[1:5]))
