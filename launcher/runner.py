"""Carry out a prepared :class:`~streamrl.launcher.plan.Launch` on this host.

Head host: start the embedded Redis (if no URL), reset the run's namespace, store the
config, start its learner part and workers. Other hosts: wait for the head's config in
Redis, re-plan with it (the head's placement is the run's placement), take worker ids from
the shared counter, start their part. Then supervise (:mod:`streamrl.launcher.supervisor`).
"""
from __future__ import annotations

import json
import shlex
import signal
import sys
from pathlib import Path

from streamrl.config import ConfigError, config_from_dict
from streamrl.coord.coordinator import Coordinator
from streamrl.launcher.diagnosis import EXIT_CONFIG, EXIT_FAULT, EXIT_OK, diagnosis, resume_command
from streamrl.launcher.plan import BASE_ENV, Launch, make_plan
from streamrl.launcher.process import ManagedProcess
from streamrl.launcher.redis_server import RedisServer
from streamrl.launcher.runstate import LaunchError, RunState, redact
from streamrl.launcher.progress import Progress
from streamrl.launcher.supervisor import Supervisor, exit_report, signal_name
from streamrl.launcher.watchdog import Watchdog
from streamrl.roles.launch import role_processes


def _say(msg: str) -> None:
    print(f"streamrl-launch: {msg}", flush=True)


