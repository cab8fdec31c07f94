"""Worker side: find the newest version, fetch and verify every bucket, hand it over whole.

``fetch(v)`` returns only after **every** bucket of ``v`` arrived and matched its checksum
(a mismatching bucket is re-fetched up to ``retries`` times, then :class:`ChecksumError`),
so the engine's ``load_weights`` sees a complete, verified version or nothing: no sample
ever comes from half-loaded or corrupted weights. It can start on a version that is still
being written (``newer_version(include_pending=True)``): buckets are transferred and
verified as Redis announces them, overlapping the learner's gather.

The plane comes from the manifest: a collective plane (nccl/gloo) or the learner's device
buffers (``ipc``, :mod:`streamrl.weights.ipc`: verified and handed over on the GPU, under the
same kind of read lease) when the publisher uses one; otherwise shared memory when the
manifest's host is this host (``plane="auto"``) or forced, else ZeroMQ from the publisher's
bucket server.

Same-host store files stay mapped across fetches (:class:`~streamrl.weights.store.ReaderCache`);
for a CUDA engine they, and verified ZeroMQ buckets, are page-locked, so the engine's load
is a DMA (:mod:`streamrl.weights.pinning`). Every bucket is verified before any tensor is
handed over. The engine reads the store *after* the verify, so a same-host fetch first takes
a read lease on the version's file (:mod:`streamrl.weights.lease`): the publisher does not
recycle a leased file, and the lease lives exactly as long as any tensor this fetch handed
out, so the engine can only ever read the bytes that were verified, however long its load
takes and however many versions are published meanwhile. Drop the tensors once loaded
(:meth:`load` does) so the publisher can recycle the file; an engine that copies them
asynchronously (``non_blocking`` H2D) must synchronize before it drops them.

``verify_threads``: torch intra-op threads for the checksums (set around each fetch and
restored, so the engine keeps its own setting; the process-wide setting changes meanwhile).

Timings of the last fetch (``weights/wait_s``: waiting for the publisher's buckets,
``weights/transfer_s``: fetch wall time, ``weights/verify_s``: checksums, ``weights/load_s``:
engine load, set by :meth:`load`) go to Redis with the ack.
"""
from __future__ import annotations

import os
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from streamrl.coord.coordinator import Coordinator
from streamrl.weights import lease, pinning
from streamrl.weights.collective import CollectiveReceiver
from streamrl.weights.ipc import DeviceReader
from streamrl.weights.layout import ChecksumError, Layout, checksum_region, checksum_regions
from streamrl.weights.publisher import COLLECTIVE_PLANES, host_id
from streamrl.weights.store import ReaderCache
from streamrl.weights.zmq_plane import BucketClient

SUB_PLANES = ("auto", "shm", "zmq")


def _as_tensor(buf: memoryview) -> torch.Tensor:
    with warnings.catch_warnings():  # received buffers are read-only; views are documented so
        warnings.simplefilter("ignore")
        t = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    # libzmq's large buffers start 8 bytes short of a 64-byte line: views and copies from
    # them are exact on x86/ARM (unaligned vector loads), so only a misaligned word (never
    # seen) is worth a copy of the whole bucket; sum64 reads int64 words.
    if t.data_ptr() % 8:
        t = t.clone()
    return t


@contextmanager
def intra_op_threads(n: int | None):
    """Run the block with ``n`` torch intra-op threads (None: leave the setting alone)."""
    prev = torch.get_num_threads()
    if n is None or n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


@dataclass
class _Fetch:
    """One point-to-point fetch in progress: buckets announced (index -> checksum), requested
    (ZeroMQ) and verified (index -> uint8 [nbytes] view)."""

    version: int
    manifest: dict
    layout: Layout
    store: torch.Tensor | None
    """uint8 [total bytes] over the same-host store file, or (ipc) over the learner's device buffer
    on a GPU; None: buckets come over ZeroMQ."""
    known: dict[int, str]
    bufs: dict[int, torch.Tensor] = field(default_factory=dict)
    tries: dict[int, int] = field(default_factory=dict)
    requested: set[int] = field(default_factory=set)
    after: str = "0"
    """Redis stream id of the last bucket announcement read."""
    wait_s: float = 0.0
    verify_s: float = 0.0


