"""Versioned weights through shared memory, announced in Redis.

Publisher (learner rank 0) writes each full tensor, one at a time, into a preallocated file
under ``/dev/shm`` at the offset the manifest gives, so peak extra memory is about one
tensor (the caller gathers tensors lazily, bucket by bucket). Each bucket (a contiguous run
of tensors up to ``bucket_bytes``) gets a CRC32. The manifest (names, dtypes, shapes,
offsets, buckets, checksums) goes to Redis; then the version advances and is announced.

Subscriber (rollout worker) maps the file read-only, verifies every bucket's checksum, and
hands ``{name: tensor}`` views to the engine's loader; a mismatch raises before anything
is loaded, so a corrupted version is never half-applied.
"""
from __future__ import annotations

import math
import mmap
import os
import time
import zlib
from pathlib import Path
from typing import Iterable, Iterator

import torch

from streamrl.coord.coordinator import Coordinator
from streamrl.transport.codec import DTYPE_NAMES, DTYPES


class ChecksumError(RuntimeError):
    """A weights bucket does not match its manifest checksum."""


def shm_dir() -> Path:
    d = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    return d


class ShmWeightPublisher:
    """Learner side: write versions to shared memory and announce them in Redis."""

    def __init__(self, coord: Coordinator, run: str, bucket_bytes: int = 64 << 20, keep: int = 3):
        self.coord = coord
        self.run = run
        self.bucket_bytes = bucket_bytes
        self.keep = keep
        self._files: list[Path] = []

    def layout(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[list[dict], list[dict], int]:
        """Offsets and buckets for (name, dtype, shape) specs; 64-byte aligned tensors."""
        tensors, buckets, off = [], [], 0
        bucket_start, bucket_first = 0, 0
        for i, (name, dtype, shape) in enumerate(specs):
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if off - bucket_start >= self.bucket_bytes and i > bucket_first:
                buckets.append({"offset": bucket_start, "nbytes": off - bucket_start, "first": bucket_first, "count": i - bucket_first})
                bucket_start, bucket_first = off, i
            tensors.append({"name": name, "dtype": DTYPE_NAMES[dtype], "shape": list(shape), "offset": off, "nbytes": nbytes})
            off += nbytes
            off = (off + 63) // 64 * 64
        buckets.append({"offset": bucket_start, "nbytes": off - bucket_start, "first": bucket_first, "count": len(specs) - bucket_first})
        return tensors, buckets, off

    def publish(self, version: int, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                tensors: Iterable[torch.Tensor]) -> dict[str, float]:
        """Write ``tensors`` (in ``specs`` order, produced lazily) and announce ``version``.

        Returns timings ``{"weights/write_s", "weights/bytes"}``.
        """
        t0 = time.perf_counter()
        entries, buckets, total = self.layout(specs)
        path = shm_dir() / f"streamrl-{self.run}-v{version}.bin"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w+b") as f:
            f.truncate(max(total, 1))
            mm = mmap.mmap(f.fileno(), max(total, 1))
            try:
                view = memoryview(mm)
                for entry, t in zip(entries, tensors, strict=True):
                    src = t.detach().to("cpu").contiguous()
                    if list(src.shape) != entry["shape"] or DTYPE_NAMES[src.dtype] != entry["dtype"]:
                        raise ValueError(f"tensor {entry['name']} does not match its spec")
                    if entry["nbytes"]:
                        dst = torch.frombuffer(view[entry["offset"]: entry["offset"] + entry["nbytes"]], dtype=torch.uint8)
                        dst.copy_(src.view(-1).view(torch.uint8))
                        del dst
                for b in buckets:
                    b["crc32"] = zlib.crc32(view[b["offset"]: b["offset"] + b["nbytes"]])
                view.release()
            finally:
                mm.close()
        os.replace(tmp, path)
        manifest = {"version": version, "transport": "shm", "path": str(path), "total_bytes": total,
                    "tensors": entries, "buckets": buckets, "published_at": time.time()}
        self.coord.publish_version(version, manifest, keep=self.keep)
        self._files.append(path)
        while len(self._files) > self.keep:
            old = self._files.pop(0)
            old.unlink(missing_ok=True)
        return {"weights/write_s": time.perf_counter() - t0, "weights/bytes": float(total)}

    def close(self) -> None:
        for p in self._files:
            p.unlink(missing_ok=True)
        self._files.clear()


class ShmWeightSubscriber:
    """Worker side: find newer versions, verify, and yield tensors for the engine."""

    def __init__(self, coord: Coordinator):
        self.coord = coord
        self.loaded_version = -1

    def newer_version(self) -> int | None:
        v = self.coord.current_version()
        return v if v > self.loaded_version else None

    def fetch(self, version: int) -> Iterator[tuple[str, torch.Tensor]] | None:
        """Open ``version`` and verify every bucket; returns an iterator of (name, tensor).

        Returns None when the manifest or file is gone (superseded by a newer version).
        Raises :class:`ChecksumError` on corruption before yielding anything.
        """
        manifest = self.coord.manifest(version)
        if manifest is None:
            return None
        buf = bytearray(manifest["total_bytes"])  # one copy: the file may be unlinked soon
        try:
            with open(manifest["path"], "rb") as f:
                got = f.readinto(buf)
        except FileNotFoundError:
            return None
        if got < manifest["total_bytes"]:
            raise ChecksumError(f"weights file of v{version} is truncated: {got} < {manifest['total_bytes']}")
        view = memoryview(buf)
        for b in manifest["buckets"]:
            if zlib.crc32(view[b["offset"]: b["offset"] + b["nbytes"]]) != b["crc32"]:
                raise ChecksumError(f"weights v{version} bucket at {b['offset']} fails its checksum")

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for e in manifest["tensors"]:
                dtype = DTYPES[e["dtype"]]
                if e["nbytes"] == 0:
                    yield e["name"], torch.empty(e["shape"], dtype=dtype)
                    continue
                raw = torch.frombuffer(buf, dtype=torch.uint8, offset=e["offset"], count=e["nbytes"])
                yield e["name"], raw.view(dtype).view(e["shape"])

        return tensors()

    def mark_loaded(self, worker_id: int, version: int) -> None:
        self.loaded_version = version
        self.coord.ack(worker_id, version)
