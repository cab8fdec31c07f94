"""Collective data plane: broadcast bucket buffers in a fixed NCCL (GPU) or gloo (CPU) group.

The group is the publisher (rank 0) plus ``world - 1`` subscribers with fixed ranks. It is
separate from the learner's own process group: the publisher opens a ``TCPStore`` whose
address goes to Redis (``set_endpoint("weights-collective")`` and the manifest), and builds
``ProcessGroupNCCL`` / ``ProcessGroupGloo`` directly on it, so subscribers need no
``torch.distributed`` default group.

Per version the publisher broadcasts a header ``[version, n_buckets]`` (int64) and then each
bucket as one uint8 buffer on the device (tensors packed at their layout offsets, zero
padding); the bucket checksum (``sum64``, computed on the device) follows through Redis.
Because a broadcast needs every rank, each subscriber runs a receiver thread that takes
*every* version as it comes and keeps only the newest verified one; the worker's
``fetch`` then takes it without any transfer. Membership is fixed: a worker that joins late
or dies requires a new group (use the shm/zmq planes for elastic fleets).
"""
from __future__ import annotations

import datetime
import logging
import threading
import time

import torch
import torch.distributed as dist

from streamrl.coord.coordinator import Coordinator
from streamrl.weights.layout import ChecksumError, Layout, checksum_region, checksum_regions

log = logging.getLogger(__name__)
ENDPOINT = "weights-collective"


def _group(backend: str, store, rank: int, world: int, timeout_s: float):
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def _broadcast(pg, t: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([t], opts).wait()


class CollectiveSender:
    """Publisher end (rank 0). The group forms at the first publish (blocks until all join)."""

    def __init__(self, coord: Coordinator, backend: str, world: int, bind_host: str = "127.0.0.1",
                 advertise_host: str | None = None, device: str | None = None, timeout_s: float = 300.0):
        if world < 2:
            raise ValueError(f"weights collective_world = {world}: must be >= 2 (publisher + subscribers)")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("weights data_plane 'nccl' needs a CUDA device")
        self.coord, self.backend, self.world, self.timeout_s = coord, backend, world, timeout_s
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        self.store = dist.TCPStore(bind_host, 0, world, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.address = f"{advertise_host or bind_host}:{self.store.port}"
        coord.set_endpoint(ENDPOINT, self.address)
        self.pg = None

    def describe(self) -> dict:
        return {"backend": self.backend, "store": self.address, "world": self.world}

    def begin(self, version: int, n_buckets: int) -> None:
        if self.pg is None:
            self.pg = _group(self.backend, self.store, 0, self.world, self.timeout_s)
        _broadcast(self.pg, torch.tensor([version, n_buckets], dtype=torch.int64, device=self.device))

    def send_bucket(self, bucket: dict, pieces: list[tuple[dict, torch.Tensor]], algo: str) -> str:
        """Pack ``pieces`` ((layout entry, tensor)) into one buffer, broadcast it, return its checksum."""
        buf = torch.zeros(bucket["nbytes"], dtype=torch.uint8, device=self.device)
        for e, t in pieces:
            lo = e["offset"] - bucket["offset"]
            buf[lo: lo + e["nbytes"]].copy_(t.contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
        digest = checksum_region(buf if algo == "sum64" else buf.cpu(), algo)
        _broadcast(self.pg, buf)
        return digest

    def close(self) -> None:
        self.pg = None
        self.store = None


class CollectiveReceiver:
    """Subscriber end (``rank`` in 1..world-1): a thread receiving every broadcast version."""

    def __init__(self, coord: Coordinator, desc: dict, rank: int | None, device: str = "cpu"):
        if rank is None or not 0 < rank < desc["world"]:
            raise ValueError(f"weights collective_rank = {rank}: must be in [1, {desc['world'] - 1}]")
        self.coord, self.desc, self.rank = coord, desc, rank
        self.device = torch.device(device if desc["backend"] == "nccl" else "cpu")
        self._latest: tuple[int, Layout, dict[int, torch.Tensor], dict[str, float]] | None = None
        self._cond = threading.Condition()
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="weights-collective-rx", daemon=True)
        self._thread.start()

    def latest_version(self) -> int:
        with self._cond:
            return self._latest[0] if self._latest else -1

    def _run(self) -> None:
        try:
            host, port = self.desc["store"].rsplit(":", 1)
            store = dist.TCPStore(host, int(port), self.desc["world"], is_master=False,
                                  timeout=datetime.timedelta(seconds=300))
            pg = _group(self.desc["backend"], store, self.rank, self.desc["world"], 300.0)
            while not self._stop:
                head = torch.zeros(2, dtype=torch.int64, device=self.device)
                _broadcast(pg, head)
                version, n = int(head[0]), int(head[1])
                t0 = time.perf_counter()
                manifest = self.coord.manifest(version)
                layout = Layout.from_manifest(manifest)
                layout.check()
                bufs = {}
                for i, b in enumerate(layout.buckets):
                    buf = torch.empty(b["nbytes"], dtype=torch.uint8, device=self.device)
                    _broadcast(pg, buf)
                    bufs[i] = buf
                transfer = time.perf_counter() - t0
                sums, after = {}, "0"
                while len(sums) < n:
                    events, after = self.coord.bucket_events(version, after, block_ms=1000)
                    sums.update(dict(events))
                tv = time.perf_counter()
                got = checksum_regions(list(bufs.values()), manifest["checksum"])
                for i, digest in zip(bufs, got):
                    if digest != sums[i]:
                        raise ChecksumError(f"weights v{version} bucket {i} failed its checksum after broadcast")
                timings = {"weights/transfer_s": transfer, "weights/verify_s": time.perf_counter() - tv,
                           "weights/wait_s": 0.0, "weights/bytes": float(layout.total_bytes)}
                with self._cond:
                    self._latest = (version, layout, bufs, timings)
                    self._cond.notify_all()
        except BaseException as e:  # surfaced to the worker through take()
            if not self._stop:
                log.error("collective weights receiver failed: %s", e)
                self.error = e
                with self._cond:
                    self._cond.notify_all()

    def take(self, version: int, timeout_s: float):
        """``(layout, bufs, timings)`` of ``version`` once received, None if superseded or timed out."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._latest is None or self._latest[0] < version) and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            if self.error is not None:
                raise self.error
            if self._latest[0] != version:
                return None
            return self._latest[1:]

    def close(self) -> None:
        self._stop = True
