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
import sys

import torch

from streamrl.rewards import load_reward_model
from streamrl.roles.reward_server import RewardServer
from streamrl.roles.reward_wire import ENDPOINT
from streamrl.roles.serve import run_role_server


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
    torch.set_grad_enabled(False)

    def make(cfg, device, bind):
        rc = cfg.rollout
        if not rc.reward_model:
            raise ValueError("the reward-model role needs rollout.reward_model (an HF folder or package.module:factory)")
        scorer = load_reward_model(rc.reward_model, device or rc.reward_model_device)
        return RewardServer(scorer, bind, max_batch=args.max_batch), None

    return run_role_server(ENDPOINT, args, args.device, make)


if __name__ == "__main__":
    sys.exit(main())
