"""Read a run's live state from Redis for the monitor: cheap, bounded, never hanging.

:class:`RunSource` finds the run (explicit id, ``run.json`` in a run directory, or the
newest run in Redis), keeps a bounded local history of the metrics stream (read
incrementally: each refresh fetches only entries newer than the last one seen), and reads
the small per-refresh state (version, heartbeats, incarnations, stop reason).

Every Redis call uses short socket timeouts and no retry loop, so a dead Redis costs one
refresh ~1 s and raises :class:`RedisUnavailable` with a message that says what to do.
"""
from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from streamrl.coord.keys import Keys

# Bounds on what one refresh reads; the stream itself is capped by the writers.
FIRST_READ_MAX = 2000
INCREMENT_MAX = 1000
FALLBACK_READ = 50


class RedisUnavailable(RuntimeError):
    """Redis could not be reached (down, wrong URL, or the run's embedded Redis has exited)."""


class RunNotFound(RuntimeError):
    """Redis is up but holds no StreamRL run (or not the one asked for)."""


def resolve_target(run_dir: str | None, redis_url: str | None, run_id: str | None) -> tuple[str, str | None]:
    """(redis_url, run_id or None) from the CLI arguments; ``run.json`` fills the gaps.

    Raises ValueError naming the argument when neither a URL nor a readable run dir is given.
    """
    if run_dir is not None:
        path = Path(run_dir)
        meta_path = path / "run.json" if path.is_dir() else path
        if not meta_path.is_file():
            raise ValueError(f"run dir {run_dir!r}: no run.json there (written by streamrl-launch)")
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"run dir {run_dir!r}: run.json is not valid JSON ({e})") from e
        redis_url = redis_url or meta.get("redis_url")
        run_id = run_id or meta.get("run_id")
    if not redis_url:
        raise ValueError("--redis-url: required when no run directory is given")
    return redis_url, run_id


def connect_fast(url: str, timeout_s: float = 1.0) -> redis.Redis:
    """A client that fails fast (no retry loop): the monitor reports outages, it does not wait them out."""
    return redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=timeout_s,
                                socket_timeout=timeout_s, retry_on_timeout=False)


def list_runs(r: redis.Redis) -> dict[str, float]:
    """{run_id: last activity (unix s)} for every run with a config in this Redis."""
    runs: dict[str, float] = {}
    for key in r.scan_iter(match="streamrl:*:config", count=500):
        run = key[len("streamrl:"):-len(":config")]
        last = r.xrevrange(Keys(run).metrics_stream, count=1)
        runs[run] = int(last[0][0].split("-")[0]) / 1000 if last else 0.0
    return runs


def newest_run(r: redis.Redis) -> str:
    """The run with the most recent metrics (ties: the greatest id, which embeds the start time)."""
    runs = list_runs(r)
    if not runs:
        raise RunNotFound("no StreamRL run in this Redis (no streamrl:*:config key)")
    return max(runs, key=lambda k: (runs[k], k))


@dataclass
class State:
    """What one refresh read (besides the stream history)."""

    time: float
    version: int
    stop: str | None
    heartbeats: dict[int, dict[str, Any] | None]
    incarnations: dict[int, int]
    latest: dict[str, dict[str, float]] = field(default_factory=dict)
    weight_timings: dict[int, dict[str, float]] = field(default_factory=dict)  # worker -> last fetch stages
    config: dict[str, Any] = field(default_factory=dict)  # the run's stored config (read once)
    stuck: dict[str, dict[str, Any]] = field(default_factory=dict)  # process -> last stall a launcher acted on


