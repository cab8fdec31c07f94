"""The one place that knows the Redis key schema of a run.

Everything of run ``R`` lives under ``streamrl:R:``. Redis holds small things only:
integers, JSON manifests, endpoints, heartbeats and metrics; never tensors.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    run: str

    def _k(self, *parts: object) -> str:
        return ":".join(["streamrl", self.run, *map(str, parts)])

    @property
    def config(self) -> str:  # JSON of the run config
        return self._k("config")

    @property
    def version(self) -> str:  # int: newest published weights version
        return self._k("weights", "version")

    def manifest(self, version: int) -> str:  # JSON manifest of one weights version
        return self._k("weights", "manifest", version)

    def weights_table(self, digest: str) -> str:  # JSON tensor table of a layout, by its SHA-256 (manifests name it)
        return self._k("weights", "table", digest)

    @property
    def weights_tables(self) -> str:  # sorted set: table digest -> newest version whose manifest names it (GC)
        return self._k("weights", "tables")

    @property
    def weights_channel(self) -> str:  # pub/sub: version announcements
        return self._k("weights", "events")

    @property
    def acks(self) -> str:  # hash worker_id -> version loaded
        return self._k("weights", "acks")

    def endpoint(self, name: str) -> str:  # data-plane endpoint string
        return self._k("endpoint", name)

    def incarnation(self, worker_id: int) -> str:  # int: INCR'd by each start of a worker (ids carry it)
        return self._k("incarnation", worker_id)

    @property
    def workers(self) -> str:  # set of worker ids ever registered
        return self._k("workers")

    def heartbeat(self, worker_id: int) -> str:  # TTL key, JSON status
        return self._k("heartbeat", worker_id)

    @property
    def stuck(self) -> str:  # hash process -> JSON of the last stall a launcher acted on (phase, since, why)
        return self._k("launch", "stuck")

    @property
    def reserved(self) -> str:  # int: prompt groups reserved by workers (admission control)
        return self._k("capacity", "reserved")

    @property
    def refunded(self) -> str:  # int: reservations given back (dropped or abandoned groups)
        return self._k("capacity", "refunded")

    @property
    def staleness_bound(self) -> str:  # int: admission bound the learner sets (adaptive staleness); absent = ceiling
        return self._k("capacity", "staleness_bound")

    @property
    def stop(self) -> str:  # str reason; present = the run is stopping
        return self._k("control", "stop")

    def metrics(self, process: str) -> str:  # hash of latest metrics of one process
        return self._k("metrics", process)

    @property
    def metrics_stream(self) -> str:  # capped stream of timestamped metric snapshots
        return self._k("metrics", "stream")

    @property
    def processes(self) -> str:  # set of process names that report metrics
        return self._k("metrics", "processes")

    # -- weights broadcast (owned by streamrl.weights; additive to the schema above) ----------
    @property
    def weights_versions(self) -> str:  # sorted set: version -> publish time (GC order)
        return self._k("weights", "versions")

    @property
    def weights_pending(self) -> str:  # int: version being written now (bucket events flow)
        return self._k("weights", "pending")

    def weights_buckets(self, version: int) -> str:  # stream of bucket-ready events of one version
        return self._k("weights", "buckets", version)

    def weights_timings(self, worker_id: int) -> str:  # hash: last fetch/verify/load timings of a worker
        return self._k("weights", "timings", worker_id)