class WeightSubscriber:
    """Fetch verified versions for one rollout worker."""

    def __init__(self, coord: Coordinator, plane: str = "auto", streams: int = 2, retries: int = 2,
                 timeout_s: float = 120.0, collective_rank: int | None = None, device: str = "cpu",
                 pin_store: bool | None = None, verify_threads: int | None = None):
        """``device``: where the engine's weights live; with a CUDA device (or ``pin_store``)
        same-host store mappings are page-locked so the engine's load is a DMA from them.
        ``verify_threads``: torch threads for the checksums (None: the process setting)."""
        if plane not in SUB_PLANES:
            raise ValueError(f"weights subscriber plane {plane!r} is unknown; choose one of {SUB_PLANES}")
        if verify_threads is not None and verify_threads < 1:
            raise ValueError(f"weights verify_threads = {verify_threads}: must be >= 1")
        self.verify_threads = verify_threads
        self.coord, self.plane, self.streams = coord, plane, streams
        self.retries, self.timeout_s = retries, timeout_s
        self.loaded_version = -1
        self.host = host_id()
        self.timings: dict[str, float] = {}
        self.checksum_failures = 0
        self._client: BucketClient | None = None
        self._receiver = None
        self._collective_rank, self._device = collective_rank, device
        # Same-host mappings, reused while the publisher recycles its files; page-locked for
        # a GPU engine so its load is a DMA straight from the store.
        pin = str(device).startswith("cuda") if pin_store is None else pin_store
        self._readers = ReaderCache(pin_cuda=pin)
        self._devices = DeviceReader()  # ipc: the publisher's device buffers, opened once each
        self._pinned_frames: list[torch.Tensor] = []  # received zmq buckets page-locked for H2D
        self._pin_frames = pin

    # -- discovery ---------------------------------------------------------------------
    def newer_version(self, include_pending: bool = False) -> int | None:
        """The newest version above ``loaded_version`` (complete only, unless ``include_pending``)."""
        v = self.coord.pending_version() if include_pending else self.current()
        return v if v > self.loaded_version else None

    def current(self) -> int:
        if self._receiver is not None:
            return max(self._receiver.latest_version(), -1)
        return self.coord.current_version()

    # -- fetch -------------------------------------------------------------------------
    def fetch(self, version: int) -> Iterator[tuple[str, torch.Tensor]] | None:
        """Every tensor of ``version`` as ``(engine name, read-only view)``, verified.

        None when the version is gone (garbage-collected, superseded) or its publisher
        stopped before finishing it. Raises :class:`ChecksumError` when a bucket still
        mismatches after ``retries`` re-fetches; nothing of the version is returned then.
        Same-host views hold the store's read lease until the last of them is freed.
        """
        with intra_op_threads(self.verify_threads):
            return self._fetch(version)

    def _open_store(self, path: str, total: int) -> torch.Tensor:
        """uint8 [total] over the version's store file, holding a read lease that lives as long
        as any view of it. Raises FileNotFoundError when gone."""
        fd, key = lease.acquire_read(path)  # before reading a byte: see streamrl.weights.lease
        try:
            vf = self._readers.open(path, total, expect=key)
            return vf.leased(fd)
        except BaseException:
            os.close(fd)
            raise

    def _fetch(self, version: int) -> Iterator[tuple[str, torch.Tensor]] | None:
        t0 = time.perf_counter()
        self._unpin_frames()  # the previous fetch's buckets: loaded by now, or dropped
        manifest = self.coord.manifest(version)
        if manifest is None:
            return None
        if manifest.get("plane") in COLLECTIVE_PLANES:
            return self._fetch_collective(version, manifest, t0)
        f = self._begin_fetch(version, manifest)
        if f is None:
            return None
        n = len(f.layout.buckets)
        deadline = time.monotonic() + self.timeout_s
        while len(f.bufs) < n:
            if time.monotonic() > deadline or not self._learn_announced(f):
                return None
            arrived = self._arrived(f)
            for (i, buf), digest in zip(arrived, self._digests(f, arrived)):
                if not self._accept(f, i, buf, digest):
                    return None
        self.timings = {"weights/wait_s": f.wait_s, "weights/transfer_s": time.perf_counter() - t0,
                        "weights/verify_s": f.verify_s, "weights/bytes": float(f.layout.total_bytes)}
        return (pair for i in range(n) for pair in f.layout.views(i, f.bufs[i]))

    def _begin_fetch(self, version: int, manifest: dict) -> _Fetch | None:
        """Open the version's same-host store file or device buffer, or connect to its publisher's
        bucket server. None when the version's file or buffer is already gone."""
        layout = Layout.from_manifest(manifest)
        layout.check()
        store = None
        if manifest.get("plane") == "ipc":
            try:
                store = self._devices.open(manifest, self.host)
            except FileNotFoundError:  # retired (its slot reused) before we leased it
                return None
        elif self.plane == "shm" or (self.plane == "auto" and manifest.get("host") == self.host):
            try:
                store = self._open_store(manifest["path"], layout.total_bytes)
            except FileNotFoundError:  # collected (or recycled) before we got to it
                return None
        elif self._client is None or self._client.endpoint != manifest["endpoint"]:
            if self._client is not None:
                self._client.close()
            self._client = BucketClient(manifest["endpoint"], self.streams)
        known = {}
        if manifest["state"] == "complete":
            known = {i: b["checksum"] for i, b in enumerate(layout.buckets)}
        return _Fetch(version, manifest, layout, store, known)

    def _learn_announced(self, f: _Fetch) -> bool:
        """Add the buckets the publisher announced since the last call to ``f.known``: blocking
        briefly when there is nothing to transfer meanwhile. False when the version was collected."""
        if len(f.known) == len(f.layout.buckets):
            return True
        if f.store is not None or not self._client.pending():
            tw = time.perf_counter()
            events, f.after = self.coord.bucket_events(f.version, f.after, block_ms=200)
            f.wait_s += time.perf_counter() - tw
            f.known.update(dict(events))
            return bool(events) or self.coord.manifest(f.version) is not None  # else collected while we waited
        # Drain fast announcements without blocking the transfer.
        events, f.after = self.coord.bucket_events(f.version, f.after, block_ms=None)
        f.known.update(dict(events))
        return True

    def _arrived(self, f: _Fetch) -> list[tuple[int, torch.Tensor | None]]:
        """Announced buckets now readable: store slices (same host), or ZeroMQ replies to the
        requests sent for every newly announced bucket (None: the publisher no longer has it)."""
        if f.store is not None:
            spans = ((i, f.layout.buckets[i]) for i in sorted(set(f.known) - set(f.bufs)))
            return [(i, f.store[b["offset"]: b["offset"] + b["nbytes"]]) for i, b in spans]
        for i in sorted(set(f.known) - f.requested):
            self._client.request(f.version, i)
            f.requested.add(i)
        return [(i, None if data is None else _as_tensor(data))
                for v, i, data in self._client.poll(50 if self._client.pending() else 0) if v == f.version]

    def _digests(self, f: _Fetch, arrived: list[tuple[int, torch.Tensor | None]]) -> list[str | None]:
        """The arrived buckets' checksums, all at once where the store is a device buffer (ipc:
        one read back for the version, not one per bucket); else None each (:meth:`_accept`
        sums a bucket as it takes it)."""
        if f.store is None or not f.store.is_cuda or not arrived:
            return [None] * len(arrived)
        tv = time.perf_counter()
        digests = checksum_regions([buf for _, buf in arrived], f.manifest["checksum"])
        f.verify_s += time.perf_counter() - tv
        return digests

    def _accept(self, f: _Fetch, i: int, buf: torch.Tensor | None, digest: str | None = None) -> bool:
        """Verify bucket ``i`` (against ``digest`` when already summed) and keep it, or schedule its
        re-fetch. False when the version is gone; raises :class:`ChecksumError` once its
        re-fetches are used up."""
        if buf is None:
            return False  # the publisher no longer holds this version
        if digest is None:
            tv = time.perf_counter()
            digest = checksum_region(buf, f.manifest["checksum"])
            f.verify_s += time.perf_counter() - tv
        if digest == f.known[i]:
            f.bufs[i] = buf
            if f.store is None and self._pin_frames:
                self._pin_frame(buf)
            return True
        self.checksum_failures += 1
        if self.coord.manifest(f.version) is None:
            return False  # collected (and its file recycled) while we read it
        f.tries[i] = f.tries.get(i, 0) + 1
        if f.tries[i] > self.retries:
            raise ChecksumError(f"weights v{f.version} bucket {i} failed its checksum "
                                f"{f.tries[i]} times; not loading")
        f.requested.discard(i)  # zmq: asked again next round; shm: re-read next round
        return True

    def _pin_frame(self, buf: torch.Tensor) -> None:
        """A received bucket is private, pageable memory: page-lock it for a GPU engine (overlapping
        the transfer) so its load is a DMA; where that fails (the locked-memory limit) stay pageable."""
        if pinning.register(buf):
            self._pinned_frames.append(buf)
        else:
            self._pin_frames = False

    def _fetch_collective(self, version: int, manifest: dict, t0: float):
        if self._receiver is None:
            self._receiver = CollectiveReceiver(self.coord, manifest["collective"], self._collective_rank, self._device)
        got = self._receiver.take(version, self.timeout_s)
        if got is None:
            return None
        layout, bufs, timings = got
        self.timings = {**timings, "weights/transfer_s": time.perf_counter() - t0 + timings.get("weights/transfer_s", 0.0)}
        return (pair for i in range(len(layout.buckets)) for pair in layout.views(i, bufs[i]))

    # -- load + ack --------------------------------------------------------------------
    def load(self, engines, worker_id: int, version: int | None = None) -> int | None:
        """Fetch the newest (or given) version, load it into ``engines`` (one engine or a list,
        e.g. the rollout engine and its parity reference) and ack; returns the version loaded or
        None. The one weight-loading path of every worker. Raises :class:`ChecksumError` like
        :meth:`fetch` (nothing is loaded then)."""
        engines = engines if isinstance(engines, (list, tuple)) else [engines]
        v = self.newer_version() if version is None else version
        if v is None:
            return None
        tensors = self.fetch(v)
        if tensors is None:
            return None
        tl = time.perf_counter()
        try:
            if len(engines) > 1:
                tensors = list(tensors)  # several consumers of one pass
            for engine in engines:
                engine.load_weights(tensors)
        finally:
            del tensors  # the engines copied them: free the views and with them the store lease
        self.timings["weights/load_s"] = time.perf_counter() - tl
        self.mark_loaded(worker_id, v)
        return v

    def mark_loaded(self, worker_id: int, version: int) -> None:
        """Record ``version`` as loaded, ack it in Redis and store this fetch's timings."""
        self.loaded_version = version
        if self.timings:
            self.coord.put_weight_timings(worker_id, {**self.timings, "weights/version": version})
        self.coord.ack(worker_id, version)

    def _unpin_frames(self) -> None:
        # Unregister before the frames can be freed: a freed, still-registered range would
        # make a later registration of reused memory fail.
        for buf in self._pinned_frames:
            pinning.unregister(buf)
        self._pinned_frames = []

    def close(self) -> None:
        self._unpin_frames()
        self._readers.close()
        self._devices.close()
        if self._client is not None:
            self._client.close()
        if self._receiver is not None:
            self._receiver.close()
