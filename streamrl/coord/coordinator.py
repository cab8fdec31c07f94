"""Coordinator: typed operations on a run's Redis control plane.

All processes talk to Redis only through this class. Connections retry with bounded
exponential backoff for up to ``OUTAGE_S`` (:class:`OutageRetry`, one log line when Redis goes
away and one when it is back), so a Redis restart costs a pause, not a crash. The embedded
Redis keeps nothing across a restart: owners re-assert their keys (the learner: config,
endpoint, version + manifest and its tensor table, capacity; see ``reassert_version`` and
``set_capacity``).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable
from urllib.parse import urlparse

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from streamrl.coord.keys import Keys
from streamrl.coord.overlap import OverlappedScript
from streamrl.weights.manifest import TABLE_REF, Table, decode_table

log = logging.getLogger(__name__)

# Atomic admission control (AReaL-style capacity): a worker may reserve ``n`` prompt groups
# only while reserved - refunded + n <= (version + bound + 1) * groups_per_step, where bound is
# min(the bound the learner publishes (adaptive staleness), the worker's max_staleness); no
# published bound = the worker's. So no worker runs more than bound versions ahead of the learner.
# KEYS = reserved, refunded, version, staleness bound; ARGV = groups, max_staleness, groups_per_step,
# "1" for all or nothing (a batch) or "0" for as many as fit, up to groups (a stream's free slots).
# Returns the groups reserved, or -1 when none were (refused, or no version published yet).
_RESERVE = """
local reserved = tonumber(redis.call('GET', KEYS[1]) or '0')
local refunded = tonumber(redis.call('GET', KEYS[2]) or '0')
local version = tonumber(redis.call('GET', KEYS[3]) or '-1')
if version < 0 then return -1 end
local bound = tonumber(ARGV[2])
local published = tonumber(redis.call('GET', KEYS[4]) or '')
if published ~= nil and published < bound then bound = published end
local room = (version + bound + 1) * tonumber(ARGV[3]) - (reserved - refunded)
local n = tonumber(ARGV[1])
if n > room then
  if ARGV[4] == '1' or room <= 0 then return -1 end
  n = room
end
redis.call('INCRBY', KEYS[1], n)
return n
"""


# How long one Redis call keeps retrying a lost connection before it raises (bounded: no
# process hangs forever on a dead Redis), and long enough to ride out a restart of Redis.
OUTAGE_S = 60.0
# How long a starting process waits for the run's config in Redis (before it has read any deadline).
CONFIG_WAIT_S = 60.0


class OutageRetry(Retry):
    """redis-py ``Retry`` bounded by time (``outage_s``), with one log line per outage.

    redis-py calls ``call_with_retry`` around every command; on connection errors we back off
    exponentially (capped at 2 s) until ``outage_s`` has passed, then raise. The first failure
    logs one WARNING ("unreachable ... retrying"), the first success after it one INFO
    ("reachable again"), so a restart shows up as exactly two lines per process.
    """

    def __init__(self, url: str, outage_s: float = OUTAGE_S):
        super().__init__(ExponentialBackoff(cap=2.0, base=0.05), -1,
                         (redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError, OSError))
        self.where = redact(url)
        self.outage_s = outage_s
        self.down_since: float | None = None
        self.outages = 0

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        self._backoff.reset()
        failures = 0
        while True:
            try:
                out = do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                fail(error, failures) if with_failure_count else fail(error)
                now = time.monotonic()
                if self.down_since is None:
                    self.down_since = now
                    self.outages += 1
                    log.warning("Redis %s unreachable (%s); retrying with backoff for up to %.0f s",
                                self.where, error, self.outage_s)
                if now - self.down_since > self.outage_s:
                    raise
                time.sleep(self._backoff.compute(failures))
                continue
            if self.down_since is not None:
                log.warning("Redis %s reachable again after %.1f s", self.where, time.monotonic() - self.down_since)
                self.down_since = None
            return out


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs and --dry-run output)."""
    u = urlparse(url)
    return url.replace(f":{u.password}@", ":***@", 1) if u.password else url


_MAX_SET = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) > cur then redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"""


# Tensor tables live as long as a retained version names them: the tables zset scores each table by the
# newest version whose manifest names it, so a table scored below the oldest retained version is named
# by none and is deleted. (A new layout's table is stored again by the publish that needs it.)
_DROP_TABLES = """
local function drop_tables(versions, tables, prefix)
  local oldest = redis.call('ZRANGE', versions, 0, 0, 'WITHSCORES')[2]
  if oldest == nil then return end
  for _, digest in ipairs(redis.call('ZRANGEBYSCORE', tables, '-inf', '(' .. oldest)) do
    redis.call('DEL', prefix .. digest)
  end
  redis.call('ZREMRANGEBYSCORE', tables, '-inf', '(' .. oldest)
