"""Read leases on the shared-memory store: a store file is never rewritten while it is read.

The problem. A same-host subscriber verifies a version's buckets in the store file and hands
the engine *views* of that file; the engine reads them later (a CPU copy, an H2D DMA, or
after :meth:`WeightSubscriber.fetch` returned, on the in-flight path). The publisher recycles
a collected version's file for a new version (:mod:`streamrl.weights.store`), so without a
lease ``keep`` newer publishes during that window would make the engine load bytes of a
newer, partly written version that nobody verified.

The lease. A subscriber takes a shared ``flock`` on the version file *before* it reads a
byte of it; the publisher recycles a file only while it holds an exclusive ``flock``
(``LOCK_NB``: it never waits), and renames it away before letting go. The kernel makes the
two exclusive, so exactly one of these holds:

* the reader locked first: the publisher's exclusive lock fails and it keeps the file
  (``ShmStore.retained``), retrying at its next GC;
* the publisher locked first: it renamed the file before unlocking, so the reader, once
  locked, finds the version's path gone (or naming another inode) and reports the version
  gone, having read nothing.

Recycling is the only way bytes of a published file change (files are written once; a
version is unlinked, never truncated, when it is dropped without recycling, and an unlinked
file keeps its bytes for whoever still maps it). So a verified view cannot change while its
lease is held: impossible, not unlikely.

How long a lease lives: exactly as long as any tensor viewing the leased bytes. The views a
fetch hands out share one storage over a fresh ``memoryview`` of the mapping; when the last
view dies the storage drops that memoryview, whose finalizer closes the lock's descriptor.
So the lease covers the engine's load however the caller sequences it (``load()``; the
worker's fetch / load / ack; the in-flight path that acks first and loads after returning;
an engine that keeps the views as its weights holds the lease as long as it keeps them).

Why not a Redis key with a TTL (the first design asked for): a TTL cannot tell a slow
reader from a dead one. A load that outlives the TTL (a stalled process, a long H2D under
memory pressure) loses its lease while still reading, and the publisher recycles the file
under it; a heartbeat thread instead keeps a hung reader's lease forever. Redis also loses
keys on a restart. The kernel's lock is released at the exact moment the holder's
descriptor closes, including on SIGKILL, so a crashed subscriber delays GC by nothing, and
a live one always keeps its bytes. Shared memory is same-host by definition, so a host-local
lock is complete. Cost: one ``open`` + ``flock`` + two ``stat`` per fetch (microseconds).

A child forked while a lease is held inherits the descriptor and keeps the lease until it
exits or closes it: GC is delayed, never wrong.
"""
from __future__ import annotations

import errno
import fcntl
import os
import time
import warnings
import weakref
from pathlib import Path

import torch

LOCK_WAIT_S = 5.0  # the publisher holds its exclusive lock only for a rename (microseconds)


class LeaseGone(FileNotFoundError):
    """The version's file was recycled or removed before the lease was taken."""


def acquire_read(path: str | Path, wait_s: float = LOCK_WAIT_S) -> tuple[int, tuple[int, int]]:
    """Take a shared lease on the file at ``path``; returns ``(fd, (st_dev, st_ino))``.

    The caller owns ``fd`` (closing it releases the lease; :func:`leased_buffer` hands that
    job to the tensors' lifetime). Raises :class:`LeaseGone` when the path is gone or no
    longer names the locked file (the publisher recycled it between our open and our lock).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as e:
        raise LeaseGone(str(path)) from e
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                if time.monotonic() > deadline:  # a publisher stopped mid-rename: try later
                    raise LeaseGone(f"{path} stayed exclusively locked for {wait_s} s") from e
                time.sleep(0.0005)  # the publisher is renaming this file right now
        st = os.fstat(fd)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise LeaseGone(f"{path} was recycled before its read lease was taken")
        return fd, (st.st_dev, st.st_ino)
    except BaseException:
        os.close(fd)
        raise


def leased_buffer(mapping, total: int, fd: int) -> torch.Tensor:
    """A uint8 tensor [total] over ``mapping`` (an ``mmap``) that owns the lease ``fd``.

    Every slice / view of the result shares its storage; the storage holds a private
    ``memoryview`` of the mapping, and when the last tensor over it is freed the memoryview
    dies and the lease's descriptor is closed.
    """
    mv = memoryview(mapping)
    weakref.finalize(mv, os.close, fd)
    with warnings.catch_warnings():  # a read-only mapping; the views are documented read-only
        warnings.simplefilter("ignore")
        buf = torch.frombuffer(mv, dtype=torch.uint8, count=max(total, 1))[:total]
    del mv  # from here on only the tensor storage keeps it alive
    return buf


def try_exclusive(path: str | Path) -> int | None:
    """Publisher side: an exclusive lock on ``path`` if no reader holds a lease, else None.

    Never waits. The caller renames or unlinks the file while holding it, then closes the
    returned descriptor. Raises FileNotFoundError if ``path`` does not exist.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd
