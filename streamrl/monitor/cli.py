"""``streamrl-monitor``: live terminal view of a run (or one JSON snapshot for scripts).

    streamrl-monitor runs/demo                      # finds Redis and the run id in run.json
    streamrl-monitor --redis-url redis://host:6379/0            # newest run in that Redis
    streamrl-monitor runs/demo --once --json        # one snapshot, machine-readable

It never crashes or hangs on a dead Redis or a finished run: the live view says so and
keeps trying every refresh; ``--once`` exits with code 2 (Redis unreachable) or 3 (no such
run) and a one-line message on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from streamrl.monitor.snapshot import SnapshotBuilder, Thresholds

# The redis client (streamrl.monitor.source) and rich (the terminal UI) are imported where they
# are used: together they take several times longer to import than `--help` takes to answer.

EXIT_REDIS_DOWN = 2
EXIT_NO_RUN = 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="streamrl-monitor", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("run_dir", nargs="?", help="run directory with run.json (written by streamrl-launch)")
    p.add_argument("--redis-url", help="Redis of the run (default: from RUN_DIR/run.json)")
    p.add_argument("--run-id", help="run id (default: from run.json, else the newest run in Redis)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="JSON instead of the terminal UI (one line per refresh)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--window", type=float, default=10.0, help="seconds over which rates are computed (default 10)")
    p.add_argument("--iterations", type=int, default=0, help="stop after this many refreshes (0 = until Ctrl-C)")
    p.add_argument("--entropy-warn", type=float, default=0.5, help="MoE router entropy (normalised) warn below")
    p.add_argument("--entropy-bad", type=float, default=0.25, help="MoE router entropy bad below")
    p.add_argument("--usage-std-warn", type=float, default=0.5, help="MoE expert-usage std warn above")
    p.add_argument("--usage-std-bad", type=float, default=1.0, help="MoE expert-usage std bad above")
    p.add_argument("--stale-after", type=float, default=3.0, help="heartbeat older than this = stale (s)")
    args = p.parse_args(argv)
    for name in ("interval", "window", "stale_after"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} = {getattr(args, name)}: must be > 0")
    return args


def _builder(args) -> SnapshotBuilder:
    th = Thresholds(entropy_warn=args.entropy_warn, entropy_bad=args.entropy_bad,
                    usage_std_warn=args.usage_std_warn, usage_std_bad=args.usage_std_bad,
                    stale_heartbeat_s=args.stale_after)
    return SnapshotBuilder(window_s=args.window, thresholds=th)


def take_snapshot(source, builder) -> dict:
    """One refresh of ``source`` turned into a snapshot (raises the source's errors)."""
    state = source.refresh()
    return builder.build(source.run_id, {p: list(h) for p, h in source.history.items()}, state)


def _explain(error: Exception, run_dir: str | None) -> str:
    msg = str(error)
    if run_dir and (Path(run_dir) / "summary.json").exists():
        msg += " — the run has ended (summary.json exists; see streamrl-report)"
    return msg


def main(argv=None) -> int:
    args = parse_args(argv)
    from streamrl.monitor.source import (RedisUnavailable, RunNotFound, RunSource,  # noqa: PLC0415 (lazy: redis)
                                         resolve_target)

    try:
        url, run_id = resolve_target(args.run_dir, args.redis_url, args.run_id)
    except ValueError as e:
        print(f"streamrl-monitor: {e}", file=sys.stderr)
        return 2
    source = RunSource(url, run_id)
    builder = _builder(args)
    if args.once:
        try:
            snap = take_snapshot(source, builder)
        except RedisUnavailable as e:
            print(f"streamrl-monitor: {_explain(e, args.run_dir)}", file=sys.stderr)
            return EXIT_REDIS_DOWN
        except RunNotFound as e:
            print(f"streamrl-monitor: {e}", file=sys.stderr)
            return EXIT_NO_RUN
        if args.json:
            print(json.dumps(snap))
        else:
            from rich.console import Console  # noqa: PLC0415 (lazy: rich)
            from streamrl.monitor.ui import render  # noqa: PLC0415
            Console().print(render(snap, url))
        return 0
    return _loop(args, source, builder, url)


def _loop(args, source, builder, url) -> int:
    from streamrl.monitor.source import RedisUnavailable, RunNotFound  # noqa: PLC0415 (lazy: redis)

    snap, error, n = None, None, 0

    def step():
        nonlocal snap, error
        try:
            snap, error = take_snapshot(source, builder), None
        except RedisUnavailable as e:
            error = f"{_explain(e, args.run_dir)}; retrying every {args.interval:g} s"
        except RunNotFound as e:
            error = f"{e}; retrying every {args.interval:g} s"
        except Exception as e:  # odd data in Redis must not kill a monitor someone relies on
            error = f"could not build a snapshot ({type(e).__name__}: {e}); retrying every {args.interval:g} s"

    try:
        if args.json:
            while True:
                step()
                print(json.dumps(snap if error is None else {"error": error}), flush=True)
                n += 1
                if args.iterations and n >= args.iterations:
                    return 0
                time.sleep(args.interval)
        from rich.console import Console  # noqa: PLC0415 (lazy: rich)
        from rich.live import Live  # noqa: PLC0415
        from streamrl.monitor.ui import render  # noqa: PLC0415

        with Live(render(None, url), console=Console(), auto_refresh=False, screen=False) as live:
            while True:
                t0 = time.monotonic()
                step()
                live.update(render(snap, url, error), refresh=True)
                n += 1
                if args.iterations and n >= args.iterations:
                    return 0
                time.sleep(max(0.0, args.interval - (time.monotonic() - t0)))
    except KeyboardInterrupt:
        return 0
    finally:
        source.close()


if __name__ == "__main__":
    sys.exit(main())
