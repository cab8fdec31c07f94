"""Where and how the launcher starts the reward-model role (one place for runner and --dry-run).

The role runs as its own process when both ``placement.reward`` (its devices) and
``rollout.reward_model`` (what to serve) are set; otherwise rollout workers keep scoring with
their rule rewards (and an in-process reward model, if one is configured without placement).
One server on the first device of ``placement.reward``; it batches every worker's requests.
"""
from __future__ import annotations

import sys

from streamrl.config import Config
from streamrl.placement import parse_devices

PROCESS_NAME = "reward"


def reward_role_configured(cfg: Config) -> bool:
    """Whether the reward model runs as its own process (workers then score through its client)."""
    return bool(cfg.placement.reward and cfg.rollout.reward_model)


def reward_role_device(cfg: Config, node_rank: int = 0) -> str | None:
    """The local device string (``cpu``, ``cuda:1``) the reward server runs on from this host
    (``node_rank``), or None when the role is not configured or is placed on another node."""
    if not reward_role_configured(cfg):
        return None
    first = parse_devices(cfg.placement.reward, "placement.reward")[0]
    if (first.node or 0) != node_rank:
        return None
    return first.local()


def reward_server_cmd(url: str, run_id: str, device: str, bind_host: str = "127.0.0.1",
                      advertise_host: str | None = None) -> list[str]:
    """The reward server's command line (see ``streamrl.workers.reward_server``)."""
    cmd = [sys.executable, "-m", "streamrl.workers.reward_server", "--redis-url", url, "--run-id", run_id,
           "--device", device, "--bind-host", bind_host]
    return cmd + (["--advertise-host", advertise_host] if advertise_host else [])
