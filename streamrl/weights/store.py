"""Host-side store of published versions: one file per version under ``/dev/shm``.

The publisher writes each version once, bucket by bucket, straight into a shared mapping of
its own file, and never rewrites it; so a subscriber on the same host can map the file and
read a bucket as soon as Redis says it is ready (x86 and the Redis round trip order the
writes before the announcement), and the ZeroMQ server sends buckets from the same pages
without another copy. When a version is garbage-collected its file is renamed to a spare
and reused for the next version (its pages are already allocated and mapped: fresh tmpfs
pages cost one fault per 4 KiB, ~0.25 s/GB here); a reader still mapping it would see new
bytes, fail the checksum, find the manifest gone and report the version as gone.

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



def shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


class VersionFile:
    """A writable (publisher) or read-only (subscriber) mapping of one version's bytes.

    ``buf`` is a uint8 tensor [total_bytes] over the mapping.
    """

    def __init__(self, path: Path, total: int, writable: bool):
        self.path = path
        self.total = total
        size = max(total, 1)
        if writable:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)
                self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
            finally:
                os.close(fd)
        else:
            fd = os.open(path, os.O_RDONLY)
            try:
                got = os.fstat(fd).st_size
                if got < total:
                    raise FileNotFoundError(f"{path} holds {got} of {total} bytes")
                # MAP_POPULATE maps every page in one call instead of one fault per 4 KiB.
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                self._mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        # torch warns that a read-only buffer is not writable; views are documented read-only.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.buf = torch.frombuffer(self._mm, dtype=torch.uint8, count=size)[:total]

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buf[offset: offset + nbytes]

    def memoryview(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self._mm)[offset: offset + nbytes]


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
                vf.path.unlink(missing_ok=True)

    def gc(self) -> list[int]:
        old = sorted(self.files)[:-self.keep]
        self.drop(old)
        return old

    def close(self) -> None:
        self.drop(list(self.files), recycle=False)
        if self._spare is not None:
            self._spare.path.unlink(missing_ok=True)
            self._spare = None
