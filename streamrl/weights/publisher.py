"""Learner side: gather, rename, bucket, checksum and announce one weights version.

``publish(version, specs, tensors)`` consumes the learner's full tensors lazily, in
``specs`` order (each ``next()`` may run a collective gather on every rank), converts each
to the engine's names/layout (:mod:`streamrl.weights.adapter`), and writes it into the
data plane bucket by bucket. As soon as a bucket is complete its checksum goes to Redis,
so subscribers start transferring and verifying while later buckets are still gathered;
the version becomes *current* only when every bucket is in. Extra learner memory is one
full tensor from the gather (plus, for GPU tensors the store cannot take by DMA, one
bucket-sized pinned bounce buffer; or one bucket on the GPU for the collective plane):
never a second model copy. GPU tensors are copied straight into the page-locked store
(:mod:`streamrl.weights.pinning`), asynchronously with one wait per bucket, and checksummed
on the GPU: no host pass over the bytes.

Small contiguous CPU tensors (under ``SMALL`` bytes) are packed into a host store: each is one
``memmove``, and a run of them is checksummed once, so such a version costs about its bytes, not
a torch op per tensor. A LoRA version goes further: the learner hands its hundreds of adapters as
one packed tensor (:class:`~streamrl.weights.layout.PackedSpec`, one manifest entry) whose pieces
are concatenated straight into the store by one op. A version of one
bucket is announced once, complete, in one Redis command (a Lua script): a streaming subscriber
could not read any of it before its only bucket is in anyway. Successive versions of the same
specs reuse one layout plan, and their manifests name its tensor table, stored in Redis once by
its digest (:mod:`streamrl.weights.manifest`), instead of carrying it.

Data planes (``plane``):

* ``shm``: the store file under /dev/shm; same-host subscribers map it (under a read lease,
  so a file is never recycled while a subscriber's engine may still read it).
* ``zmq``: the same store, served by a :class:`BucketServer` to subscribers anywhere.
  ``auto`` and ``shm`` also run the server, so any subscriber can pick by host.
* ``nccl`` / ``gloo``: broadcast of bucket buffers in a fixed group of the publisher and
  ``collective_world - 1`` subscribers (:mod:`streamrl.weights.collective`).
* ``ipc``: device buffers shared with CUDA IPC; subscribers on GPUs of this host copy device
  to device (:mod:`streamrl.weights.ipc`; one version's bytes of extra GPU memory per buffer).
"""
from __future__ import annotations

import ctypes
import math
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

import torch

from streamrl.coord.coordinator import Coordinator
from streamrl.weights.adapter import adapt_specs, adapt_tensor
from streamrl.weights.collective import CollectiveSender
from streamrl.weights.ipc import CopyPlan, DeviceStore, copy_bucket
from streamrl.transport.codec import DTYPES
from streamrl.weights.layout import CHUNK, Checksum, Layout, ResidentTensors, sum64_digest, write_tensor
from streamrl.weights.manifest import ManifestJSON
from streamrl.weights.store import ShmStore
from streamrl.weights.zmq_plane import BucketServer

COLLECTIVE_PLANES = ("nccl", "gloo")
PLANES = ("auto", "shm", "zmq", "ipc", *COLLECTIVE_PLANES)
# CPU tensors below this are packed (see above); a packed run is checksummed at this size, so
# the checksum reads bytes that are still in the cache, like write_tensor's chunks.
SMALL = CHUNK


