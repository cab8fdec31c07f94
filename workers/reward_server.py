"""The reward-model role as its own process: loads ``rollout.reward_model`` once, on its own
device, and scores the batches of every rollout worker (see :mod:`streamrl.roles.reward_server`).

Started by the launcher when ``placement.reward`` is set and ``rollout.reward_model`` is
configured; reads the run config from Redis, binds its socket on a free port and publishes
``tcp://<advertise>:<port>`` as the endpoint ``reward`` (workers read it through their
:class:`~streamrl.roles.reward_client.RewardClient`, and read it again after a timeout, so a
restarted server on a new port is found). Reports ``reward/*`` counters to the monitor.

    python -m streamrl.workers.reward_server --redis-url redis://... --run-id R [--device cuda:1]
"""
from __future__ import annotations

import argparse
import signal
import socket
import sys
import time

import torch

from streamrl.config import config_from_dict
from streamrl.coord.coordinator import Coordinator
from streamrl.rewards import load_reward_model
from streamrl.roles.reward_server import RewardServer
from streamrl.roles.reward_wire import ENDPOINT
from streamrl.utils import limit_threads, setup_logging

METRICS_EVERY_S = 2.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="StreamRL reward-model role (serves rollout.reward_model)")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--run-id", required=True, help="run id (Redis namespace)")
    p.add_argument("--device", default=None, help="model device (default: rollout.reward_model_device)")
    p.add_argument("--bind-host", default="127.0.0.1", help="address the reward socket binds")
    p.add_argument("--advertise-host", default=None, help="address workers connect to (default: bind host)")
    p.add_argument("--max-batch", type=int, default=256, help="most pairs scored in one forward")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    log = setup_logging("reward")
    limit_threads()
    torch.set_grad_enabled(False)
    coord = Coordinator(args.redis_url, args.run_id)
    stored = coord.get_config()
    if stored is None:
        raise RuntimeError(f"no config in Redis for run {args.run_id}")
    rc = config_from_dict(stored).rollout
    if not rc.reward_model:
        raise ValueError("the reward-model role needs rollout.reward_model (an HF folder or package.module:factory)")
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)  # before the (long) model load: a stop then exits cleanly
    signal.signal(signal.SIGINT, on_signal)
    device = args.device or rc.reward_model_device
    scorer = load_reward_model(rc.reward_model, device)
    server = RewardServer(scorer, f"tcp://{args.bind_host}:*", max_batch=args.max_batch)
    advertise = args.advertise_host or (socket.gethostname() if args.bind_host == "0.0.0.0" else args.bind_host)
    endpoint = f"tcp://{advertise}:{server.endpoint.rsplit(':', 1)[1]}"
    coord.set_endpoint(ENDPOINT, endpoint)
    log.info("serving %s on %s at %s", rc.reward_model, device, endpoint)

    last_tick = 0.0

    def tick():
        nonlocal stopping, last_tick
        now = time.monotonic()
        if now - last_tick >= METRICS_EVERY_S:
            last_tick = now
            coord.put_metrics("reward", server.metrics())
            stopping = stopping or coord.stop_reason() is not None

    try:
        server.serve(lambda: stopping, tick)
    finally:
        coord.put_metrics("reward", server.metrics())
        server.close()
    log.info("stopping: %s; %d requests, %d pairs in %d batches, %d rejected", coord.stop_reason() or "signal",
             server.requests, server.pairs, server.batches, sum(server.rejected.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
