"""CUDA IPC data plane (``weights.data_plane: ipc``): a version never leaves the GPU.

When the learner and the rollout workers are on GPUs of one host (colocated on one GPU, or GPUs
that reach each other), the publisher copies each bucket's engine tensors device to device into a
flat uint8 buffer at their layout offsets (:func:`copy_bucket`) and shares that buffer once through CUDA
IPC (torch's ``UntypedStorage._share_cuda_``, :func:`share`). The manifest in Redis carries the
handle as plain fields; a subscriber validates every field (:func:`parse_record`) before torch's
``rebuild_cuda_tensor`` opens the buffer (once per buffer, :class:`DeviceReader`), verifies each
bucket's sum64 on its GPU and hands the engine views of the buffer, which the engine copies
device to device into its weights. Nothing is pickled and no byte crosses the host.

Buffers (:class:`DeviceStore`, ``weights.ipc_buffers``): by default the publisher owns one buffer
sized for a version, so its extra GPU memory is one version's bytes (the largest version's, when
versions change size). The double buffer is that buffer and the worker's own weights: a worker
decodes with its weights while the next version lands in the publisher's buffer, and copies a
version out device to device when it loads it, holding its read lease until that copy is done
(its process synchronizes its GPU first: the copy and the decode steps queued before it, tens of
ms). Version v+1 takes the buffer once no reader leases v, so a learner that publishes faster than
a worker's poll and copy waits for it; a second buffer lets such a learner write v+1 while v is
read, for one more version of GPU memory. A reader that comes after v was retired finds it gone
and loads the next version once it is announced.

Leases (:class:`VersionSlots`) are the shared-memory store's (:mod:`streamrl.weights.lease`),
taken on an empty file per version under /dev/shm: a subscriber takes a shared ``flock`` on
version v's file before it touches v's slot; the publisher reuses a slot only under an exclusive
lock and unlinks v's file before letting go. So a reader either holds v's bytes, unchanged, for
as long as its lease lives, or finds v gone. While every buffer's version is leased the publisher waits
(at most ``LEASE_WAIT_S``: a reader holds a lease for one device-to-device copy, a dead reader's lease
ends with its process, and the launcher restarts a frozen one after ``deadlines.stuck_s``).

How long a lease lives: as long as any view a fetch handed out. The views alias the slot through
a small owner object (``__cuda_array_interface__``: torch keeps it referenced by the views'
storage); when the last view is freed the owner synchronizes the GPU the slot was opened on (the
engine's copies out of it run there, asynchronously) and only then closes the lease.
"""
from __future__ import annotations

import logging
import os
import re
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from streamrl.weights import lease
from streamrl.weights.layout import Checksum, Layout
from streamrl.weights.store import shm_dir

log = logging.getLogger(__name__)

LEASE_WAIT_S = 300.0  # the publisher's wait for a buffer while readers lease the versions in them
REF_COUNTER_SLOTS = 10000  # int64 counters in one torch ref-counter file (CUDA_IPC_REF_COUNTER_FILE_SIZE)
MAX_HANDLE_BYTES = 1 << 20  # a cudaMalloc handle is 66 bytes; an expandable segment's lists its pages
_SHM_NAME = re.compile(rb"/[A-Za-z0-9_.\-]{1,250}")
_UUID = re.compile(r"[0-9A-Za-z\-]{1,64}")


class IpcRecordError(ValueError):
    """A manifest's CUDA IPC record is malformed, or this process cannot open it."""


# -- the record: plain fields in the manifest ------------------------------------------------------
def share(buf: torch.Tensor) -> dict:
    """The CUDA IPC record of ``buf`` (a whole uint8 device buffer) as JSON-ready fields."""
    device, handle, size, offset, ref_counter, ref_offset, event, event_sync = buf.untyped_storage()._share_cuda_()
    return {"uuid": str(torch.cuda.get_device_properties(device).uuid), "handle": handle.hex(), "size": int(size),
            "offset": int(offset), "ref_counter": ref_counter.hex(), "ref_counter_offset": int(ref_offset),
            "event": event.hex(), "event_sync": bool(event_sync)}


def _int(rec: dict, key: str, hi: int) -> int:
    value = rec.get(key)
    if type(value) is not int or not 0 <= value <= hi:  # bool is an int subclass: refused too
        raise IpcRecordError(f"weights manifest: CUDA IPC field {key!r} = {value!r:.80}: expected an integer "
                             f"in [0, {hi}]")
    return value


def _bytes(rec: dict, key: str, lo: int, hi: int) -> bytes:
    value = rec.get(key)
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else None
    except ValueError:
        raw = None
    if raw is None or not lo <= len(raw) <= hi:
        raise IpcRecordError(f"weights manifest: CUDA IPC field {key!r} = {value!r:.80}: expected {lo}-{hi} bytes "
                             f"as hex")
    return raw


def parse_record(rec, total: int) -> dict:
    """A manifest's CUDA IPC record, validated and decoded for ``rebuild_cuda_tensor``.

    ``rec`` comes from Redis. Torch trusts these fields (an out-of-range ref-counter offset would
    make it write outside its counter file), so each is checked for type and range first.
    ``total``: the version's bytes, which the buffer must hold. Raises :class:`IpcRecordError`
    naming the field.
    """
    if not isinstance(rec, dict):
        raise IpcRecordError(f"weights manifest: CUDA IPC record {rec!r:.80} is not a mapping")
    out = {"size": _int(rec, "size", 1 << 48), "offset": _int(rec, "offset", 1 << 48),
           "ref_counter_offset": _int(rec, "ref_counter_offset", REF_COUNTER_SLOTS - 1),
           "handle": _bytes(rec, "handle", 1, MAX_HANDLE_BYTES), "ref_counter": _bytes(rec, "ref_counter", 2, 251),
           "event": _bytes(rec, "event", 64, 64)}
    if not _SHM_NAME.fullmatch(out["ref_counter"]):
        raise IpcRecordError(f"weights manifest: CUDA IPC field 'ref_counter' = {out['ref_counter']!r:.80}: "
                             f"expected a shared-memory name (/name)")
    for key, ok in (("event_sync", isinstance(rec.get("event_sync"), bool)),
                    ("uuid", isinstance(rec.get("uuid"), str) and _UUID.fullmatch(rec["uuid"]) is not None)):
        if not ok:
            raise IpcRecordError(f"weights manifest: CUDA IPC field {key!r} = {rec.get(key)!r:.80} is malformed")
    if out["size"] < total:
        raise IpcRecordError(f"weights manifest: CUDA IPC buffer of {out['size']} bytes cannot hold a version "
                             f"of {total} bytes")
    out["uuid"], out["event_sync"] = rec["uuid"], rec["event_sync"]
    return out


# -- publisher -------------------------------------------------------------------------------------
class VersionSlots:
    """Which version lives in which of ``n`` slots (buffers), each version guarded by its lease file."""

    def __init__(self, run: str, n: int = 1, directory: Path | None = None, wait_s: float = LEASE_WAIT_S):
        self.run, self.dir, self.wait_s = run, directory or shm_dir(), wait_s
        self.held: list[int | None] = [None] * n  # slot -> version
        self.retained: set[int] = set()  # versions due for reuse but leased at the last claim
        self._retired: list[int] = []  # versions given up since the last take_retired()

    def path(self, version: int) -> Path:
        return self.dir / f"streamrl-{self.run}-ipc-v{version}.lease"

    def claim(self, version: int) -> int:
        """The slot ``version`` goes to: an unused one, else the oldest version's that no reader
        leases (that version is retired). Waits while every slot's version is leased; TimeoutError after
        ``wait_s``. Creates ``version``'s lease file."""
        deadline = time.monotonic() + self.wait_s
        warned = False
        while (k := self._free()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"weights v{version}: the slots of v{sorted(self.retained)} stayed leased by "
                                   f"subscribers for {self.wait_s:g} s (a worker frozen while loading?)")
            if not warned:
                warned = True
                log.warning("weights v%d waits for a slot: subscribers still read v%s", version, sorted(self.retained))
            time.sleep(0.002)
        path = self.path(version)
        path.unlink(missing_ok=True)  # an earlier incarnation's file: its readers keep their lease on it
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        self.held[k] = version
        return k

    def _free(self) -> int | None:
        if None in self.held:
            return self.held.index(None)
        for v in sorted(self.held):
            if self._retire(v):
                self.retained.discard(v)
                return self.held.index(v)
            self.retained.add(v)
        return None

    def _retire(self, version: int) -> bool:
        """Give ``version`` up unless a reader leases it: its file is unlinked under the
        exclusive lock, so no reader can lease it afterwards (:mod:`streamrl.weights.lease`)."""
        path = self.path(version)
        try:
            fd = lease.try_exclusive(path)
        except FileNotFoundError:  # removed behind our back: no reader can lease it either
            fd = -1
        if fd is None:
            return False
        if fd >= 0:
            path.unlink()
            os.close(fd)
        self._retired.append(version)
        return True

    def take_retired(self) -> list[int]:
        out, self._retired = self._retired, []
        return out

    def close(self) -> None:
        for v in self.held:
            if v is not None:
                self.path(v).unlink(missing_ok=True)
        self.held = [None] * len(self.held)


