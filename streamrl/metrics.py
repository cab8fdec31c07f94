"""Metric sinks: every process reports ``{namespaced_key: number}`` dicts.

Sinks are pluggable; :class:`NullSink` is the twin for tests. Redis reporting is batched by
:class:`RateLimitedRedisSink` so the hot path pays one pipeline round-trip per interval.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


class MetricSink(Protocol):
    def write(self, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class NullSink:
    def write(self, metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink:
    """One JSON object per line, flushed each write (a crash loses nothing written)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def write(self, metrics: dict[str, float]) -> None:
        self._f.write(json.dumps(metrics) + "\n")

    def close(self) -> None:
        self._f.close()


class RateLimitedRedisSink:
    """Report to Redis at most every ``interval_s``; failures are logged, never raised."""

    def __init__(self, coord, process: str, interval_s: float = 1.0):
        self.coord = coord
        self.process = process
        self.interval_s = interval_s
        self._last = 0.0
        self._pending: dict[str, float] = {}

    def write(self, metrics: dict[str, float], force: bool = False) -> None:
        self._pending.update(metrics)
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        try:
            self.coord.put_metrics(self.process, self._pending)
            self._pending = {}
        except Exception as e:  # metrics must never take a process down
            log.warning("metrics to Redis failed (%s); will retry", e)

    def close(self) -> None:
        self.write({}, force=True)
