"""Shared-memory weights (the walking skeleton's names), now backed by the general planes.

``ShmWeightPublisher`` / ``ShmWeightSubscriber`` keep their original constructors and
methods for existing callers; they are a :class:`WeightPublisher` with ``plane="shm"`` (its
ZeroMQ bucket server also runs, so a subscriber on another host still gets the weights) and
a :class:`WeightSubscriber` with ``plane="auto"`` (shared memory on the same host). New
code should use :func:`streamrl.weights.factory.make_publisher` / ``make_subscriber``.
"""
from __future__ import annotations

from streamrl.coord.coordinator import Coordinator
from streamrl.weights.layout import ChecksumError
from streamrl.weights.publisher import WeightPublisher
from streamrl.weights.store import shm_dir
from streamrl.weights.subscriber import WeightSubscriber

__all__ = ["ChecksumError", "ShmWeightPublisher", "ShmWeightSubscriber", "shm_dir"]


class ShmWeightPublisher(WeightPublisher):
    """Learner side: write versions to shared memory and announce them in Redis."""

    def __init__(self, coord: Coordinator, run: str, bucket_bytes: int = 64 << 20, keep: int = 3):
        super().__init__(coord, run, plane="shm", bucket_bytes=bucket_bytes, keep=keep)


class ShmWeightSubscriber(WeightSubscriber):
    """Worker side: find newer versions, verify, and yield tensors for the engine."""

    def __init__(self, coord: Coordinator):
        super().__init__(coord, plane="auto")