class RunSource:
    """Live view of one run. ``history[process]`` is a deque of metric dicts (with ``time``)."""

    def __init__(self, redis_url: str, run_id: str | None = None, horizon_s: float = 300.0):
        self.url = redis_url
        self.requested_run = run_id
        self.run_id = run_id
        self.horizon_s = horizon_s
        self.history: dict[str, deque[dict[str, float]]] = {}
        self._last_id = None
        self._r = connect_fast(redis_url)
        self._config: dict[str, Any] | None = None

    @property
    def keys(self) -> Keys:
        return Keys(self.run_id)

    def refresh(self) -> State:
        """Read new stream entries and the current state. Raises RedisUnavailable / RunNotFound."""
        try:
            return self._refresh()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            raise RedisUnavailable(f"Redis at {self.url} unreachable: {e}") from e

    def _refresh(self) -> State:
        if self.run_id is None:
            self.run_id = newest_run(self._r)
        k = self.keys
        if self._last_id is None and not self._r.exists(k.config):
            raise RunNotFound(f"run {self.run_id!r} not found in Redis at {self.url}")
        self._read_stream()
        ids = sorted(int(w) for w in self._r.smembers(k.workers))
        pipe = self._r.pipeline(transaction=False)
        pipe.get(k.version)
        pipe.get(k.stop)
        pipe.smembers(k.processes)
        pipe.hgetall(k.stuck)
        for w in ids:
            pipe.get(k.heartbeat(w))
            pipe.get(k.incarnation(w))
        res = pipe.execute()
        version = int(res[0]) if res[0] is not None else -1
        stop, procs = res[1], sorted(res[2])
        stuck = {p: _json_or_none(v) or {} for p, v in res[3].items()}
        heartbeats, incarnations = {}, {}
        for i, w in enumerate(ids):
            hb, inc = res[4 + 2 * i], res[5 + 2 * i]
            heartbeats[w] = _json_or_none(hb)
            incarnations[w] = int(inc) if inc else 0
        timings_key = getattr(k, "weights_timings", None)  # schema of streamrl.weights, when present
        pipe = self._r.pipeline(transaction=False)
        for p in procs:
            pipe.hgetall(k.metrics(p))
        for w in ids if timings_key else []:
            pipe.hgetall(timings_key(w))
        res = pipe.execute()
        latest = {p: _floats(h) for p, h in zip(procs, res)}
        timings = {w: _floats(h) for w, h in zip(ids, res[len(procs):]) if h}
        if self._config is None:  # the config does not change during a run: one read
            self._config = _json_or_none(self._r.get(k.config)) or {}
        return State(time=time.time(), version=version, stop=stop, heartbeats=heartbeats,
                     incarnations=incarnations, latest=latest, weight_timings=timings, config=self._config,
                     stuck=stuck)

    def _read_stream(self) -> None:
        k = self.keys
        if self._last_id is None:
            # Only the horizon; if the clocks disagree (or the run ended long ago), the last few.
            since = f"{int((time.time() - self.horizon_s) * 1000)}"
            entries = self._r.xrevrange(k.metrics_stream, min=since, count=FIRST_READ_MAX) \
                or self._r.xrevrange(k.metrics_stream, count=FALLBACK_READ)
            entries = list(reversed(entries))
        else:
            entries = self._r.xrange(k.metrics_stream, min=f"({self._last_id}", count=INCREMENT_MAX)
        if entries:
            self._last_id = entries[-1][0]
        elif self._last_id is None:
            self._last_id = "0-0"
        for _, fields in entries:
            try:
                data = _floats(json.loads(fields["data"]))
            except (KeyError, ValueError, TypeError):
                continue  # a malformed entry is skipped, not fatal
            self.history.setdefault(fields.get("process", "?"), deque()).append(data)
        cutoff = time.time() - self.horizon_s
        for d in self.history.values():
            while len(d) > 1 and d[0].get("time", 0.0) < cutoff:
                d.popleft()

    def close(self) -> None:
        self._r.close()


def _json_or_none(raw: str | None) -> dict | None:
    """A heartbeat's JSON; a malformed one counts as no heartbeat (the monitor must not crash)."""
    if not raw:
        return None
    try:
        out = json.loads(raw)
    except ValueError:
        return None
    return out if isinstance(out, dict) else None


def _floats(d: dict) -> dict[str, float]:
    out = {}
    for key, v in d.items():
        try:
            out[key] = float(v)
        except (TypeError, ValueError):
            continue
    return out
