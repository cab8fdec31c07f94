"""Where and how the launcher starts the role servers (one place for runner and --dry-run).

* ``reward``: when both ``placement.reward`` (its devices) and ``rollout.reward_model`` (what to
  serve) are set; otherwise rollout workers keep scoring with their rule rewards (and an
  in-process reward model, if one is configured without placement);
* ``reference``: when ``placement.reference`` is set and ``learner.kl_coef > 0``; otherwise the
  learner ranks hold the reference (see :mod:`streamrl.roles.reference`);
* ``critic``: when ``placement.critic`` is set and ``learner.advantage = gae`` (see
  :mod:`streamrl.roles.critic`); the value-head critic (``learner.loss = vtrace``) stays in the learner.

One server per role, on the first device of its placement, on the host whose ``node_rank``
that device names (unqualified: node 0); it batches every worker's requests.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from streamrl.config import Config
from streamrl.placement import parse_devices
from streamrl.roles.critic import critic_role_configured
from streamrl.roles.names import CRITIC, REFERENCE, REWARD
from streamrl.roles.reference import reference_role_configured

@dataclass(frozen=True)
class RoleProcess:
    """One role server this host starts: its process name, local device and command line."""

    name: str
    device: str
    cmd: list[str]


def reward_role_configured(cfg: Config) -> bool:
    """Whether the reward model runs as its own process (workers then score through its client)."""
    return bool(cfg.placement.reward and cfg.rollout.reward_model)


def _device_here(devices: list[str], where: str, node_rank: int) -> str | None:
    first = parse_devices(devices, where)[0]
    return first.local() if (first.node or 0) == node_rank else None


def role_server_cmd(module: str, url: str, run_id: str, device: str, bind_host: str = "127.0.0.1",
                    advertise_host: str | None = None) -> list[str]:
    """A role server's command line (``module``: ``streamrl.workers.<role>_server``)."""
    cmd = [sys.executable, "-m", module, "--redis-url", url, "--run-id", run_id, "--device", device,
           "--bind-host", bind_host]
    return cmd + (["--advertise-host", advertise_host] if advertise_host else [])


def role_processes(cfg: Config, node_rank: int, url: str, run_id: str, bind_host: str = "127.0.0.1",
                   advertise_host: str | None = None) -> list[RoleProcess]:
    """Every role server this host (``node_rank``) starts, in a fixed order (reward, reference, critic)."""
    wanted = []
    if reward_role_configured(cfg):
        wanted.append((REWARD, cfg.placement.reward))
    if reference_role_configured(cfg):
        wanted.append((REFERENCE, cfg.placement.reference))
    if critic_role_configured(cfg):
        wanted.append((CRITIC, cfg.placement.critic))
    out = []
    for role, devices in wanted:
        device = _device_here(devices, f"placement.{role}", node_rank)
        if device is not None:
            out.append(RoleProcess(role, device, role_server_cmd(f"streamrl.workers.{role}_server", url, run_id,
                                                                 device, bind_host, advertise_host)))
    return out
