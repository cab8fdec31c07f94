"""``streamrl-launch``: one command for the whole run, on one node or many.

    streamrl-launch --config configs/tiny.yaml --learners 4 --rollers 4 --steps 20

One node: starts an embedded Redis (loopback) unless ``--redis-url`` is given, stores the
validated config there, starts the learner job through torch's elastic launcher
(``python -m torch.distributed.run``) and the rollout workers as supervised subprocesses,
each with the devices its placement gives it (``CUDA_VISIBLE_DEVICES`` / ``--device``).

Many nodes: every host runs ``streamrl-launch`` with the same ``--run-id`` and
``--redis-url`` and its own ``--node-rank``/``--role``; the head (learner rank 0's host)
stores the config, the learner advertises its trajectory endpoint in Redis, workers on
other hosts find it there. ``--dry-run`` prints processes, devices and endpoints.
Exit codes: 0 this host's part finished; 2 a bad flag, config or placement (nothing started);
3 a fault it gave up on (the diagnosis block names what failed first, its log's last lines and
the resume command); 130 stopped by Ctrl-C after a clean checkpoint (143: SIGTERM). Every wait
has a deadline (config section ``deadlines``); faults and their knobs: docs/faults.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time
import uuid
from pathlib import Path

from streamrl.config import ConfigError, admission_wait_note, load_config
from streamrl.launcher.plan import BASE_ENV, Launch, make_plan
from streamrl.launcher.redis_server import unix_socket_path, unix_url
from streamrl.launcher.runstate import LaunchError, check_redis_url, is_loopback, redact, redis_host_of
from streamrl.preflight import PreflightError, require_preflight
from streamrl.placement import LAUNCH_ROLES, canonical_role

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="streamrl-launch", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml", help="YAML run config (default: configs/tiny.yaml)")
    p.add_argument("--learners", type=int, default=None,
                   help="learner ranks in total (default: one per placement.learner device, else 1)")
    p.add_argument("--rollers", type=int, default=None,
                   help="rollout workers on this host (default: one per placement.rollout device here)")
    p.add_argument("--steps", type=int, default=None, help="override run.steps")
    p.add_argument("--run-dir", default=None, help="override run.run_dir (logs go to RUN_DIR/logs)")
    g = p.add_argument_group("placement")
    g.add_argument("--place", action="append", default=[], metavar="ROLE=DEVICES",
                   help="place a role: learner|actor, rollout, reference, reward, critic = cpu | cuda | cuda:0,cuda:1 "
                        "| cuda:0-3 | node1:cuda:0 (overrides placement.ROLE)")
    g.add_argument("--colocate", action="append", default=[], metavar="ROLE,ROLE",
                   help="roles allowed to share GPUs, e.g. learner,reference")
    g = p.add_argument_group("multi-node")
    g.add_argument("--role", choices=LAUNCH_ROLES, default="all", help="what this host starts (default: all)")
    g.add_argument("--nnodes", type=int, default=1, help="hosts in the run (default 1)")
    g.add_argument("--node-rank", type=int, default=0, help="this host's rank, 0..nnodes-1 (default 0)")
    g.add_argument("--master-addr", default=None, help="address of the learner's first node (torch rendezvous)")
    g.add_argument("--master-port", type=int, default=29500, help="torch rendezvous port (default 29500)")
    g.add_argument("--run-id", default=None, help="run id shared by every host (required with --role/--nnodes)")
    g.add_argument("--bind-host", default=None, help="address the learner's trajectory socket binds "
                                                     "(default: 127.0.0.1 on one node, 0.0.0.0 across hosts)")
    g.add_argument("--advertise-host", default=None, help="address other hosts use to reach this one "
                                                          "(default: --master-addr, else the hostname)")
    g = p.add_argument_group("redis")
    g.add_argument("--redis-url", default=None, help="use this Redis instead of starting an embedded one")
    g.add_argument("--redis-host", default="127.0.0.1",
                   help="bind address of the embedded Redis (non-loopback needs --redis-password)")
    g.add_argument("--redis-port", type=int, default=None, help="port of the embedded Redis (default: a free one)")
    g.add_argument("--redis-password", default=os.environ.get("STREAMRL_REDIS_PASSWORD"),
                   help="password of the embedded Redis (default: $STREAMRL_REDIS_PASSWORD)")
    g = p.add_argument_group("supervision")
    g.add_argument("--max-restarts", type=int, default=3, help="restarts per rollout worker before giving up")
    g.add_argument("--restart-backoff", type=float, default=1.0, help="first restart delay in s, doubled each time")
    g.add_argument("--learner-restarts", type=int, default=0,
                   help="restart a failed learner this many times (each restart resumes from the latest checkpoint)")
    g.add_argument("--resume", action="store_true", help="start the learner with --resume (continue a checkpoint)")
    g.add_argument("--stop-grace", type=float, default=30.0, help="seconds the learner gets to stop before SIGTERM")
    g.add_argument("--wait-timeout", type=float, default=300.0,
                   help="seconds a non-head host waits for the run to appear in Redis")
    p.add_argument("--wandb", action="store_true", help="also log metrics to Weights & Biases (run.wandb=true; "
                                                       "WANDB_MODE=offline works without network)")
    p.add_argument("--dry-run", action="store_true", help="print processes, devices and endpoints, start nothing")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. learner.lr=1e-3")
    return p


def parse_args(argv=None):
    # Intermixed: overrides may sit between flags (`--learners 2 learner.ep=2 --dry-run`).
    return build_parser().parse_intermixed_args(argv)


def _overrides(args) -> list[str]:
    out = list(args.overrides)
    if args.steps is not None:
        out.append(f"run.steps={args.steps}")
    if args.run_dir is not None:
        out.append(f"run.run_dir={args.run_dir}")
    if args.wandb:
        out.append("run.wandb=true")
    for item in args.place:
        if "=" not in item:
            raise LaunchError(f"--place {item!r}: expected ROLE=DEVICES, e.g. learner=cuda:0,cuda:1")
        role, devs = item.split("=", 1)
        role = canonical_role(role, f"--place {item}")
        out.append(f"placement.{role}=[{', '.join(d.strip() for d in devs.split(',') if d.strip())}]")
    if args.colocate:
        groups = [[canonical_role(r, f"--colocate {g}") for r in re.split(r"[,+\s]+", g) if r] for g in args.colocate]
        out.append("placement.colocate=" + json.dumps(groups))
    return out


def prepare(args) -> Launch:
    """Validate flags, config and placement; decide the run id, Redis and endpoints. Raises one-line errors."""
    multi = args.nnodes > 1 or args.role != "all"
    if args.run_id is None and multi:
        raise LaunchError(f"--run-id is required with --role {args.role} / --nnodes {args.nnodes}: "
                          f"every host of the run must use the same one")
    if args.run_id is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", args.run_id):
        raise LaunchError(f"--run-id {args.run_id!r}: use letters, digits, '_', '.', '-' (at most 128)")
    if args.role == "learner" and args.rollers:
        raise LaunchError(f"--rollers {args.rollers} with --role learner: this host starts no rollout workers")
    for flag in ("max_restarts", "learner_restarts"):
        if getattr(args, flag) < 0:
            raise LaunchError(f"--{flag.replace('_', '-')} = {getattr(args, flag)}: must be >= 0")
    config = args.config
    if args.role == "rollout" and not Path(config).is_file():
        config = None  # the head's config in Redis is what counts on a rollout host
    cfg = load_config(config, _overrides(args))
    plan = make_plan(args, cfg)
    # Inputs, plug-ins and the learner layout, before any process starts (one line per problem).
    require_preflight(cfg, plan.learner_world if plan.learner is not None else None)
    head = plan.learner is not None and plan.learner_node_rank == 0
    if plan.learner is not None:
        cfg.learner.device = plan.learner.device_arg  # ranks take cuda:LOCAL_RANK of their visible GPUs
    if head and plan.rollouts and len({r.device_arg for r in plan.rollouts}) == 1:
        cfg.rollout.device = plan.rollouts[0].device_arg  # after CUDA_VISIBLE_DEVICES renumbering
        if plan.learner_nnodes > 1 and not args.master_addr:
            raise LaunchError(f"--master-addr is required: learner ranks span nodes {plan.learner_nodes}")
    if args.redis_url:
        check_redis_url(args.redis_url)
    elif not head:
        raise LaunchError(f"--role {args.role} on node {args.node_rank} needs --redis-url: the head host "
                          f"(learner rank 0) owns the run's Redis")
    elif multi and is_loopback(args.redis_host):
        raise LaunchError("the embedded Redis binds 127.0.0.1, which other hosts cannot reach: pass "
                          "--redis-host ADDR --redis-password PW, or --redis-url of a shared Redis")
    elif not is_loopback(args.redis_host) and not args.redis_password:
        raise LaunchError(f"--redis-host {args.redis_host}: a Redis reachable from other hosts needs "
                          f"--redis-password (or $STREAMRL_REDIS_PASSWORD)")
    reachable = multi or (args.redis_url is not None and not is_loopback(redis_host_of(args.redis_url)))
    bind = args.bind_host or ("0.0.0.0" if reachable else "127.0.0.1")
    advertise = args.advertise_host or (args.master_addr if reachable else None)
    if reachable and not advertise:
        advertise = socket.gethostname()
    run_id = args.run_id or f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    run_dir = Path(cfg.run.run_dir).resolve()
    cfg.run.run_dir = str(run_dir)
    host = f"node{args.node_rank}-{args.role}-{socket.gethostname()}-{os.getpid()}"
    return Launch(args, cfg, plan, run_id, run_dir, head, multi, args.redis_url, bind, advertise, host)


def describe(launch: Launch) -> dict:
    """The --dry-run report: processes with commands, devices, environment and log files; endpoints."""
    a = launch.args
    url = launch.redis_url or (f"redis://{':***@' if a.redis_password else ''}{a.redis_host}:"
                               f"{a.redis_port or '<free port>'}/0 (embedded)")
    url = redact(url)
    local = url  # this host's processes: an embedded Redis's Unix socket (runner.redis_urls)
    if launch.redis_url is None and (sock := unix_socket_path(launch.run_dir / "redis")) is not None:
        local = unix_url(sock, "***" if a.redis_password else None)
    procs = []
    if launch.plan.learner:
        procs.append({"name": "learner", "cmd": launch.learner_cmd(local), "env": launch.plan.learner.env,
                      "devices": [str(d) for d in launch.plan.learner.devices], "log": str(launch.learner_log)})
    for i, r in enumerate(launch.plan.rollouts):
        wid = f"<id {i}>" if not launch.head or launch.multi else str(i)
        procs.append({"name": f"rollout-{wid}", "cmd": launch.rollout_cmd(local, wid, len(launch.plan.rollouts),
                                                                             r.device_arg),
                      "env": r.env, "devices": [str(d) for d in r.devices],
                      "hosted": {k: [str(d) for d in v] for k, v in r.hosted.items()},
                      "log": str(launch.run_dir / "logs" / f"rollout-{wid}.log")})
    # Lazy: the role modules import torch; --help and flag errors stay fast without it.
    from streamrl.roles.launch import role_processes  # noqa: PLC0415

    for role in role_processes(launch.cfg, a.node_rank, local, launch.run_id, launch.bind_host,
                               launch.advertise_host):  # the role servers (started by runner._processes)
        procs.append({"name": role.name, "env": dict(BASE_ENV), "devices": [role.device], "cmd": role.cmd,
                      "log": str(launch.run_dir / "logs" / f"{role.name}.log")})
    traj_host = launch.advertise_host or launch.bind_host
    return {
        "run_id": launch.run_id, "node_rank": a.node_rank, "nnodes": a.nnodes, "role": a.role, "head": launch.head,
        "run_dir": str(launch.run_dir), "redis": url, "redis_here": local,
        "endpoints": {
            "trajectories": f"tcp://{traj_host}:<port picked by learner rank 0, published in Redis>"
                            if launch.plan.learner else "read from Redis (published by learner rank 0)",
            "learner_rendezvous": (f"{a.master_addr or '127.0.0.1'}:{a.master_port}"
                                   if (launch.plan.learner_nnodes > 1 or a.master_addr) else "standalone (local)"),
            "bind_host": launch.bind_host,
        },
        "placement": {"learner_world": launch.plan.learner_world, "learner_nodes": launch.plan.learner_nodes,
                      "colocate": launch.cfg.placement.colocate},
        "processes": procs,
    }


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        launch = prepare(args)
        launch.argv = argv
        note = launch.plan.rollouts and admission_wait_note(
            launch.cfg.rollout.prompts_per_batch, launch.cfg.learner.groups_per_step,
            launch.cfg.learner.max_staleness, len(launch.plan.rollouts))
        if note:  # only where this host starts workers
            print(f"streamrl-launch: note: {note}", file=sys.stderr)
        if args.dry_run:
            print(json.dumps(describe(launch), indent=2))
            return 0
    except PreflightError as e:
        for line in e.problems:
            print(f"streamrl-launch: {line}", file=sys.stderr)
        return 2
    except ConfigError as e:  # PlacementError and LaunchError are ConfigError / ValueError
        print(f"streamrl-launch: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"streamrl-launch: {e}", file=sys.stderr)
        return 2
    # Lazy: the runner imports torch (seconds); --help, --dry-run and flag errors do without it.
    from streamrl.launcher.runner import execute  # noqa: PLC0415

    return execute(launch)


if __name__ == "__main__":
    sys.exit(main())