def host_id() -> str:
    """Identifies this host for same-host detection (hostname + boot id)."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class WeightPublisher:
    """Publishes versions of the learner's weights (run it on the publishing rank only)."""

    def __init__(self, coord: Coordinator, run: str, plane: str = "auto", bucket_bytes: int = 64 << 20,
                 keep: int = 3, checksum: str = "sum64", target: str = "hf", bind_host: str = "127.0.0.1",
                 advertise_host: str | None = None, collective_world: int = 0, device: str | None = None,
                 pin_store: bool = True, max_retained: int = 4, ipc_buffers: int = 1):
        """``keep``: versions kept in Redis and the store; ``max_retained``: collected versions
        whose files are kept beyond that while subscribers still read them (read leases);
        ``ipc_buffers``: the ipc plane's device buffers (``weights.ipc_buffers``)."""
        if plane not in PLANES:
            raise ValueError(f"weights data_plane {plane!r} is unknown; choose one of {PLANES}")
        Checksum(checksum)  # validates the algo name
        self.coord, self.run, self.plane = coord, run, plane
        self.bucket_bytes, self.keep, self.checksum, self.target = bucket_bytes, keep, checksum, target
        self.pin_store = pin_store  # page-lock store files for GPU tensors (DMA, GPU checksum)
        self.host = host_id()  # read once: a /proc read per version is a tenth of a LoRA version's publish
        self.store = self.server = self.collective = None
        self._bounce: torch.Tensor | None = None
        self._dma_streams: list[torch.cuda.Stream] = []  # streams with copies into the store in flight
        self._ready: dict[int, int] = {}  # version -> buckets ready (read by the server thread)
        self._buckets: dict[int, list[dict]] = {}
        self._plan: tuple[list, Layout] | None = None  # (specs, their layout) of the last version
        self._json = ManifestJSON()  # encodes and hashes the plan's tensor table once (stored once, by digest)
        # publish(background=True): one thread announces versions, in order, one at a time
        self._announcer: ThreadPoolExecutor | None = None
        self._announcing: Future | None = None  # the last version's announcement; its result: its seconds
        self._digests_host: torch.Tensor | None = None  # ipc: pinned int64 [buckets], the bucket sums read back
        if plane in COLLECTIVE_PLANES:
            self.collective = CollectiveSender(coord, plane, collective_world, bind_host, advertise_host, device)
        elif plane == "ipc":  # the store is device buffers, no server: subscribers map them
            self.store = DeviceStore(run, device, buffers=ipc_buffers)
        else:
            self.store = ShmStore(run, keep=keep, max_retained=max_retained)
            self.server = BucketServer(self._lookup, f"tcp://{bind_host}:*", advertise_host)

    def _lookup(self, version: int, index: int) -> memoryview | None:
        vf = self.store.files.get(version)
        ready = self._ready.get(version, 0)
        if vf is None or index >= ready:
            return None
        b = self._buckets[version][index]
        return vf.memoryview(b["offset"], b["nbytes"])

    def publish(self, version: int, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                tensors: Iterable[torch.Tensor | tuple[str, torch.Tensor]], background: bool = False
                ) -> dict[str, float]:
        """Write ``tensors`` (full learner tensors in ``specs`` order, produced lazily; items may
        be tensors or ``(name, tensor)``) and announce ``version``. The item of a
        :class:`~streamrl.weights.layout.PackedSpec` may also be a list of 1-d tensors (its
        pieces), concatenated straight into the store: the pack is never a tensor of its own.
        :class:`~streamrl.weights.layout.ResidentTensors` (the weights themselves, the same object
        every version) on the ipc plane in the background: the copies of the last version written
        into the same slot are queued again (:class:`~streamrl.weights.ipc.CopyPlan`), with no
        Python per tensor.

        ``background``: return once the version is written, or on the ipc plane once its copies
        are queued on the tensors' CUDA stream (work queued after them, such as the next optimizer
        step, runs after them: the caller may update its tensors in place at once); a thread then
        waits for them, reads the checksums and announces it. Versions are announced in order: a
        publish first waits for the previous announcement, and raises its error if it failed, as
        does :meth:`wait_announced`.

        Returns ``{"weights/gather_s", "weights/write_s", "weights/publish_s", "weights/bytes",
        "weights/buckets", "weights/peak_tensor_bytes", "weights/gpu_wait_s"}``; ``publish_s`` is
        the caller's time in this call; ``gpu_wait_s`` (part of ``write_s``) is the wait, before the
        first GPU tensor is copied, for the work already queued on its stream (the tail of the
        learner's step), not the copy itself (0 on the ipc plane in the background: nothing
        waits). In the background, ``"weights/announce_s"`` is the previous version's announcement
        (queued to announced), when there was one.
        """
        t0 = time.perf_counter()
        announced_s = self.wait_announced()
        self.coord.wake_for_publish()  # Redis wakes while the version is written
        # ipc in the background: the copies queue behind the step on its stream; no host wait
        queued = background and isinstance(self.store, DeviceStore)
        layout = self._layout(specs)
        manifest, vf = self._begin(version, layout)
        writer = _BucketWriter(self, version, layout, vf, record=isinstance(tensors, ResidentTensors))
        plan = getattr(vf, "plan", None)  # a device slot's copies of the last version written into it
        if queued and plan is not None and plan.sources is tensors and plan.layout is self._plan[1]:
            # the same tensors into the same slot: their copies again, no Python per tensor
            tw = time.perf_counter()
            writer.replay(plan.buckets)
            gather_s, write_s, gpu_wait_s, peak = 0.0, time.perf_counter() - tw, 0.0, plan.peak
        else:
            gather_s, write_s, gpu_wait_s, peak = self._put_all(writer, specs, tensors, queued)
        read_digests = writer.finish(queued)
        if writer.recorded is not None:
            vf.plan = CopyPlan(tensors, self._plan[1], writer.recorded, peak)

        def announce() -> float:
            t = time.perf_counter()
            read_digests()  # ipc in the background: waits for the version's copies here
            manifest["state"] = "complete"
            manifest["buckets"] = layout.buckets
            encoded, table = self._json.encode(manifest)
            # the store's GC (file renames) runs while Redis runs the announcement
            self.coord.publish_version(version, manifest, keep=self.keep, encoded=encoded, table=table,
                                       meanwhile=self.collect)
            return time.perf_counter() - t

        out = {"weights/gather_s": gather_s, "weights/write_s": write_s, "weights/bytes": float(layout.total_bytes),
               "weights/buckets": float(len(layout.buckets)), "weights/peak_tensor_bytes": float(peak),
               "weights/gpu_wait_s": gpu_wait_s}
        if background:
            if self._announcer is None:
                self._announcer = ThreadPoolExecutor(1, thread_name_prefix="weights-announce")
            self._announcing = self._announcer.submit(announce)
            if announced_s is not None:
                out["weights/announce_s"] = announced_s
        else:
            announce()
        out["weights/publish_s"] = time.perf_counter() - t0
        return out

    def _put_all(self, writer: _BucketWriter, specs: list, tensors: Iterable, queued: bool
                 ) -> tuple[float, float, float, int]:
        """Take each tensor (lazily: a gather each) and put it. Returns (gather_s, write_s,
        gpu_wait_s, peak tensor bytes), as :meth:`publish` reports them."""
        gather_s = write_s = gpu_wait_s = 0.0
        waited = False
        peak = 0
        it = iter(tensors)
        for name, dtype, shape in specs:
            tg = time.perf_counter()
            item = next(it)
            t = item[1] if isinstance(item, tuple) else item
            tw = time.perf_counter()
            gather_s += tw - tg
            packed = isinstance(t, list)  # a PackedSpec's pieces
            lead = (t[0] if t else None) if packed else t
            peak = max(peak, math.prod(shape) * dtype.itemsize if packed else t.nbytes)  # put_packed checks it
            if lead is not None and lead.is_cuda and not waited and not queued:
                torch.cuda.current_stream(lead.device).synchronize()
                gpu_wait_s, waited = time.perf_counter() - tw, True
            if packed:
                writer.put_packed(name, t)
            else:
                for ename, piece in adapt_tensor(name, t, self.target):
                    writer.put(ename, piece)
            del t, item, lead
            write_s += time.perf_counter() - tw
        return gather_s, write_s, gpu_wait_s, peak

    def wait_announced(self) -> float | None:
        """Wait for the last background announcement; its seconds (None when there was none).
        Raises what it raised (the version was not announced; the next publish supersedes it)."""
        pending, self._announcing = self._announcing, None
        return pending.result() if pending is not None else None

    def _layout(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> Layout:
        """The layout of a version of ``specs``. A run publishes the same specs every version, so
        the last plan is reused (a LoRA version has hundreds of tensors), with fresh bucket
        entries: each version's buckets get their own checksums."""
        if self._plan is None or self._plan[0] != specs:
            self._plan = (list(specs), Layout.plan(adapt_specs(specs, self.target), self.bucket_bytes))
        plan = self._plan[1]
        return Layout(plan.tensors, [dict(b) for b in plan.buckets], plan.total_bytes)

    def _begin(self, version: int, layout: Layout) -> tuple[dict[str, Any], Any]:
        """Announce ``version`` as being written: its manifest, and its store file (None on a
        collective plane, whose receivers are told how many buckets follow)."""
        manifest: dict[str, Any] = {
            "version": version, "state": "writing", "plane": self.plane, "target": self.target,
            "checksum": self.checksum, "total_bytes": layout.total_bytes, "host": self.host,
            "tensors": layout.tensors, "buckets": layout.buckets, "published_at": time.time(),
        }
        vf = None
        if self.store is not None:
            vf = self.store.create(version, layout.total_bytes)
            self._ready[version], self._buckets[version] = 0, layout.buckets
            manifest["path"] = str(vf.path)  # ipc: the version's lease file
            if self.server is not None:
                manifest["endpoint"] = self.server.endpoint
            else:
                manifest["ipc"] = vf.record  # the device buffer's CUDA IPC handle, plain fields
        else:
            manifest["collective"] = self.collective.describe()
        if self._streamed(layout):
            self.coord.begin_version(version, manifest)
        if self.collective is not None:
            self.collective.begin(version, len(layout.buckets))
        return manifest, vf

    def _streamed(self, layout: Layout) -> bool:
        """Whether ``version`` is announced while being written, bucket by bucket. A store
        version of one bucket is not: nothing of it is readable before it is complete, so the
        two announcements (manifest, bucket event) would only add Redis round trips. Nor is an
        ipc version: its whole copy takes less than one bucket's Redis round trip. Collective
        receivers always follow the bucket events."""
        return self.store is None or (len(layout.buckets) > 1 and not isinstance(self.store, DeviceStore))

    def _write(self, vf, dst: torch.Tensor, src: torch.Tensor, ck: Checksum) -> None:
        """Copy one engine tensor into the store region ``dst`` (uint8 [padded nbytes]).

        CPU tensors: chunked copy + checksum (:func:`write_tensor`). GPU tensors: one DMA
        straight into the page-locked store, checksummed on the GPU, so the host makes no pass
        over the bytes at all; where the store cannot be page-locked, or the checksum needs
        the host (crc32, a size not a multiple of 8 bytes), through a pinned bounce buffer.
        """
        if src.device.type == "cpu":
            write_tensor(dst, src, ck)
            return
        flat = src.reshape(-1).view(torch.uint8)
        n = flat.numel()
        if (self.pin_store and ck.algo == "sum64" and n % 8 == 0 and flat.data_ptr() % 8 == 0
                and vf.pin(read_only=False)):
            # Asynchronous: the DMA queues behind the kernels that made ``src`` on its stream, so the
            # host goes on to the next tensor (gather, layout change) while the bytes move; the
            # caching allocator reuses ``src``'s memory only for later work on the same stream.
            # _finish_dma waits once per bucket instead of once per tensor.
            dst[:n].copy_(flat, non_blocking=True)
            stream = torch.cuda.current_stream(flat.device)
            if stream not in self._dma_streams:
                self._dma_streams.append(stream)
            dst[n:].zero_()  # padding of a recycled file holds old bytes; zeros add nothing to sum64
            ck.update(flat)
            return
        size = min(self.bucket_bytes, max(n, 8)) // 8 * 8 or 8
        if self._bounce is None or self._bounce.numel() < size:
            self._bounce = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        for start in range(0, n, size):
            stop = min(start + size, n)
            bounce = self._bounce[: stop - start]
            bounce.copy_(flat[start:stop])
            hi = stop if stop < n else dst.numel()  # the last piece takes the zero padding
            write_tensor(dst[start:hi], bounce, ck)

    def _finish_dma(self) -> None:
        """Wait until every queued device-to-store copy has landed."""
        for stream in self._dma_streams:
            stream.synchronize()
        self._dma_streams.clear()

    def collect(self) -> list[int]:
        """Garbage-collect store files beyond ``keep`` (done after every publish); files that
        subscribers still lease are retried here. Returns the versions retired now."""
        if self.store is None:
            return []
        old = self.store.gc()
        for v in old:  # out of the store's live files: the bucket server no longer serves them
            self._ready.pop(v, None)
            self._buckets.pop(v, None)
        return old

    def stats(self) -> dict[str, float]:
        return {"weights/served_bytes": float(self.server.served_bytes if self.server else 0),
                "weights/retained_versions": float(len(self.store.retained) if self.store else 0)}

    def close(self) -> None:
        try:
            self.wait_announced()  # the last version is announced before the store goes
        finally:
            if self._announcer is not None:
                self._announcer.shutdown()
            self._close()

    def _close(self) -> None:
        self._finish_dma()  # a publish that raised may have left copies into the store in flight
        if self.server is not None:
            self.server.close()
        if self.store is not None:
            self.store.close()
        if self.collective is not None:
            self.collective.close()


class _BucketWriter:
    """Puts one version's engine tensors, in layout order, into their buckets; a bucket whose
    last tensor is in is checksummed, sent (collective plane) or made servable (store), and
    announced in Redis (streamed versions)."""

    def __init__(self, pub: WeightPublisher, version: int, layout: Layout, vf, record: bool = False):
        """``record``: the tensors are :class:`ResidentTensors`; on the ipc plane each bucket's
        copies are kept in ``recorded`` (None when any copy reads a temporary instead)."""
        self.pub, self.version, self.layout, self.vf = pub, version, layout, vf
        self.announce = pub._streamed(layout)
        self.entry_i = self.bucket_i = 0
        self.ck = Checksum(pub.checksum)
        self.pieces: list[tuple[dict, torch.Tensor]] = []  # collective plane: the open bucket's tensors
        # address of a host store's mapping (0: none to pack into, e.g. the ipc plane's device buffer)
        self.base = vf.buf.data_ptr() if vf is not None and vf.buf.is_cpu else 0
        self.run: list[int] = []  # [start, end) of the packed run not checksummed yet; [] when none
        # ipc plane (a device buffer): the open bucket's (dst, src) byte views, copied and checksummed
        # together when it closes (:func:`copy_bucket`), and closed buckets whose digests are read
        # once, after the version's last copy (one GPU sync per version)
        self.device = vf is not None and vf.buf.is_cuda
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.unread: list[tuple[dict, Checksum]] = []
        self.recorded: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = [] if record and self.device else None

    def put(self, ename: str, piece: torch.Tensor) -> None:
        e = self.layout.tensors[self.entry_i]
        if e["name"] != ename or list(piece.shape) != e["shape"]:
            raise ValueError(f"tensor {ename} {tuple(piece.shape)} does not match its spec "
                             f"{e['name']} {e['shape']}")
        if self.vf is None:
            self.pieces.append((e, piece))
        elif self.device:
            if not piece.is_contiguous():  # its copy would read a temporary: nothing to replay
                self.recorded = None
            if e["nbytes"]:
                self.copies.append((self.vf.region(e["offset"], e["nbytes"]),
                                    piece.contiguous().reshape(-1).view(torch.uint8)))
        elif (self.base and e["nbytes"] < SMALL and piece.is_cpu and piece.is_contiguous()
              and piece.nbytes == e["nbytes"]):
            self._put_small(e, piece)
        else:
            self._checksum_run()  # the store's checksum reads it in layout order (crc32 is ordered)
            self.pub._write(self.vf, self.vf.region(e["offset"], _padded(e)), piece.contiguous(), self.ck)
        self._advance()

    def put_packed(self, ename: str, pieces: list[torch.Tensor]) -> None:
        """Put a packed tensor given as its 1-d ``pieces`` (in order, of its dtype). Into a host
        store: one ``memmove`` (one piece) or one ``torch.cat`` (a few hundred pieces, no
        per-piece Python) into its region and one checksum over it; elsewhere (GPU pieces, device
        buffer, collective plane) it is concatenated first and put like any tensor."""
        e = self.layout.tensors[self.entry_i]
        dtype = DTYPES[e["dtype"]]
        if e["name"] != ename or "parts" not in e or (pieces and pieces[0].dtype != dtype):
            raise ValueError(f"packed tensor {ename} of {pieces[0].dtype if pieces else '-'} does not match its "
                             f"spec {e['name']} {e['dtype']} (a packed one: {'parts' in e})")
        if not (self.base and pieces and pieces[0].is_cpu):
            self.recorded = None  # the copy reads the concatenation, a temporary
            packed = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype)
            self.put(ename, packed)  # checks the total
            return
        self._checksum_run()  # the store's checksum reads it in layout order (crc32 is ordered)
        region = self.vf.region(e["offset"], _padded(e))
        if len(pieces) == 1 and pieces[0].is_contiguous():
            # One piece (an unsharded learner's pack: the buffer its adapters live in): one
            # memmove, which writes the store's cold pages faster than a torch copy does. Its
            # size is checked first: memmove copies what it is told.
            piece = pieces[0]
            if piece.numel() * piece.element_size() != e["nbytes"]:
                raise ValueError(f"packed tensor {ename}: its pieces hold {piece.numel()} elements, "
                                 f"its spec {e['shape']}")
            ctypes.memmove(self.base + e["offset"], piece.data_ptr(), e["nbytes"])
        else:
            dst = region[: e["nbytes"]].view(dtype)
            n = dst.numel()
            torch.cat(pieces, out=dst)
            # A wrong total resizes ``dst`` (or fails to): checked after the copy, not by a sum over
            # hundreds of pieces, and raised before anything of the version is announced.
            if dst.numel() != n:
                raise ValueError(f"packed tensor {ename}: its pieces hold {dst.numel()} elements, "
                                 f"its spec {e['shape']}")
        self.ck.update(region)
        self._advance()

    def replay(self, buckets: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Queue every bucket's recorded copies (a :class:`CopyPlan`'s) and close the buckets: the
        version's tensors are all in, as if each had been put."""
        self.recorded = None
        for b, copies in zip(self.layout.buckets, buckets):
            self.copies = copies
            self._close_bucket(b)
        self.entry_i = len(self.layout.tensors)

    def _advance(self) -> None:
        """One engine tensor is in: close its bucket when it was the bucket's last."""
        self.entry_i += 1
        b = self.layout.buckets[self.bucket_i]
        if self.entry_i == b["first"] + b["count"]:
            self._checksum_run()
            self._close_bucket(b)

    def _put_small(self, e: dict, piece: torch.Tensor) -> None:
        """Copy a small contiguous CPU tensor into its region with one ``memmove`` (a torch op's
        dispatch costs more than copying a few KiB) and add its padded region to the packed run,
        whose checksum is taken once, over the whole run."""
        ctypes.memmove(self.base + e["offset"], piece.data_ptr(), e["nbytes"])
        end = e["offset"] + _padded(e)
        self.run = [self.run[0] if self.run else e["offset"], end]
        if end - self.run[0] >= SMALL:
            self._checksum_run()

    def _checksum_run(self) -> None:
        """Checksum the packed run (its tensors and their padding: the same bytes, in the same
        order, as tensor-by-tensor writes, so the same digest)."""
        if self.run:
            self.ck.update(self.vf.region(self.run[0], self.run[1] - self.run[0]))
            self.run = []

    def _close_bucket(self, b: dict) -> None:
        pub = self.pub
        if self.device:  # never announced bucket by bucket (see _streamed): digests read in finish()
            stream = copy_bucket(self.vf.region(b["offset"], b["nbytes"]), self.copies, self.ck)
            if stream not in pub._dma_streams:
                pub._dma_streams.append(stream)
            if self.recorded is not None:
                self.recorded.append(self.copies)
            self.copies = []
            self.unread.append((b, self.ck))
            self.ck = Checksum(pub.checksum)
            self.bucket_i += 1
            return
        pub._finish_dma()  # the bucket's bytes are in the store before it is announced
        if pub.collective is not None:
            b["checksum"] = pub.collective.send_bucket(b, self.pieces, pub.checksum)
            self.pieces = []
        else:
            b["checksum"] = self.ck.digest()
            pub._ready[self.version] = self.bucket_i + 1
        if self.announce:
            pub.coord.bucket_ready(self.version, self.bucket_i, b["checksum"])
        self.ck = Checksum(pub.checksum)
        self.bucket_i += 1

    def finish(self, queued: bool = False) -> Callable[[], None]:
        """Check every engine tensor came. Returns what sets the ipc plane's bucket checksums
        (buckets are servable from then): it waits for the copies. ``queued``: the bucket sums are
        copied to the host behind the copies now, so it waits for those copies alone, not for work
        queued on the stream after this call."""
        if self.entry_i != len(self.layout.tensors):
            raise ValueError(f"publish(v{self.version}) got {self.entry_i} of {len(self.layout.tensors)} "
                             f"engine tensors")
        unread, self.unread = self.unread, []
        if not unread:
            return lambda: None
        pub, ready = self.pub, self.bucket_i
        if not queued:
            def read() -> None:
                pub._finish_dma()
                for b, ck in unread:
                    b["checksum"] = ck.digest()
                pub._ready[self.version] = ready
            return read
        sums = torch.stack([ck.device_total() for _, ck in unread])  # int64 [buckets] on the GPU
        if pub._digests_host is None or pub._digests_host.numel() < len(unread):
            pub._digests_host = torch.empty(len(unread), dtype=torch.int64, pin_memory=True)
        host = pub._digests_host[: len(unread)]
        host.copy_(sums, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(sums.device))
        pub._dma_streams.clear()  # waited for through ``done``

        def read_queued() -> None:
            done.synchronize()
            for (b, _), total in zip(unread, host.tolist()):
                b["checksum"] = sum64_digest(total)
            pub._ready[self.version] = ready
        return read_queued


def _padded(entry: dict) -> int:
    return (entry["nbytes"] + 63) // 64 * 64
