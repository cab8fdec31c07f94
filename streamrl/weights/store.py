"""Host-side store of published versions: one file per version under ``/dev/shm``.

The publisher writes each version once, bucket by bucket, straight into a shared mapping of
its own file, and never rewrites it; so a subscriber on the same host can map the file and
read a bucket as soon as Redis says it is ready (x86 and the Redis round trip order the
writes before the announcement), and the ZeroMQ server sends buckets from the same pages
without another copy. When a version is garbage-collected its file is renamed to a spare
and reused for the next version (its pages are already allocated and mapped: fresh tmpfs
pages cost one fault per 4 KiB, ~0.25 s/GB here); a reader still mapping it would see new
bytes, fail the checksum, find the manifest gone and report the version as gone.

A subscriber keeps its read-only mappings in a :class:`ReaderCache` keyed by inode: a
recycled file keeps its inode, so the next fetch of that file reuses the mapping (no new
``mmap`` + ``MAP_POPULATE`` of every page, no new CUDA registration) and reads the current
bytes through it.

Shared-memory pages count as ``RssShmem``, not as the publisher's anonymous memory: the
store is the data plane's buffer (one per kept version), not a second model copy in the
learner.
"""
from __future__ import annotations

import mmap
import os
import warnings
from pathlib import Path

import torch

from streamrl.weights import pinning


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
    """Publisher-side files of the newest ``keep`` versions of run ``run``."""

    def __init__(self, run: str, keep: int = 3, directory: Path | None = None):
        if keep < 1:
            raise ValueError(f"weights keep_versions = {keep}: must be >= 1")
        self.run = run
        self.keep = keep
        self.dir = directory or shm_dir()
        self.files: dict[int, VersionFile] = {}
        self._spare: VersionFile | None = None

    def path(self, version: int) -> Path:
        return self.dir / f"streamrl-{self.run}-v{version}.bin"

    def create(self, version: int, total: int) -> VersionFile:
        """A mapped file for ``version``; recycles a collected version's file of the same size,
        whose pages are already allocated and mapped (fresh tmpfs pages cost a fault each)."""
        spare = self._spare
        self._spare = None
        if spare is not None and spare.total == total:
            path = self.path(version)
            os.rename(spare.path, path)  # same tmpfs: the pages and our mapping stay
            spare.path = path
            vf = spare
        else:
            if spare is not None:
                spare.unpin()
                spare.path.unlink(missing_ok=True)
            vf = VersionFile(self.path(version), total, writable=True)
        self.files[version] = vf
        return vf

    def drop(self, versions: list[int], recycle: bool = True) -> None:
        """Retire the files of ``versions``: the newest becomes the spare for the next
        :meth:`create` (renamed, so no reader can open it by its old name), others are
        unlinked; mappings die with their last reference."""
        for v in sorted(versions):
            vf = self.files.pop(v, None)
            if vf is None:
                continue
            if recycle:
                if self._spare is not None:
                    self._spare.path.unlink(missing_ok=True)
                spare_path = self.dir / f"streamrl-{self.run}-spare.bin"
                os.rename(vf.path, spare_path)
                vf.path = spare_path
                self._spare = vf
            else:
                vf.unpin()
                vf.path.unlink(missing_ok=True)

    def gc(self) -> list[int]:
        old = sorted(self.files)[:-self.keep]
        self.drop(old)
        return old

    def close(self) -> None:
        self.drop(list(self.files), recycle=False)
        if self._spare is not None:
            self._spare.unpin()
            self._spare.path.unlink(missing_ok=True)
            self._spare = None


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

    def open(self, path: str | Path, total: int) -> VersionFile:
        """A mapping of ``path`` covering ``total`` bytes; raises FileNotFoundError if the file
        is gone or shorter than ``total`` (a version being recycled)."""
        fd = os.open(path, os.O_RDONLY)
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
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
