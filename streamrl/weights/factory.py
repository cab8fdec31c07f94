"""Build the publisher / subscriber a run's config asks for (``weights`` config section).

Learner rank 0::

    publisher = make_publisher(coord, run_id, cfg, bind_host=args.bind_host, advertise_host=adv)
    publisher.publish(version, trainer.param_specs, trainer.full_tensors())

Rollout worker::

    subscriber = make_subscriber(coord, cfg, worker_id=wid)
    v = subscriber.load([engine, reference], wid)   # newest version, verified, loaded, acked (or None)

``auto`` picks ``ipc`` (device buffers shared through CUDA IPC) when the learner and every
subscriber are on CUDA on one host (:func:`streamrl.weights.planes.select_plane`; the reason it
did not is logged once). Otherwise it publishes to the shared-memory store *and* serves it over
ZeroMQ; each subscriber maps the file when it runs on the learner's host and uses ZeroMQ
otherwise. Subscribers follow the manifest's plane for ``ipc``, ``nccl`` and ``gloo``.
"""
from __future__ import annotations

import logging

from streamrl.coord.coordinator import Coordinator
from streamrl.launcher.runstate import is_loopback
from streamrl.weights.planes import select_plane
from streamrl.weights.publisher import WeightPublisher
from streamrl.weights.subscriber import WeightSubscriber

log = logging.getLogger(__name__)


def make_publisher(coord: Coordinator, run: str, cfg=None, bind_host: str = "127.0.0.1",
                   advertise_host: str | None = None, device: str | None = None) -> WeightPublisher:
    """A :class:`WeightPublisher` configured from ``cfg.weights`` (defaults when absent)."""
    w = getattr(cfg, "weights", None)
    if w is None:
        return WeightPublisher(coord, run, bind_host=bind_host, advertise_host=advertise_host)
    # A learner bound to loopback serves its own host only, so every subscriber runs on this host.
    plane, why = select_plane(cfg, local_only=is_loopback(bind_host))
    if why is not None:
        log.info("weights.data_plane = auto: shm on this host, zmq for others, not ipc (%s)", why)
    return WeightPublisher(coord, run, plane=plane, bucket_bytes=w.bucket_mb << 20, keep=w.keep_versions,
                           checksum=w.checksum, target=w.target, bind_host=bind_host,
                           advertise_host=advertise_host, collective_world=w.collective_world, device=device,
                           ipc_buffers=w.ipc_buffers)


def make_subscriber(coord: Coordinator, cfg=None, worker_id: int | None = None,
                    device: str = "cpu") -> WeightSubscriber:
    """A :class:`WeightSubscriber` configured from ``cfg.weights``; ``worker_id`` gives the
    collective rank (``worker_id + 1``) for the nccl/gloo planes."""
    w = getattr(cfg, "weights", None)
    if w is None:
        return WeightSubscriber(coord)
    plane = w.data_plane if w.data_plane in ("shm", "zmq") else "auto"
    rank = None if worker_id is None else worker_id + 1
    return WeightSubscriber(coord, plane=plane, streams=w.zmq_streams, collective_rank=rank, device=device,
                            verify_threads=w.verify_threads)

