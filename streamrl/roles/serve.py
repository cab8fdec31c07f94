"""The common main loop of a role server's process (reward, reference, critic).

Reads the run config from Redis, builds the role's server on its device (a
:class:`~streamrl.roles.batching_server.BatchingServer` bound on a free port), publishes the
endpoint under the role's name (clients re-read it after a timeout, so a restart on a new port
is found), and serves until SIGTERM or the run's stop; every ``METRICS_EVERY_S`` it reports its
counters and runs the role's own periodic work (the critic trains and checkpoints there).
"""
from __future__ import annotations

import argparse
import signal
import socket
import time
from typing import Callable

import torch

from streamrl.config import Config, config_from_dict
from streamrl.coord.coordinator import Coordinator
from streamrl.roles.batching_server import BatchingServer
from streamrl.roles.token_server import ScoreFn, TokenRoleServer
from streamrl.utils import limit_threads, setup_logging

METRICS_EVERY_S = 2.0
# (cfg, device) -> (score function, vocab size, periodic work returning extra metrics, or None)
Build = Callable[[Config, str], tuple[ScoreFn, int, Callable[[], dict[str, float]] | None]]
# (cfg, device, bind address) -> (the role's bound server, periodic work returning extra metrics, or None)
MakeServer = Callable[[Config, str, str], tuple[BatchingServer, Callable[[], dict[str, float]] | None]]


def parse_role_args(role: str, argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=f"StreamRL {role} role")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--run-id", required=True, help="run id (Redis namespace)")
    p.add_argument("--device", default="cpu", help="model device (streamrl-launch sets it per placement)")
    p.add_argument("--bind-host", default="127.0.0.1", help="address the socket binds")
    p.add_argument("--advertise-host", default=None, help="address workers connect to (default: bind host)")
    p.add_argument("--max-trajectories", type=int, default=256, help="most trajectories scored in one round")
    return p.parse_args(argv)


def serve_role(role: str, args: argparse.Namespace, build: Build) -> int:
    """A token-scoring role (reference, critic): ``build``'s scorer behind a TokenRoleServer."""
    def make(cfg: Config, device: str, bind: str):
        score_fn, vocab, periodic = build(cfg, device)
        return TokenRoleServer(role, score_fn, vocab, bind, args.max_trajectories), periodic

    return run_role_server(role, args, args.device, make)


def run_role_server(role: str, args: argparse.Namespace, device: str | None, make: MakeServer) -> int:
    """Serve ``role`` until SIGTERM or the run's stop (``args``: redis_url, run_id, bind_host,
    advertise_host; ``device``: None = the role's configured default, which ``make`` resolves)."""
    log = setup_logging(role)
    limit_threads()
    coord = Coordinator(args.redis_url, args.run_id)
    cfg = config_from_dict(coord.wait_config())
    # Set to True by SIGTERM/SIGINT or by the run's stop, and never written otherwise: a tick that
    # wrote back `stopping or <run stopped>` could overwrite a signal handled while it waited on
    # Redis with its stale False, and the server would not stop.
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)  # before the (long) model load: a stop then exits cleanly
    signal.signal(signal.SIGINT, on_signal)
    with torch.no_grad():
        server, periodic = make(cfg, device, f"tcp://{args.bind_host}:*")
    advertise = args.advertise_host or (socket.gethostname() if args.bind_host == "0.0.0.0" else args.bind_host)
    endpoint = f"tcp://{advertise}:{server.endpoint.rsplit(':', 1)[1]}"
    coord.set_endpoint(role, endpoint)
    log.info("serving the %s role on %s at %s", role, device or "its configured device", endpoint)
    last_tick = 0.0

    def tick():
        nonlocal stopping, last_tick
        extra = periodic() if periodic is not None else {}
        now = time.monotonic()
        if now - last_tick >= METRICS_EVERY_S:
            last_tick = now
            coord.put_metrics(role, {**server.metrics(), **extra})
            if coord.stop_reason() is not None:
                stopping = True

    try:
        server.serve(lambda: stopping, tick)
    finally:
        coord.put_metrics(role, server.metrics())
        server.close()
    log.info("stopping: %s; %d requests in %d batches, %d rejected, %d failed", coord.stop_reason() or "signal",
             server.requests, server.batches, sum(server.rejected.values()), server.errors)
    return 0
