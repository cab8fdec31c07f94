"""``streamrl-launch``: one command for the whole run.

    streamrl-launch --config configs/tiny.yaml --learners 2 --rollers 2 --steps 40 --run-dir runs/tiny

Starts (or connects to) Redis, stores the validated config there, starts the learner job
through torch's elastic launcher (``python -m torch.distributed.run``) and the rollout workers
as supervised subprocesses, restarts workers that die (``--max-restarts``, with backoff),
and stops everything when the learner finishes, fails, or on Ctrl-C / SIGTERM.
Exit code: 0 when the learner completed its steps; non-zero naming the part that failed.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from streamrl.config import ConfigError, load_config


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="streamrl-launch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml", help="YAML run config (default: configs/tiny.yaml)")
    p.add_argument("--learners", type=int, default=1, help="learner ranks (torch.distributed world size)")
    p.add_argument("--rollers", type=int, default=1, help="rollout worker processes")
    p.add_argument("--steps", type=int, default=None, help="override run.steps")
    p.add_argument("--run-dir", default=None, help="override run.run_dir")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting an embedded one")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts per rollout worker before giving up")
    p.add_argument("--dry-run", action="store_true", help="print what would start and exit")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. learner.lr=1e-3")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"run.steps={args.steps}")
    if args.run_dir is not None:
        overrides.append(f"run.run_dir={args.run_dir}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"streamrl-launch: {e}", file=sys.stderr)
        return 2
    for flag in ("learners", "rollers"):
        if getattr(args, flag) < 1:
            print(f"streamrl-launch: --{flag} = {getattr(args, flag)}: must be >= 1", file=sys.stderr)
            return 2
    run_dir = Path(cfg.run.run_dir).resolve()
    cfg.run.run_dir = str(run_dir)
    run_id = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    from streamrl.launcher.process import ManagedProcess  # noqa: PLC0415  (fast --help)

    py = sys.executable
    env = {"OMP_NUM_THREADS": "1", "STREAMRL_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def commands(url: str) -> tuple[ManagedProcess, list[ManagedProcess]]:
        learner = ManagedProcess(
            "learner",
            [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.learners}",
             "-m", "streamrl.workers.learner", "--redis-url", url, "--run-id", run_id],
            run_dir / "logs" / "learner.log", env=env)
        rollers = [
            ManagedProcess(f"rollout-{i}",
                           [py, "-m", "streamrl.workers.rollout", "--redis-url", url, "--run-id", run_id,
                            "--worker-id", str(i), "--num-workers", str(args.rollers)],
                           run_dir / "logs" / f"rollout-{i}.log", env=env, max_restarts=args.max_restarts)
            for i in range(args.rollers)
        ]
        return learner, rollers

    if args.dry_run:
        learner, rollers = commands(args.redis_url or "redis://127.0.0.1:<free port>/0 (embedded)")
        print(json.dumps({"run_id": run_id, "run_dir": str(run_dir),
                          "processes": [{"name": p.name, "cmd": p.cmd, "log": str(p.log_path)}
                                        for p in [learner, *rollers]]}, indent=2))
        return 0

    from streamrl.launcher.redis_server import RedisServer  # noqa: PLC0415
    from streamrl.coord.coordinator import Coordinator  # noqa: PLC0415

    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("summary.json", "metrics.jsonl"):
        (run_dir / stale).unlink(missing_ok=True)
    server = None
    if args.redis_url is None:
        server = RedisServer(run_dir / "redis").start()
        url = server.url
    else:
        url = args.redis_url
    coord = Coordinator(url, run_id)
    coord.put_config(cfg.to_dict())
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_id, "redis_url": url}, indent=2))
    learner, rollers = commands(url)
    print(f"streamrl-launch: run {run_id}, {args.learners} learner(s), {args.rollers} roller(s), "
          f"Redis {url}, logs in {run_dir / 'logs'}", flush=True)

    interrupted = []

    def on_signal(signum, frame):
        interrupted.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    failures: list[str] = []
    try:
        learner.start()
        for r in rollers:
            r.start()
        while True:
            if interrupted:
                failures.append(f"interrupted by signal {interrupted[0]}")
                coord.request_stop("interrupted")
                break
            rc = learner.poll()
            if rc is not None:
                if rc != 0:
                    failures.append(f"learner exited with code {rc} (see {learner.log_path})")
                break
            for r in rollers:
                code = r.poll()
                if code is not None and r.proc is not None:
                    if code == 0 or coord.stop_reason() is not None:
                        r.exit_codes.append(code)  # finished with the run: nothing to restart
                        r.proc = None
                        r.max_restarts = r.restarts
                    elif r.schedule_restart():
                        print(f"streamrl-launch: {r.name} exited with {code}; restart {r.restarts}/"
                              f"{r.max_restarts}", flush=True)
                    else:
                        print(f"streamrl-launch: {r.name} exited with {code}; no restarts left", flush=True)
                if r.restart_due():
                    r.start()
            if rollers and all(r.proc is None and not r.restarting for r in rollers) and coord.stop_reason() is None:
                failures.append("all rollout workers failed")
                coord.request_stop("all rollout workers failed")
                break
            time.sleep(0.2)
    finally:
        # Learner first (it writes the summary on a stop request), then the workers.
        try:
            coord.request_stop(coord.stop_reason() or "launcher exiting")
        except Exception:
            pass
        deadline = time.monotonic() + 30
        while learner.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        learner.stop(grace_s=5)
        for r in rollers:
            r.stop(grace_s=10)
        if server:
            server.stop()
        for s, h in old.items():
            signal.signal(s, h)
    summary_path = run_dir / "summary.json"
    print(_exit_report(learner, rollers, summary_path, failures), flush=True)
    if not failures and not summary_path.exists():
        failures.append("learner wrote no summary.json")
    return 1 if failures else 0


def _exit_report(learner, rollers, summary_path: Path, failures: list[str]) -> str:
    lines = ["streamrl-launch: exit summary"]
    for p in [learner, *rollers]:
        codes = p.exit_codes + ([p.proc.returncode] if p.proc is not None else [])
        lines.append(f"  {p.name:<12} exit codes {codes} restarts {p.restarts}  log {p.log_path}")
    if summary_path.exists():
        s = json.loads(summary_path.read_text())
        lines.append(f"  steps {s['steps']} samples {s['samples']} wall {s['wall_s']:.1f}s "
                     f"reward {s['reward_first']} -> {s['reward_last']}  ({summary_path})")
    lines += [f"  FAILED: {f}" for f in failures] or ["  OK"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