@dataclass
class CopyPlan:
    """The copies that wrote a version of :class:`~streamrl.weights.layout.ResidentTensors` into a
    slot, kept to be queued again for the next version of the same tensors into the same slot:
    a version is then one ``_foreach_copy_`` and one sum per bucket, with no Python per tensor.

    ``sources``: the tensors (their identity is the key); ``layout``: the publisher's layout plan
    they were written by (its identity too); ``buckets``: per bucket, its (dst, src) uint8 views
    as :func:`copy_bucket` takes them, dst in the slot and src aliasing a source; ``peak``: the
    largest tensor's bytes.
    """

    sources: list
    layout: Layout
    buckets: list[list[tuple[torch.Tensor, torch.Tensor]]]
    peak: int


class DeviceSlot:
    """One shared device buffer: ``buf`` uint8 [capacity] on the learner's GPU, its IPC
    ``record`` (made once), ``path``, the lease file of the version it holds, and ``plan``, the
    copies that wrote it when they can be replayed (:class:`CopyPlan`)."""

    def __init__(self, capacity: int, device: torch.device):
        self.buf = torch.empty(max(capacity, 8), dtype=torch.uint8, device=device)
        self.record = share(self.buf)
        self.path: Path | None = None
        self.plan: CopyPlan | None = None

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buf[offset: offset + nbytes]


class DeviceStore:
    """Publisher side: the newest versions in ``buffers`` :class:`DeviceSlot` s on ``device``.

    The surface :class:`~streamrl.weights.publisher.WeightPublisher` uses of a store:
    ``create``, ``files`` (version -> slot), ``retained``, ``gc`` and ``close``. Extra GPU memory:
    ``buffers`` buffers, each as large as the largest version put into it.
    """

    def __init__(self, run: str, device: str | None = None, wait_s: float = LEASE_WAIT_S,
                 directory: Path | None = None, buffers: int = 1):
        if not torch.cuda.is_available():
            raise ValueError("weights data_plane 'ipc' needs a CUDA device (torch.cuda.is_available() is False)")
        self.device = torch.device(device) if device else torch.device("cuda", torch.cuda.current_device())
        if self.device.type != "cuda":
            raise ValueError(f"weights data_plane 'ipc' needs a CUDA device, not {device!r}")
        self.slots = VersionSlots(run, buffers, directory, wait_s)
        self._bufs: list[DeviceSlot | None] = [None] * buffers
        self.files: dict[int, DeviceSlot] = {}

    @property
    def retained(self) -> set[int]:
        """Versions whose slot was due for reuse but still leased at the last publish."""
        return self.slots.retained

    @property
    def nbytes(self) -> int:
        """GPU bytes the store's buffers hold (its extra GPU memory between versions)."""
        return sum(s.buf.numel() for s in self._bufs if s is not None)

    def create(self, version: int, total: int) -> DeviceSlot:
        """The slot ``version``'s ``total`` bytes go to (waits while readers lease every slot's version)."""
        k = self.slots.claim(version)
        slot = self._bufs[k]
        self.files = {v: s for v, s in self.files.items() if s is not slot}  # the version it held is retired
        if slot is None or slot.buf.numel() < total:
            self._bufs[k] = slot = None  # free the smaller buffer before allocating its successor
            slot = self._bufs[k] = DeviceSlot(total, self.device)
        slot.path = self.slots.path(version)
        self.files[version] = slot
        return slot

    def gc(self) -> list[int]:
        """The versions retired since the last call (their slots were reused)."""
        return self.slots.take_retired()

    def close(self) -> None:
        self.slots.close()
        self.files.clear()
        self._bufs = [None] * len(self._bufs)


def copy_bucket(region: torch.Tensor, copies: list[tuple[torch.Tensor, torch.Tensor]],
                ck: Checksum) -> torch.cuda.Stream:
    """Copy one bucket's engine tensors into their slot regions and checksum the bucket.

    ``region``: uint8 [bucket nbytes], the bucket's bytes in the slot; ``copies``: (dst, src)
    pairs, dst a uint8 [nbytes] view of ``region`` and src the tensor's bytes (contiguous uint8
    [nbytes], any device). One ``_foreach_copy_`` moves them all and one sum64 covers the whole
    bucket, padding included (a reused slot's old padding needs no clearing: the subscriber sums
    the same bytes), so a bucket costs a few kernel launches, not three per tensor: a version is
    a few hundred tensors, and per-tensor launches, not bytes, bound a device-to-device publish.

    Asynchronous: returns the stream to synchronize before the bucket's checksum is read.
    """
    if copies:
        dsts, srcs = zip(*copies)
        torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)
    ck.update(region)
    return torch.cuda.current_stream(region.device)


