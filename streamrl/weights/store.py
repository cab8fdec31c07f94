"""Host-side store of published versions: one file per version under ``/dev/shm``.

The publisher writes each version once, bucket by bucket, straight into a shared mapping of
its own file, and never rewrites it; so a subscriber on the same host can map the file and
read a bucket as soon as Redis says it is ready (x86 and the Redis round trip order the
writes before the announcement), and the ZeroMQ server sends buckets from the same pages
without another copy. When a version is garbage-collected its file is renamed to a spare
and reused for the next version (its pages are already allocated and mapped: fresh tmpfs
pages cost one fault per 4 KiB), but only when no subscriber holds a read
lease on it (:mod:`streamrl.weights.lease`): a leased file is kept (``ShmStore.retained``)
and recycled at a later GC, so bytes a subscriber verified never change under its engine.
A file's name is never given twice: a new file is named by its version (``-vN.bin``), a
recycled one by the version that freed it (``-rN.bin``), and it keeps that name for the
version it holds next (the manifest names the path), so taking a spare costs no rename.

A subscriber keeps its read-only mappings in a :class:`ReaderCache` keyed by inode: a
recycled file keeps its inode, so the next fetch of that file reuses the mapping (no new
``mmap`` + ``MAP_POPULATE`` of every page, no new CUDA registration) and reads the current
bytes through it.

Shared-memory pages count as ``RssShmem``, not as the publisher's anonymous memory: the
store is the data plane's buffer (one per kept version), not a second model copy in the
learner.
"""
from __future__ import annotations

import logging
import mmap
from collections import deque
import os
import warnings
from pathlib import Path

import torch

from streamrl.weights import lease, pinning

log = logging.getLogger(__name__)


def shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


class VersionFile:
    """A writable (publisher) or read-only (subscriber) mapping of one version's bytes.

    ``buf`` is a uint8 tensor [total_bytes] over the mapping.
    """

    def __init__(self, path: Path, total: int, writable: bool, fd: int | None = None):
        """``fd``: an open read-only descriptor of ``path`` to map (the caller keeps it)."""
        self.path = path
        self.total = total
        self.pinned = self._pin_failed = False
        size = max(total, 1)
        if writable:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)
                self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
            finally:
                os.close(fd)
        else:
            own = fd is None
            fd = os.open(path, os.O_RDONLY) if own else fd
            try:
                got = os.fstat(fd).st_size
                if got < total:
                    raise FileNotFoundError(f"{path} holds {got} of {total} bytes")
                # MAP_POPULATE maps every page in one call instead of one fault per 4 KiB.
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                self._mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
            finally:
                if own:
                    os.close(fd)
        # torch warns that a read-only buffer is not writable; views are documented read-only.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.buf = torch.frombuffer(self._mm, dtype=torch.uint8, count=size)[:total]

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buf[offset: offset + nbytes]

    def memoryview(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self._mm)[offset: offset + nbytes]

    def leased(self, fd: int) -> torch.Tensor:
        """uint8 [total] over this mapping that holds the read lease ``fd`` until its last
        view is freed (:func:`streamrl.weights.lease.leased_buffer`)."""
        return lease.leased_buffer(self._mm, self.total, fd)

    def pin(self, read_only: bool) -> bool:
        """Page-lock the mapping for CUDA copies (once; see :mod:`streamrl.weights.pinning`)."""
        if not self.pinned and not self._pin_failed:
            self.pinned = pinning.register(self.buf, read_only=read_only)
            self._pin_failed = not self.pinned  # tried once: stay pageable, warn once
        return self.pinned

    def unpin(self) -> None:
        if self.pinned:
            pinning.unregister(self.buf)
            self.pinned = False


