"""Launch-level state in Redis: how the hosts of one run find and follow each other.

Every host runs its own ``streamrl-launch``; they share nothing but Redis and the run id.
The head (the host with learner rank 0) resets the run's namespace, stores the config and,
at the very end, marks the run done. Other hosts wait for the config, take worker ids
from a counter (ids stay unique however many hosts join), and restart their workers when
the head restarts the learner (the ``epoch`` counter).

Keys, all under the run's namespace ``streamrl:<run>:launch:``: ``worker_ids`` (counter),
``epoch`` (learner incarnation), ``done`` (final reason), ``hosts`` (hash host -> state),
``stuck`` (hash process -> JSON of the last stall the launcher acted on: phase, since, why).
"""
from __future__ import annotations

import time
from urllib.parse import urlparse

from streamrl.coord.coordinator import Coordinator, redact

LOOPBACK = {"127.0.0.1", "localhost", "::1", "0:0:0:0:0:0:0:1"}


class LaunchError(ValueError):
    """A launch request cannot be carried out; the one-line message names the flag or value."""


def redis_host_of(url: str) -> str:
    return urlparse(url).hostname or ""


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


def check_redis_url(url: str) -> None:
    """A Redis that other hosts can reach must require a password."""
    u = urlparse(url)
    if u.scheme not in ("redis", "rediss", "unix"):
        raise LaunchError(f"--redis-url {url!r}: expected redis://[:PASSWORD@]HOST:PORT/DB")
    if u.scheme != "unix" and not is_loopback(u.hostname or "") and not u.password:
        raise LaunchError(f"--redis-url {redact(url)}: a Redis reachable from other hosts must require a password "
                          f"(redis://:PASSWORD@{u.hostname}:{u.port or 6379}/0)")


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


class RunState:
    """Launch-level keys of one run (see module docstring)."""

    def __init__(self, coord: Coordinator, run_id: str):
        self.coord = coord
        self.r = coord.r
        self.run_id = run_id
        self.prefix = f"streamrl:{run_id}:"

    def key(self, name: str) -> str:
        return f"{self.prefix}launch:{name}"

    def reset_namespace(self) -> int:
        """Delete every key of the run (a re-used run id starts clean). Head only, before put_config."""
        n = 0
        for k in self.r.scan_iter(match=_glob_escape(self.prefix) + "*", count=500):
            n += self.r.delete(k)
        return n

    def clear_stop(self) -> None:
        """Before a learner restart: the old learner's stop flag must not stop the new one."""
        self.r.delete(self.coord.keys.stop)

    # -- worker ids, epochs, completion -----------------------------------------------------
    def allocate_worker_ids(self, n: int) -> list[int]:
        end = int(self.r.incrby(self.key("worker_ids"), n))
        return list(range(end - n, end))

    def worker_id_count(self) -> int:
        return int(self.r.get(self.key("worker_ids")) or 0)

    def epoch(self) -> int:
        return int(self.r.get(self.key("epoch")) or 0)

    def bump_epoch(self) -> int:
        return int(self.r.incr(self.key("epoch")))

    def set_done(self, reason: str) -> None:
        self.r.set(self.key("done"), reason)

    def done(self) -> str | None:
        return self.r.get(self.key("done"))

    def set_host(self, host: str, state: str) -> None:
        self.r.hset(self.key("hosts"), host, state)

    def hosts(self) -> dict[str, str]:
        return self.r.hgetall(self.key("hosts"))

    def record_stuck(self, process: str, report: str) -> None:
        """Store the stall the launcher acted on for ``process`` (JSON), for ``streamrl-monitor``."""
        self.r.hset(self.coord.keys.stuck, process, report)

    def stuck(self) -> dict[str, str]:
        """``process -> JSON`` of the last stall acted on per process."""
        return self.r.hgetall(self.coord.keys.stuck)

    def wait_for_run(self, timeout_s: float, poll_s: float = 0.2) -> dict:
        """Non-head hosts: wait until the head stored the config of a live run; return it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            cfg = self.coord.get_config()
            if cfg is not None and self.done() is None:
                return cfg
            time.sleep(poll_s)
        raise LaunchError(f"run {self.run_id!r}: no live run appeared in Redis within {timeout_s:.0f} s "
                          f"(start the learner host, or check --run-id / --redis-url)")

    def wait_hosts_exited(self, timeout_s: float, me: str) -> list[str]:
        """Head: give other hosts time to notice ``done`` before an embedded Redis goes away."""
        deadline = time.monotonic() + timeout_s
        while True:
            running = [h for h, s in self.hosts().items() if s == "running" and h != me]
            if not running or time.monotonic() >= deadline:
                return running
            time.sleep(0.2)