# -- subscriber ------------------------------------------------------------------------------------
class DeviceReader:
    """Subscriber side: opens versions whose manifest plane is ``ipc``. Each publisher buffer is
    opened once and kept (the ``capacity`` most recently used: a publisher has one or two)."""

    def __init__(self, capacity: int = 2):
        self.capacity = capacity
        self._bases: dict[tuple[bytes, int], torch.Tensor] = {}  # (handle, offset) -> uint8 [size] on a GPU

    def open(self, manifest: dict, host: str) -> torch.Tensor:
        """uint8 [total_bytes] on a GPU over the slot of the manifest's version, holding its read
        lease until the last view of it is freed. ``host``: this process's host id.

        Raises FileNotFoundError (:class:`~streamrl.weights.lease.LeaseGone`) when the version was
        retired, :class:`IpcRecordError` when the record is malformed or cannot be opened here.
        """
        version, total = manifest.get("version"), manifest["total_bytes"]
        rec = parse_record(manifest.get("ipc"), total)
        path = manifest.get("path")
        if not isinstance(path, str):
            raise IpcRecordError(f"weights v{version}: manifest field 'path' = {path!r:.80}: expected a lease file")
        if manifest.get("host") != host or not torch.cuda.is_available():
            raise IpcRecordError(f"weights v{version} are published over CUDA IPC on host {manifest.get('host')!r}; "
                                 f"this process (host {host!r}, CUDA available: {torch.cuda.is_available()}) cannot "
                                 f"map them: set weights.data_plane to auto or shm")
        fd, _ = lease.acquire_read(path)  # before touching the slot: see the module docstring
        try:
            base = self._base(rec, version)
        except BaseException:
            os.close(fd)
            raise
        return torch.as_tensor(_LeaseOwner(base[:total], fd), device=base.device)  # the owner now closes fd

    def _base(self, rec: dict, version) -> torch.Tensor:
        key = (rec["handle"], rec["offset"])
        base = self._bases.pop(key, None)
        if base is None:
            try:
                base = rebuild_cuda_tensor(torch.Tensor, (rec["size"],), (1,), 0, torch.UntypedStorage, torch.uint8,
                                           _local_device(rec["uuid"]), rec["handle"], rec["size"], rec["offset"],
                                           False, rec["ref_counter"], rec["ref_counter_offset"], rec["event"],
                                           rec["event_sync"])
            except RuntimeError as e:
                raise IpcRecordError(f"weights v{version}: cannot open its CUDA IPC handle here ({e}); the learner's "
                                     f"GPU must be this one or reach it (peer access), else set weights.data_plane "
                                     f"to shm") from e
        self._bases[key] = base  # most recently used last
        while len(self._bases) > self.capacity:
            self._bases.pop(next(iter(self._bases)))
        return base

    def close(self) -> None:
        self._bases.clear()


def _local_device(uuid: str) -> int:
    """This process's ordinal of the GPU ``uuid``. Ordinals differ between processes with other
    ``CUDA_VISIBLE_DEVICES``; a GPU hidden from this one is mapped through peer access from the
    current device."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return torch.cuda.current_device()


class _LeaseOwner:
    """Owns one fetch's read lease ``fd``; ``torch.as_tensor(owner)`` aliases ``buf`` (uint8 [n] on
    a GPU) and keeps the owner referenced from the alias's storage, so every view of the alias
    keeps the lease, and the last one freed ends it."""

    def __init__(self, buf: torch.Tensor, fd: int):
        self.buf = buf  # keeps the IPC mapping open while any view lives
        self.__cuda_array_interface__ = {"shape": (buf.numel(),), "typestr": "|u1", "strides": None,
                                         "data": (buf.data_ptr(), False), "version": 2}
        end = weakref.finalize(self, _end_lease, buf.device.index, fd)
        end.atexit = False  # at exit the process's descriptors close anyway


def _end_lease(device: int, fd: int) -> None:
    try:
        torch.cuda.synchronize(device)  # the engine's copies out of the slot, queued on this GPU, are done
    finally:
        os.close(fd)