class ShmStore:
    """Publisher-side files of the newest ``keep`` versions of run ``run``.

    A collected version's file is recycled only under an exclusive ``flock``
    (:mod:`streamrl.weights.lease`): while a subscriber holds a read lease on it, it moves to
    :attr:`retained` and is retried at every :meth:`gc`. At most ``max_retained`` files are
    kept that way; beyond that the oldest is unlinked instead (its bytes stay intact for the
    readers mapping it and are freed when they let go). Freed files wait as spares for the next
    versions; retained files and spares together stay within ``max_retained + 1``, so the store
    holds at most ``keep + max_retained + 1`` files.
    """

    def __init__(self, run: str, keep: int = 3, directory: Path | None = None, max_retained: int = 4):
        if keep < 1:
            raise ValueError(f"weights keep_versions = {keep}: must be >= 1")
        if max_retained < 0:
            raise ValueError(f"shm store max_retained = {max_retained}: must be >= 0")
        self.run = run
        self.keep, self.max_retained = keep, max_retained
        self.dir = directory or shm_dir()
        self.files: dict[int, VersionFile] = {}
        self.retained: dict[int, VersionFile] = {}  # collected, but a reader still holds a lease
        self.collected: deque[int] = deque(maxlen=1024)  # versions whose files were retired, in order
        self._warned: set[int] = set()  # retained versions already logged
        # Freed files, oldest first. More than one: a version leased at its GC is freed at the
        # next GC together with the version after it; with a single spare, every other version
        # would get a fresh file, whose pages must all be faulted in and page-locked: several
        # times the cost of the publish itself.
        self._spares: list[VersionFile] = []

    def path(self, version: int) -> Path:
        """The name of a new file for ``version`` (a recycled one keeps its spare's name)."""
        return self.dir / f"streamrl-{self.run}-v{version}.bin"

    def create(self, version: int, total: int) -> VersionFile:
        """A mapped file for ``version``; recycles a collected version's file of the same size,
        whose pages are already allocated and mapped (fresh tmpfs pages cost a fault each), under
        the name it got when it was freed (no reader has a manifest naming it)."""
        spare = next((f for f in reversed(self._spares) if f.total == total), None)
        if spare is not None:
            self._spares.remove(spare)
            vf = spare
        else:
            while self._spares:  # another size: the model changed, none will fit again
                self._unlink(self._spares.pop())
            # A stale file of this name (an earlier incarnation of the run) may still be mapped
            # by a reader: unlink it rather than truncate it under that reader.
            path = self.path(version)
            path.unlink(missing_ok=True)
            vf = VersionFile(path, total, writable=True)
        self.files[version] = vf
        return vf

    def drop(self, versions: list[int], recycle: bool = True) -> None:
        """Retire the files of ``versions``. ``recycle``: each becomes a spare for a later
        :meth:`create` once no reader leases it (renamed, so no reader can open it by its old
        name). Otherwise unlinked at once, which leaves the bytes intact for any reader still
        mapping them."""
        for v in sorted(versions):
            vf = self.files.pop(v, None)
            if vf is None:
                continue
            if recycle:
                self.retained[v] = vf
            else:
                self._unlink(vf)
                self.collected.append(v)
        if recycle:
            self._collect()

    def gc(self) -> list[int]:
        """Retire all but the newest ``keep`` versions (and retry the retained ones); returns
        the versions that left :attr:`files` now."""
        old = sorted(self.files)[:-self.keep]
        self.drop(old)
        return old

    def _collect(self) -> None:
        for v in sorted(self.retained):
            vf = self.retained[v]
            try:
                fd = lease.try_exclusive(vf.path)
            except FileNotFoundError:  # removed behind our back: nothing left to recycle
                self._forget(v)
                continue
            if fd is None:
                if v not in self._warned:
                    self._warned.add(v)
                    log.warning("weights v%d is still being read by a subscriber: keeping its file "
                                "(%d kept beyond keep_versions=%d)", v, len(self.retained), self.keep)
                continue
            try:
                spare_path = self.dir / f"streamrl-{self.run}-r{v}.bin"  # a name no manifest holds
                os.rename(vf.path, spare_path)  # under the exclusive lock: see streamrl.weights.lease
                vf.path = spare_path
                self._spares.append(vf)
            finally:
                os.close(fd)
            del self.retained[v]
            self._warned.discard(v)
            self.collected.append(v)
        while len(self.retained) > self.max_retained:
            v = min(self.retained)
            log.warning("weights v%d: more than max_retained=%d files are leased; unlinking it (its "
                        "readers keep their bytes, freed when they let go)", v, self.max_retained)
            self._forget(v)
        while self._spares and len(self._spares) + len(self.retained) > self.max_retained + 1:
            self._unlink(self._spares.pop(0))

    def _forget(self, v: int) -> None:
        self._unlink(self.retained.pop(v))
        self._warned.discard(v)
        self.collected.append(v)

    @staticmethod
    def _unlink(vf: VersionFile) -> None:
        vf.unpin()
        vf.path.unlink(missing_ok=True)

    def close(self) -> None:
        self.drop(list(self.files), recycle=False)
        for v in list(self.retained):
            self._forget(v)
        while self._spares:
            self._unlink(self._spares.pop())


class ReaderCache:
    """Subscriber-side read-only mappings of version files, reused across fetches.

    Keyed by ``(st_dev, st_ino)``: the publisher recycles a collected version's file by
    renaming it, so the same inode comes back under the next version's name with new bytes,
    which the cached shared mapping shows as they are written. While a mapping is cached its
    file stays allocated, so its inode number cannot be reused by another file. Entries whose
    file was unlinked (``st_nlink == 0``) are dropped at the next :meth:`open`, the oldest
    beyond ``capacity``.
    """

    def __init__(self, capacity: int = 4, pin_cuda: bool = False):
        if capacity < 1:
            raise ValueError(f"reader cache capacity = {capacity}: must be >= 1")
        self.capacity, self.pin_cuda = capacity, pin_cuda
        self._files: dict[tuple[int, int], tuple[int, VersionFile]] = {}  # key -> (fd, mapping)

    def open(self, path: str | Path, total: int, expect: tuple[int, int] | None = None) -> VersionFile:
        """A mapping of ``path`` covering ``total`` bytes; raises FileNotFoundError if the file
        is gone, shorter than ``total`` (a version being recycled) or, with ``expect``, not the
        file ``(st_dev, st_ino)`` (the one a read lease was taken on)."""
        fd = os.open(path, os.O_RDONLY)
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        if expect is not None and key != expect:
            os.close(fd)
            raise FileNotFoundError(f"{path} is no longer the leased file")
        hit = self._files.pop(key, None)
        if hit is not None and hit[1].total == total:
            os.close(fd)
            self._files[key] = hit  # most recently used last
            hit[1].path = Path(path)
            return hit[1]
        if hit is not None:
            self._release(*hit)
        try:
            vf = VersionFile(Path(path), total, writable=False, fd=fd)
        except BaseException:
            os.close(fd)
            raise
        if self.pin_cuda:
            vf.pin(read_only=True)
        self._files[key] = (fd, vf)  # the open descriptor keeps st_nlink observable
        self._evict()
        return vf

    def _evict(self) -> None:
        for key, (fd, vf) in list(self._files.items()):
            if os.fstat(fd).st_nlink == 0:
                self._release(*self._files.pop(key))
        while len(self._files) > self.capacity:
            self._release(*self._files.pop(next(iter(self._files))))

    @staticmethod
    def _release(fd: int, vf: VersionFile) -> None:
        vf.unpin()
        os.close(fd)

    def close(self) -> None:
        for fd, vf in self._files.values():
            self._release(fd, vf)
        self._files.clear()