def execute(launch: Launch) -> int:
    """Start this host's part of the run, supervise it, print the exit report. Returns the exit code."""
    args = launch.args
    if launch.head:
        launch.run_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("summary.json", "metrics.jsonl"):
            (launch.run_dir / stale).unlink(missing_ok=True)
    server = RedisServer(launch.run_dir / "redis", port=args.redis_port, host=args.redis_host,
                         password=args.redis_password) if launch.redis_url is None else None
    try:
        url, local = redis_urls(launch, server.start() if server else None)
        state = RunState(Coordinator(local, launch.run_id), launch.run_id)
        _join_run(launch, state, url)
        learner, rollers = _processes(launch, local, state)
    except (ConfigError, LaunchError) as e:
        if server:
            server.stop()
        print(f"streamrl-launch: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except BaseException:
        if server:
            server.stop()
        raise
    if launch.head:
        _write_run_info(launch, url)
    parts = [f"{len(launch.plan.learner.devices)} of {launch.plan.learner_world} learner rank(s)"] if learner else []
    parts.append(f"{len(rollers)} roller(s) {[r.name for r in rollers]}")
    _say(f"run {launch.run_id}, node {args.node_rank}/{args.nnodes}, role {args.role}: {', '.join(parts)}; "
         f"Redis {redact(url)}{f' (here: {redact(local)})' if local != url else ''}; "
         f"logs in {launch.run_dir / 'logs'}")
    progress = Progress(launch.run_dir / "metrics.jsonl", launch.cfg.run.steps) if launch.head else None
    sup = Supervisor(state, learner, rollers, head=launch.head, host=launch.host,
                     learner_restarts=args.learner_restarts,
                     learner_restart_cmd=launch.learner_cmd(local, resume=True) if learner else None,
                     single_host=not launch.multi, stop_grace_s=args.stop_grace, park_timeout_s=args.wait_timeout,
                     progress=progress, watchdog=Watchdog(state, launch.cfg.deadlines.stuck_s,
                                                          launch.cfg.deadlines.batch_s, _say))
    state.set_host(launch.host, "running")
    old = {s: signal.signal(s, sup.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        failures = sup.run()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if server:
            server.stop()
    return _finish(launch, sup, learner, rollers, failures)


def redis_urls(launch: Launch, server: RedisServer | None) -> tuple[str, str]:
    """(the URL other hosts reach, the URL this host's processes get). This host's processes reach
    the embedded Redis ``server`` over its Unix socket: a round trip without the TCP loopback stack,
    which is most of a small weights version's announcement. run.json and the messages name the TCP
    URL. A given ``--redis-url`` is used as it is."""
    if server is None:
        return launch.redis_url, launch.redis_url
    return server.url, server.local_url


def _join_run(launch: Launch, state: RunState, url: str) -> None:
    """Head: reset a re-used run id's namespace (not on --resume) and store the config. Other
    hosts: wait for the head's config and re-plan with it (the head's placement is the run's)."""
    args = launch.args
    if launch.head:
        if args.run_id is not None and not args.resume:
            state.reset_namespace()
        state.coord.put_config(launch.cfg.to_dict())
        return
    _say(f"waiting for run {launch.run_id} in Redis {redact(url)}")
    launch.cfg = config_from_dict(state.wait_for_run(args.wait_timeout))
    launch.plan = make_plan(args, launch.cfg)
    if args.run_dir is not None:
        launch.cfg.run.run_dir = args.run_dir
    launch.run_dir = Path(launch.cfg.run.run_dir).resolve()


def _write_run_info(launch: Launch, url: str) -> None:
    """RUN_DIR/run.json: where ``streamrl-monitor RUN_DIR`` finds Redis and the run id."""
    info = launch.run_dir / "run.json"
    info.write_text(json.dumps({"run_id": launch.run_id, "redis_url": url, "placement": launch.plan.to_dict()},
                               indent=2))
    if url != redact(url):
        info.chmod(0o600)  # it holds the Redis password


def _finish(launch: Launch, sup: Supervisor, learner, rollers, failures: list[str]) -> int:
    """Print the exit report (and after a stop on request, the checkpoint and resume hint); the exit code."""
    summary = launch.run_dir / "summary.json" if launch.head else None
    if summary is not None and not failures and not summary.exists():
        failures.append("learner wrote no summary.json")
    print(exit_report(([learner] if learner else []) + rollers, summary, failures), flush=True)
    if sup.stop_signal is not None:  # the checkpoint and resume hint, even if the stop went wrong
        print(stopped_report(launch, sup.stop_signal), flush=True)
        if not failures:
            return 128 + sup.stop_signal  # the shell's convention: 130 after Ctrl-C
    if failures:
        print(diagnosis(failures, sup.faults, _resume_hint(launch)), flush=True)
        return EXIT_FAULT
    return EXIT_OK


def _resume_hint(launch: Launch) -> str | None:
    """The resume command when the head host has a checkpoint to resume from (else None)."""
    if not launch.head:
        return resume_command(launch.argv) + "   (on the head host, which holds the checkpoint)"
    from streamrl.learner.run_checkpoint import checkpoint_dir, latest_checkpoint  # noqa: PLC0415 (model stack)

    return resume_command(launch.argv) if latest_checkpoint(checkpoint_dir(launch.cfg)) is not None else None


def stopped_report(launch: Launch, signum: int) -> str:
    """What a user needs after Ctrl-C: that it stopped on request, the checkpoint, the resume command."""
    lines = [f"streamrl-launch: stopped on request ({signal_name(signum)})"]
    if not launch.head:
        return lines[0] + "; the head host holds the checkpoint"
    # Lazy: the checkpoint module pulls in the model stack (seconds), needed only after a stop on request.
    from streamrl.learner.run_checkpoint import checkpoint_dir, latest_checkpoint  # noqa: PLC0415

    ckpt = latest_checkpoint(checkpoint_dir(launch.cfg))
    if ckpt is None:
        lines.append(f"  no checkpoint in {checkpoint_dir(launch.cfg)} (checkpoint.save_on_stop = "
                     f"{str(launch.cfg.checkpoint.save_on_stop).lower()}): a new run starts from scratch")
        return "\n".join(lines)
    argv = [a for a in (launch.argv or []) if a != "--resume"]
    lines.append(f"  checkpoint: {ckpt}")
    lines.append(f"  resume:     {shlex.join(['streamrl-launch', *argv, '--resume'])}")
    return "\n".join(lines)


def _processes(launch: Launch, url: str, state: RunState):
    logs = launch.run_dir / "logs"
    learner = None
    if launch.plan.learner is not None:
        learner = ManagedProcess("learner", launch.learner_cmd(url), launch.learner_log,
                                 env={**BASE_ENV, **launch.plan.learner.env})
    ids = state.allocate_worker_ids(len(launch.plan.rollouts)) if launch.plan.rollouts else []
    num_workers = max(state.worker_id_count(), len(ids))
    rollers = [
        ManagedProcess(f"rollout-{wid}", launch.rollout_cmd(url, wid, num_workers, r.device_arg),
                       logs / f"rollout-{wid}.log", env={**BASE_ENV, **r.env},
                       max_restarts=launch.args.max_restarts, backoff_s=launch.args.restart_backoff)
        for wid, r in zip(ids, launch.plan.rollouts)
    ]
    if launch.head and launch.cfg.eval.interval > 0:  # the evaluator: supervised like a worker (restarts, parks)
        rollers.append(ManagedProcess(
            "evaluator", [sys.executable, "-m", "streamrl.workers.evaluator", "--redis-url", url, "--run-id",
                          launch.run_id], logs / "evaluator.log", env=dict(BASE_ENV),
            max_restarts=launch.args.max_restarts, backoff_s=launch.args.restart_backoff, makes_batches=False))
    for role in role_processes(launch.cfg, launch.args.node_rank, url, launch.run_id, launch.bind_host,
                               launch.advertise_host):  # reward/reference/critic servers: supervised like workers
        rollers.append(ManagedProcess(role.name, role.cmd, logs / f"{role.name}.log", env=dict(BASE_ENV),
                                      max_restarts=launch.args.max_restarts, backoff_s=launch.args.restart_backoff,
                                      makes_batches=False))
    return learner, rollers