end
"""
# publish_version: KEYS = manifest(v), version, versions zset, the manifest's tensor table (the manifest
# key again when it has none), tables zset[, manifest(v - keep), buckets(v - keep)]; ARGV = manifest
# JSON, v, channel, keep, the table's digest ("" when the manifest names none), the table key prefix
# [, v - keep, "0" when v - keep named v's table (no table loses its last version: drop_tables is
# skipped, three commands of the script's twelve) else "1"]. Returns -1, having written nothing, when
# the named table is not in Redis; else the versions still beyond ``keep`` after that.
_PUBLISH = _DROP_TABLES + """
local digest = ARGV[5]
if digest ~= '' and redis.call('EXISTS', KEYS[4]) == 0 then return -1 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[2])
if digest ~= '' then redis.call('ZADD', KEYS[5], 'GT', ARGV[2], digest) end
redis.call('PUBLISH', ARGV[3], ARGV[2])
if #KEYS > 5 then
  redis.call('DEL', KEYS[6], KEYS[7])
  redis.call('ZREM', KEYS[3], ARGV[7])
  if ARGV[8] == '1' then drop_tables(KEYS[3], KEYS[5], ARGV[6]) end
end
return redis.call('ZRANGE', KEYS[3], 0, -(tonumber(ARGV[4]) + 1))
"""
# gc_versions: KEYS = versions zset, tables zset; ARGV = the table key prefix.
_GC_TABLES = _DROP_TABLES + "drop_tables(KEYS[1], KEYS[2], ARGV[1])"
# Tensor tables a reader keeps decoded (one per layout; a run has one or a few).
TABLE_CACHE = 8


def connect(url: str, outage_s: float = OUTAGE_S) -> redis.Redis:
    """A Redis client that survives Redis restarts of up to ``outage_s`` (see :class:`OutageRetry`)."""
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_connect_timeout=2.0,
        socket_timeout=5.0,
        health_check_interval=10,
        retry=OutageRetry(url, outage_s),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


class Coordinator:
    """Run-scoped control-plane operations (versions, endpoints, heartbeats, capacity, stop)."""

    def __init__(self, url: str, run: str, outage_s: float = OUTAGE_S):
        self.url = url
        self.keys = Keys(run)
        self.r = connect(url, outage_s)
        self._reserve = self.r.register_script(_RESERVE)
        self._max_set = self.r.register_script(_MAX_SET)
        self._publish = self.r.register_script(_PUBLISH)
        self._publish_overlapped = OverlappedScript(self.r, self._publish)  # publish_version's ``meanwhile``
        self._gc_tables = self.r.register_script(_GC_TABLES)
        self.last_published: tuple[int, dict[str, Any]] | None = None
        """(version, manifest) of the newest :meth:`publish_version` call, for :meth:`reassert_version`."""
        self._last_stored: tuple[str, Table | None] | None = None  # that manifest as stored, and its table
        self._named_tables: dict[int, str] = {}  # retained versions this coordinator published -> table digest
        self._tables: dict[str, list] = {}  # digest -> decoded tensor table (checked once), oldest first
        self._tables_lock = threading.Lock()  # a subscriber and its collective receiver thread share it

    def set_outage_s(self, outage_s: float) -> None:
        """Bound each Redis call's retries of a lost connection by ``outage_s`` from now on (the run
        config's ``deadlines.redis_outage_s``, known only after the config was read from Redis)."""
        self.r.set_retry(OutageRetry(self.url, outage_s))

    # -- run metadata -------------------------------------------------------------------
    def put_config(self, cfg: dict[str, Any]) -> None:
        self.r.set(self.keys.config, json.dumps(cfg))

    def get_config(self) -> dict[str, Any] | None:
        raw = self.r.get(self.keys.config)
        return json.loads(raw) if raw else None

    def wait_config(self, timeout_s: float = CONFIG_WAIT_S) -> dict[str, Any]:
        """The run's stored config, waiting for it: a process that starts while an embedded Redis
        restarts empty finds no config until the launcher re-stores it (within a second or two)."""
        deadline = time.monotonic() + timeout_s
        while (stored := self.get_config()) is None:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no config in Redis for run {self.keys.run} within {timeout_s:.0f} s "
                                   f"(the launcher stores it before it starts any process)")
            time.sleep(0.1)
        return stored

    # -- weights versions ------------------------------------------------------------------
    def publish_version(self, version: int, manifest: dict[str, Any], keep: int = 3,
                        encoded: str | None = None, table: Table | None = None,
                        meanwhile: Callable[[], Any] | None = None) -> None:
        """Store the manifest, advance the version, notify subscribers, expire old versions.

        One Lua script, so one command and one reply, and atomic: nobody sees the version
        advanced without its manifest. In the steady state (versions one apart) only
        ``version - keep`` expires, in the same script; :meth:`gc_versions` runs only when the
        script finds more. ``encoded``: ``manifest`` as JSON, when the caller has it;
        ``table``: the tensor table ``encoded`` names by digest instead of holding it
        (:class:`~streamrl.weights.manifest.ManifestJSON`). The script refuses a manifest whose
        table is not in Redis (the layout's first version, or Redis lost its state): the table is
        stored then and the script run again, so a stored manifest's table is always there. A table
        lives as long as a retained version names it: expiring versions deletes the tables only
        they named (``_DROP_TABLES``). ``meanwhile``: work run once while Redis runs the script
        (:class:`~streamrl.coord.overlap.OverlappedScript`), such as the store's GC.
        """
        k, named = self.keys, self._named_tables
        digest = table.digest if table is not None else ""
        keys = [k.manifest(version), k.version, k.weights_versions,
                k.weights_table(digest) if digest else k.manifest(version), k.weights_tables]
        text = encoded if encoded is not None else json.dumps(manifest)
        args = [text, version, k.weights_channel, keep, digest, k.weights_table("")]
        if version - keep >= 0:
            keys += [k.manifest(version - keep), k.weights_buckets(version - keep)]
            same = digest != "" and named.get(version - keep) == digest  # known only for our own versions
            args += [version - keep, "0" if same else "1"]
        if meanwhile is None:
            stale = self._publish(keys=keys, args=args)
        else:
            stale = self._publish_overlapped(keys, args, meanwhile)
        if stale == -1:
            self.r.set(k.weights_table(table.digest), table.text)
            stale = self._publish(keys=keys, args=args)
        self.last_published = (version, manifest)
        self._last_stored = (text, table)
        named[version] = digest
        for v in [v for v in named if v <= version - keep]:
            del named[v]
        if stale:  # versions not one apart, or left by an earlier incarnation of the run
            self.gc_versions(keep)

    def wake_for_publish(self) -> None:
        """Wake Redis for a :meth:`publish_version` with ``meanwhile`` to follow: a PING sent now on
        the announcement's connection, its reply read with the script's
        (:meth:`~streamrl.coord.overlap.OverlappedScript.wake`)."""
        self._publish_overlapped.wake()

    def reassert_version(self) -> bool:
        """Write the newest published version and its manifest again (after Redis lost its state:
        the embedded Redis has no persistence). True when there was one to write."""
        if self.last_published is None:
            return False
        version, manifest = self.last_published
        text, table = self._last_stored or (json.dumps(manifest), None)
        pipe = self.r.pipeline()
        if table is not None:  # before the manifest that names it (MULTI/EXEC: atomic anyway)
            pipe.set(self.keys.weights_table(table.digest), table.text)
            pipe.zadd(self.keys.weights_tables, {table.digest: version}, gt=True)
        pipe.set(self.keys.manifest(version), text)
        pipe.zadd(self.keys.weights_versions, {str(version): version})
        pipe.set(self.keys.version, version)
        pipe.publish(self.keys.weights_channel, str(version))
        pipe.execute()
        return True

    def current_version(self) -> int:
        raw = self.r.get(self.keys.version)
        return int(raw) if raw is not None else -1

    def manifest(self, version: int) -> dict[str, Any] | None:
        """The manifest of ``version`` (None: not in Redis), with its tensor table under
        ``"tensors"`` also when it was stored by digest (the table is shared between the
        manifests of a layout: read-only). Raises ValueError when a stored table does not match
        its digest."""
        raw = self.r.get(self.keys.manifest(version))
        if not raw:
            return None
        manifest = json.loads(raw)
        if not isinstance(manifest, dict) or TABLE_REF not in manifest:
            return manifest
        table = self._table(manifest.pop(TABLE_REF))
        if table is None:
            return None
        manifest["tensors"] = table
        return manifest

    def _table(self, digest: Any) -> list | None:
        """The tensor table stored under ``digest``: read, checked and decoded once, then cached.
        None when it is not in Redis (gone with a Redis restart, until the learner re-asserts)."""
        table = self._tables.get(digest) if isinstance(digest, str) else None
        if table is not None:
            return table
        if not isinstance(digest, str):
            return decode_table(digest, "")  # raises, naming the field
        text = self.r.get(self.keys.weights_table(digest))
        if text is None:
            log.warning("weights tensor table %s... is not in Redis (its versions expired, or Redis lost its "
                        "state); its versions are unavailable until the learner stores it again", digest[:16])
            return None
        table = decode_table(digest, text)
        with self._tables_lock:
            self._tables[digest] = table
            while len(self._tables) > TABLE_CACHE:
                del self._tables[next(iter(self._tables))]
        return table

    # -- weights: streaming publication, GC, waiting (used by streamrl.weights) -------------
    def begin_version(self, version: int, manifest: dict[str, Any]) -> None:
        """Announce a version whose buckets are being written (``manifest["state"] == "writing"``).

        ``current_version`` does not move: late joiners and pollers only ever see complete
        versions. Streaming subscribers read bucket events with :meth:`bucket_events`.
        """
        pipe = self.r.pipeline()
        pipe.set(self.keys.manifest(version), json.dumps(manifest))
        pipe.zadd(self.keys.weights_versions, {str(version): version})
        pipe.set(self.keys.weights_pending, version)
        pipe.publish(self.keys.weights_channel, f"begin:{version}")
        pipe.execute()

    def bucket_ready(self, version: int, index: int, checksum: str) -> None:
        """Announce that bucket ``index`` of ``version`` is in the data plane with ``checksum``."""
        self.r.xadd(self.keys.weights_buckets(version), {"i": index, "c": checksum})

    def bucket_events(self, version: int, after: str = "0", block_ms: int = 1000) -> tuple[list[tuple[int, str]], str]:
        """Bucket-ready events of ``version`` after stream id ``after``: ([(index, checksum)], last id)."""
        res = self.r.xread({self.keys.weights_buckets(version): after}, block=block_ms)
        out = []
        for _, entries in res or []:
            for eid, fields in entries:
                out.append((int(fields["i"]), fields["c"]))
                after = eid
        return out, after

    def pending_version(self) -> int:
        """The version being written now, or the newest complete one (-1 if none)."""
        raw = self.r.get(self.keys.weights_pending)
        return max(int(raw) if raw is not None else -1, self.current_version())

    def gc_versions(self, keep: int) -> list[int]:
        """Delete manifests and bucket streams of all but the newest ``keep`` versions, and the tensor
        tables no retained version names; returns the versions deleted."""
        old = [int(v) for v in self.r.zrange(self.keys.weights_versions, 0, -(keep + 1))]
        if old:
            pipe = self.r.pipeline()
            for v in old:
                pipe.delete(self.keys.manifest(v), self.keys.weights_buckets(v))
            pipe.zrem(self.keys.weights_versions, *map(str, old))
            pipe.execute()
            self._gc_tables(keys=[self.keys.weights_versions, self.keys.weights_tables],
                            args=[self.keys.weights_table("")])
        return old

    def subscribe_versions(self):
        """A pub/sub handle on version announcements (``"v"`` complete, ``"begin:v"`` writing).

        Pub/sub is lossy (a reconnect or a slow reader drops messages): callers must also poll
        :meth:`current_version`; :meth:`wait_version` does both.
        """
        ps = self.r.pubsub(ignore_subscribe_messages=True)
        ps.subscribe(self.keys.weights_channel)
        return ps

    def wait_version(self, after: int, timeout_s: float, pubsub=None, poll_s: float = 0.5,
                     include_pending: bool = False) -> int | None:
        """Block until a version newer than ``after`` exists; None on timeout.

        Wakes on a pub/sub message when ``pubsub`` is given, and in any case re-reads the
        version key every ``poll_s`` seconds, so a lost notification costs at most one poll.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            v = self.pending_version() if include_pending else self.current_version()
            if v > after:
                return v
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            wait = min(poll_s, left)
            if pubsub is not None:
                pubsub.get_message(timeout=wait)
            else:
                time.sleep(wait)

    def wait_acks(self, version: int, workers: list[int], timeout_s: float, poll_s: float = 0.002) -> bool:
        """True once every worker in ``workers`` acked ``version`` (or newer) within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            acks = self.acks()
            if all(acks.get(w, -1) >= version for w in workers):
                return True
            time.sleep(poll_s)
        return False

    def put_weight_timings(self, worker_id: int, timings: dict[str, float]) -> None:
        """Last weights-fetch timings of a worker (seconds per stage), for monitors and benchmarks."""
        self.r.hset(self.keys.weights_timings(worker_id), mapping={k: float(v) for k, v in timings.items()})

    def weight_timings(self, worker_id: int) -> dict[str, float]:
        return {k: float(v) for k, v in self.r.hgetall(self.keys.weights_timings(worker_id)).items()}

    def ack(self, worker_id: int, version: int) -> None:
        self.r.hset(self.keys.acks, str(worker_id), version)

    def acks(self) -> dict[int, int]:
        return {int(k): int(v) for k, v in self.r.hgetall(self.keys.acks).items()}

    # -- endpoints ---------------------------------------------------------------------------
    def set_endpoint(self, name: str, endpoint: str) -> None:
        self.r.set(self.keys.endpoint(name), endpoint)

    def get_endpoint(self, name: str) -> str | None:
        """The endpoint published under ``name`` now, or None (no waiting)."""
        return self.r.get(self.keys.endpoint(name))

    def wait_endpoint(self, name: str, timeout_s: float = 300.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ep = self.get_endpoint(name)
            if ep:
                return ep
            if self.stop_reason() is not None:
                raise RuntimeError(f"run stopped before endpoint {name!r} appeared")
            time.sleep(0.1)
        raise TimeoutError(f"endpoint {name!r} not published in Redis within {timeout_s:.0f} s "
                           f"(deadlines.endpoint_s)")

    # -- workers -----------------------------------------------------------------------------
    def next_incarnation(self, worker_id: int) -> int:
        """A new incarnation number for a starting worker (its trajectory ids carry it)."""
        return int(self.r.incr(self.keys.incarnation(worker_id)))

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
        """Reserve all ``groups`` prompt groups or none (a batch needs all), as the staleness budget
        allows: at most min(:meth:`staleness_bound`, ``max_staleness``) versions ahead of the learner."""
        return self._reserve_groups(groups, max_staleness, groups_per_step, all_or_nothing=True) == groups

    def try_reserve_up_to(self, groups: int, max_staleness: int, groups_per_step: int) -> int:
        """Reserve as many prompt groups as the staleness budget allows, at most ``groups``, in one
        atomic call (the rule of :meth:`try_reserve`); returns how many were reserved, 0..``groups``."""
        return max(self._reserve_groups(groups, max_staleness, groups_per_step, all_or_nothing=False), 0)

    def _reserve_groups(self, groups: int, max_staleness: int, groups_per_step: int, all_or_nothing: bool) -> int:
        k = self.keys
        return int(self._reserve(keys=[k.reserved, k.refunded, k.version, k.staleness_bound],
                                 args=[groups, max_staleness, groups_per_step, "1" if all_or_nothing else "0"]))

    def set_staleness_bound(self, bound: int) -> None:
        """Publish the admission bound the learner chose (:mod:`streamrl.learner.staleness_control`)."""
        self.r.set(self.keys.staleness_bound, int(bound))

    def staleness_bound(self) -> int | None:
        """The published admission bound, or None (workers then use their ``max_staleness``)."""
        raw = self.r.get(self.keys.staleness_bound)
        return int(raw) if raw is not None else None

    def set_capacity(self, accounted_groups: int) -> None:
        """Re-assert admission control: ``reserved - refunded := accounted_groups`` (groups already
        trained, dropped or buffered). Used after a resume or a Redis restart, when the counters
        are stale or gone; reservations of workers still generating are forgotten, which can admit
        at most their in-flight groups extra (the staleness filter still bounds what is trained)."""
        pipe = self.r.pipeline()
        pipe.set(self.keys.reserved, max(0, int(accounted_groups)))
        pipe.set(self.keys.refunded, 0)
        pipe.execute()

    def raise_counter(self, key: str, value: int) -> None:
        """``key := max(key, value)`` atomically (e.g. a worker's incarnation after a Redis restart)."""
        self._max_set(keys=[key], args=[int(value)])

    def held_groups(self) -> int:
        """Reservations not given back: ``reserved - refunded`` (trained, buffered, in flight or leaked)."""
        reserved, refunded = self.r.mget([self.keys.reserved, self.keys.refunded])
        return int(reserved or 0) - int(refunded or 0)

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
        self._publish_overlapped.close()
        self.r.close()
