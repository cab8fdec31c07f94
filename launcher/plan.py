"""What one host of a run will start, decided before anything starts: the :class:`Launch` record
(printed by ``--dry-run``, carried out by :mod:`streamrl.launcher.runner`) and the node plan.

Its own module so that the CLI (:mod:`streamrl.launcher.launch`) and the runner both import it
without importing each other.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from streamrl.config import Config
from streamrl.placement import NodePlan, assign_threads, plan_node, uses_cuda

# Defaults for every child; the placement's per-process threads (placement.assign_threads) override them.
# PYTHONFAULTHANDLER: a native crash (SIGSEGV, SIGBUS, SIGABRT) writes every thread's Python stack into
# the process's log before it dies, so the exit diagnosis points at a line rather than only a signal.
BASE_ENV = {"OMP_NUM_THREADS": "1", "STREAMRL_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


@dataclass
class Launch:
    """Everything decided before a process starts (printed by --dry-run)."""

    args: argparse.Namespace
    cfg: Config
    plan: NodePlan
    run_id: str
    run_dir: Path
    head: bool
    multi: bool
    redis_url: str | None  # None: embedded, started by this host
    bind_host: str
    advertise_host: str | None
    host: str
    argv: list[str] | None = None
    """The command line as given (for the resume hint after Ctrl-C)."""

    @property
    def learner_log(self) -> Path:
        name = "learner.log" if self.plan.learner_nnodes == 1 else f"learner-node{self.plan.node_rank}.log"
        return self.run_dir / "logs" / name

    def learner_cmd(self, url: str, resume: bool = False) -> list[str]:
        """The elastic launcher's command for this host's learner ranks; with ``--resume`` when the
        user asked for it or ``resume`` (a restart after a failure continues from the checkpoint)."""
        plan, a = self.plan, self.args
        cmd = [sys.executable, "-m", "torch.distributed.run"]
        nproc = len(plan.learner.devices)
        if plan.learner_nnodes == 1 and not a.master_addr:
            cmd += ["--standalone", f"--nproc-per-node={nproc}"]
        else:
            cmd += [f"--nnodes={plan.learner_nnodes}", f"--node-rank={plan.learner_node_rank}",
                    f"--nproc-per-node={nproc}", f"--master-addr={a.master_addr or '127.0.0.1'}",
                    f"--master-port={a.master_port}"]
        cmd += ["-m", "streamrl.workers.learner", "--redis-url", url, "--run-id", self.run_id]
        if self.multi:
            cmd += ["--bind-host", self.bind_host, "--advertise-host", self.advertise_host]
        if a.resume or resume:
            cmd.append("--resume")
        return cmd

    def rollout_cmd(self, url: str, wid: int, num_workers: int, device: str) -> list[str]:
        cmd = [sys.executable, "-m", "streamrl.workers.rollout", "--redis-url", url, "--run-id", self.run_id,
               "--worker-id", str(wid), "--num-workers", str(num_workers)]
        # The stored config's rollout.device serves every worker it fits; --device only where it differs.
        return cmd + (["--device", device] if device != self.cfg.rollout.device else [])


def _gpu_info(cfg: Config) -> tuple[int, list[str] | None]:
    """This host's GPU count (torch is imported only if a role may use CUDA) and CUDA_VISIBLE_DEVICES."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [v.strip() for v in vis.split(",") if v.strip()] if vis else None
    if not uses_cuda(cfg.placement, cfg.learner.device, cfg.rollout.device):
        return 0, visible
    import torch  # noqa: PLC0415

    return torch.cuda.device_count(), visible


def make_plan(args, cfg: Config) -> NodePlan:
    gpu_count, visible = _gpu_info(cfg)
    plan = plan_node(cfg.placement, learners=args.learners, rollers=args.rollers,
                     learner_device=cfg.learner.device, rollout_device=cfg.rollout.device, nnodes=args.nnodes,
                     node_rank=args.node_rank, role=args.role, gpu_count=gpu_count, visible=visible)
    # Threads per process from this host's cores and the placement (env of each child).
    assign_threads(plan, len(os.sched_getaffinity(0)), cfg.placement.learner_threads, cfg.placement.rollout_threads)
    return plan
