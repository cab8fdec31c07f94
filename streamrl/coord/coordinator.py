"""Coordinator: typed operations on a run's Redis control plane.

All processes talk to Redis only through this class. Connections retry with bounded
exponential backoff (redis-py ``Retry``), so a Redis restart costs a pause, not a crash.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from streamrl.coord.keys import Keys

log = logging.getLogger(__name__)

# Atomic admission control (AReaL-style capacity): a worker may reserve ``n`` prompt groups
# only while reserved - refunded + n <= (version + max_staleness + 1) * groups_per_step.
# So no worker runs more than max_staleness versions ahead of what the learner accepts.
_RESERVE = """
local reserved = tonumber(redis.call('GET', KEYS[1]) or '0')
local refunded = tonumber(redis.call('GET', KEYS[2]) or '0')
local version = tonumber(redis.call('GET', KEYS[3]) or '-1')
if version < 0 then return -1 end
local limit = (version + tonumber(ARGV[2]) + 1) * tonumber(ARGV[3])
if reserved - refunded + tonumber(ARGV[1]) > limit then return 0 end
redis.call('INCRBY', KEYS[1], ARGV[1])
return 1
"""


def connect(url: str, retries: int = 8) -> redis.Redis:
    """A Redis client that retries connection errors with backoff capped at 2 s."""
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_connect_timeout=2.0,
        socket_timeout=5.0,
        health_check_interval=10,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


class Coordinator:
    """Run-scoped control-plane operations (versions, endpoints, heartbeats, capacity, stop)."""

    def __init__(self, url: str, run: str):
        self.url = url
        self.keys = Keys(run)
        self.r = connect(url)
        self._reserve = self.r.register_script(_RESERVE)

    # -- run metadata -------------------------------------------------------------------
    def put_config(self, cfg: dict[str, Any]) -> None:
        self.r.set(self.keys.config, json.dumps(cfg))

    def get_config(self) -> dict[str, Any] | None:
        raw = self.r.get(self.keys.config)
        return json.loads(raw) if raw else None

    # -- weights versions ------------------------------------------------------------------
    def publish_version(self, version: int, manifest: dict[str, Any], keep: int = 3) -> None:
        """Store the manifest, advance the version, notify subscribers, expire old manifests."""
        pipe = self.r.pipeline()
        pipe.set(self.keys.manifest(version), json.dumps(manifest))
        pipe.set(self.keys.version, version)
        pipe.publish(self.keys.weights_channel, str(version))
        if version - keep >= 0:
            pipe.delete(self.keys.manifest(version - keep))
        pipe.execute()

    def current_version(self) -> int:
        raw = self.r.get(self.keys.version)
        return int(raw) if raw is not None else -1

    def manifest(self, version: int) -> dict[str, Any] | None:
        raw = self.r.get(self.keys.manifest(version))
        return json.loads(raw) if raw else None

    def ack(self, worker_id: int, version: int) -> None:
        self.r.hset(self.keys.acks, str(worker_id), version)

    def acks(self) -> dict[int, int]:
        return {int(k): int(v) for k, v in self.r.hgetall(self.keys.acks).items()}

    # -- endpoints ---------------------------------------------------------------------------
    def set_endpoint(self, name: str, endpoint: str) -> None:
        self.r.set(self.keys.endpoint(name), endpoint)

    def wait_endpoint(self, name: str, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ep = self.r.get(self.keys.endpoint(name))
            if ep:
                return ep
            if self.stop_reason() is not None:
                raise RuntimeError(f"run stopped before endpoint {name!r} appeared")
            time.sleep(0.1)
        raise TimeoutError(f"endpoint {name!r} not published in Redis within {timeout_s:.0f} s")

    # -- workers -----------------------------------------------------------------------------
    def heartbeat(self, worker_id: int, status: dict[str, Any], ttl_s: float = 10.0) -> None:
        pipe = self.r.pipeline()
        pipe.sadd(self.keys.workers, worker_id)
        pipe.set(self.keys.heartbeat(worker_id), json.dumps({**status, "time": time.time()}), px=int(ttl_s * 1000))
        pipe.execute()

    def workers(self) -> dict[int, dict[str, Any] | None]:
        """Every registered worker with its last heartbeat (None once the TTL expired)."""
        ids = sorted(int(w) for w in self.r.smembers(self.keys.workers))
        if not ids:
            return {}
        raws = self.r.mget([self.keys.heartbeat(w) for w in ids])
        return {w: (json.loads(raw) if raw else None) for w, raw in zip(ids, raws)}

    # -- admission control ---------------------------------------------------------------
    def try_reserve(self, groups: int, max_staleness: int, groups_per_step: int) -> bool:
        """Reserve ``groups`` prompt groups if the staleness budget allows it."""
        res = self._reserve(
            keys=[self.keys.reserved, self.keys.refunded, self.keys.version],
            args=[groups, max_staleness, groups_per_step],
        )
        return int(res) == 1

    def refund(self, groups: int) -> None:
        """Give back reservations whose groups will never be trained (dropped, abandoned)."""
        if groups > 0:
            self.r.incrby(self.keys.refunded, groups)

    # -- control -----------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        self.r.set(self.keys.stop, reason)

    def stop_reason(self) -> str | None:
        return self.r.get(self.keys.stop)

    # -- metrics -------------------------------------------------------------------------------
    def put_metrics(self, process: str, metrics: dict[str, float], stream_maxlen: int = 2000) -> None:
        """Latest metrics per process (hash) plus a capped, timestamped stream for history."""
        payload = {k: float(v) for k, v in metrics.items()}
        payload["time"] = time.time()
        pipe = self.r.pipeline()
        pipe.sadd(self.keys.processes, process)
        pipe.hset(self.keys.metrics(process), mapping=payload)
        pipe.xadd(self.keys.metrics_stream, {"process": process, "data": json.dumps(payload)},
                  maxlen=stream_maxlen, approximate=True)
        pipe.execute()

    def latest_metrics(self) -> dict[str, dict[str, float]]:
        procs = sorted(self.r.smembers(self.keys.processes))
        out = {}
        for p in procs:
            out[p] = {k: float(v) for k, v in self.r.hgetall(self.keys.metrics(p)).items()}
        return out

    def close(self) -> None:
        self.r.close()
