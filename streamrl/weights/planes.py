"""Which weights data plane a run uses: ``weights.data_plane`` with ``auto`` resolved.

``auto`` picks ``ipc`` (CUDA IPC handles of the learner's device buffers,
:mod:`streamrl.weights.ipc`) when every process that loads weights can map the learner's GPU
memory: the learner and every rollout worker (and the evaluator, when there is one) on CUDA, on
one host, with the ``sum64`` checksum (computed on the device). Otherwise it keeps the host
planes: the shared-memory store for the learner's host, ZeroMQ for other hosts.

"One host" is read from two places. The placement must not put learner and workers on different
nodes, and the learner must serve its host only (its sockets bind a loopback address):
a learner bound to a reachable address may have rollout hosts joining it
(``streamrl-launch --role rollout``), which no config lists.

Torch-free: :mod:`streamrl.config` checks an explicit ``ipc`` with :func:`ipc_obstacle` at
load time (so ``streamrl-launch --dry-run`` reports it), and the launcher imports no torch.

Examples:
    >>> from streamrl.config import load_config
    >>> select_plane(load_config(None, ["weights.data_plane=zmq"]), local_only=True)
    ('zmq', None)
    >>> select_plane(load_config(None), local_only=True)[1]
    "learner.device = 'cpu': CUDA IPC needs the learner on a CUDA device"
"""
from __future__ import annotations

from streamrl.errors import ConfigError
from streamrl.placement import Device, parse_devices


def _devices(cfg, role: str) -> tuple[str, object, list[Device] | None]:
    """``(field, value, devices)`` of ``role`` (learner / rollout): its placement list when set,
    else ``<role>.device``; devices None when the value is not a device string."""
    placed = getattr(cfg.placement, role)
    field, value = (f"placement.{role}", placed) if placed is not None else (f"{role}.device",
                                                                            getattr(cfg, role).device)
    try:
        return field, value, parse_devices(value, field)
    except ConfigError:
        return field, value, None


def ipc_obstacle(cfg) -> tuple[str, object, str] | None:
    """Why the learner and the weights subscribers of ``cfg`` (a Config) cannot share device
    buffers, as ``(field, value, why)``, or None when nothing in the config stands in the way."""
    placed = []
    for role, who in (("learner", "the learner"), ("rollout", "every rollout worker")):
        field, value, devs = _devices(cfg, role)
        if devs is None or any(d.kind != "cuda" for d in devs):
            return field, value, f"CUDA IPC needs {who} on a CUDA device"
        placed += devs
    if cfg.eval.interval > 0 and not cfg.eval.device.startswith("cuda"):
        return "eval.device", cfg.eval.device, "CUDA IPC needs the evaluator on a CUDA device (eval.interval > 0)"
    nodes = sorted({d.node for d in placed if d.node is not None})
    if len(nodes) > 1:
        return "placement.rollout", cfg.placement.rollout, f"CUDA IPC needs one host; the placement spans nodes {nodes}"
    if cfg.weights.checksum != "sum64":
        return "weights.checksum", cfg.weights.checksum, "CUDA IPC verifies on the device, where only sum64 runs"
    return None


def select_plane(cfg, local_only: bool) -> tuple[str, str | None]:
    """``(plane, why not ipc)`` for the publisher of ``cfg``: ``weights.data_plane`` as set, or for
    ``auto`` either ``"ipc"`` or ``"auto"`` (the host planes) with the reason, one line.

    ``local_only``: the learner's sockets bind a loopback address, so every subscriber is on its host.
    """
    plane = cfg.weights.data_plane
    if plane != "auto":
        return plane, None
    obstacle = ipc_obstacle(cfg)
    if obstacle is not None:
        field, value, why = obstacle
        return "auto", f"{field} = {value!r}: {why}"
    if not local_only:
        return "auto", "the learner binds a non-loopback address: workers on other hosts may join"
    return "ipc", None
