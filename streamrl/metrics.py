"""Metric sinks: every process reports ``{namespaced_key: number}`` dicts.

Sinks are pluggable; :class:`NullSink` is the twin for tests. The hot path (a learner step,
a rollout batch) only ever pays for a dict merge or a queue put: Redis and TensorBoard
writes happen on daemon threads, batched, and a failing backend is logged, never raised.

    sink = MultiSink(JsonlSink(run_dir / "metrics.jsonl"), tensorboard_sink(run_dir / "tb"))
    sink.write({"learner/step": 1, "learner/loss": 0.3})   # ~µs on the caller
    sink.close()                                              # flushes everything

Redis stays bounded: :meth:`Coordinator.put_metrics` overwrites one hash per process and
appends to a capped stream (``stream_maxlen``), so memory does not grow with run length.
"""
from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

# Per-step counters that batching would otherwise lose (the Redis sink keeps only the newest
# value of each key between flushes): they are also summed into ``<key>_total``, from which
# the monitor computes exact rates.
DEFAULT_SUM_KEYS = ("learner/trained_tokens", "learner/trajectories")
# Wall time of the newest write in a Redis batch (``time`` is when the batch was pushed).
WRITE_TIME_KEY = "metrics/time"


class MetricSink(Protocol):
    def write(self, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """Accepts everything, keeps nothing (the twin for tests and disabled backends)."""

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


class MultiSink:
    """Fan out to several sinks; one failing sink never stops the others or the caller.

    ``write_s`` accumulates the time callers spent inside :meth:`write` (the monitoring
    overhead on the hot path); ``writes`` counts calls.
    """

    def __init__(self, *sinks: MetricSink):
        self.sinks = list(sinks)
        self.write_s = 0.0
        self.writes = 0

    def write(self, metrics: dict[str, float]) -> None:
        t0 = time.perf_counter()
        for s in self.sinks:
            try:
                s.write(metrics)
            except Exception as e:  # metrics must never take a process down
                log.warning("metrics sink %s failed: %s", type(s).__name__, e)
        self.write_s += time.perf_counter() - t0
        self.writes += 1

    def close(self) -> None:
        for s in self.sinks:
            try:
                s.close()
            except Exception as e:
                log.warning("closing metrics sink %s failed: %s", type(s).__name__, e)


class RateLimitedRedisSink:
    """Report to Redis at most every ``interval_s``, from a daemon thread.

    :meth:`write` merges into a pending dict under a lock and returns (microseconds); the
    thread pushes the merged dict with one pipeline (:meth:`Coordinator.put_metrics`). A
    Redis outage costs the thread retries, never the caller; unsent values are kept (newest
    wins) and go out once Redis is back. Keys in ``sum_keys`` are also summed into
    ``<key>_total`` so no per-step count is lost to batching.
    """

    def __init__(self, coord, process: str, interval_s: float = 1.0,
                 sum_keys: tuple[str, ...] = DEFAULT_SUM_KEYS):
        if interval_s <= 0:
            raise ValueError(f"interval_s = {interval_s}: must be > 0")
        self.coord = coord
        self.process = process
        self.interval_s = interval_s
        self.sum_keys = tuple(sum_keys)
        self.failures = 0
        self.flushes = 0
        self._totals: dict[str, float] = {}
        self._pending: dict[str, float] = {}
        self._last = 0.0
        self._last_log = 0.0
        self._force = False
        self._closed = False
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def write(self, metrics: dict[str, float], force: bool = False) -> None:
        with self._lock:
            self._pending.update(metrics)
            # when these values were current: a delayed push must not skew the monitor's rates
            self._pending[WRITE_TIME_KEY] = time.time()
            for k in self.sum_keys:
                if k in metrics:
                    self._totals[k] = self._totals.get(k, 0.0) + float(metrics[k])
                    self._pending[k + "_total"] = self._totals[k]
            self._force |= force
            due = self._force or time.monotonic() - self._last >= self.interval_s
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name=f"metrics-{self.process}", daemon=True)
            self._thread.start()
        if due:
            self._wake.set()

    def flush(self) -> bool:
        """Push pending metrics now, on the calling thread. Returns False if Redis failed."""
        with self._flush_lock:
            with self._lock:
                pending, self._pending = self._pending, {}
                self._force = False
                self._last = time.monotonic()
            if not pending:
                return True
            try:
                self.coord.put_metrics(self.process, pending)
                self.flushes += 1
                return True
            except Exception as e:  # metrics must never take a process down
                with self._lock:  # keep them for the next try; newer values win
                    self._pending = {**pending, **self._pending}
                self.failures += 1
                now = time.monotonic()
                if now - self._last_log > 30.0:
                    self._last_log = now
                    log.warning("metrics to Redis failed (%s); will retry (%d failures)", e, self.failures)
                return False

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._closed:
                break
            with self._lock:
                due = self._pending and (self._force or time.monotonic() - self._last >= self.interval_s)
            if due:
                self.flush()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and push what is pending (bounded by ``timeout_s``)."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        done = threading.Thread(target=self.flush, daemon=True)
        done.start()
        done.join(timeout_s)  # a dead Redis must not hang the process at exit


class TensorBoardSink:
    """TensorBoard event files: one ``Event`` (all scalars of a write) per step.

    :meth:`write` only enqueues (bounded; when full, the write is dropped and counted in
    ``dropped``); a daemon thread builds the protobuf and appends it with tensorboard's
    ``EventFileWriter``. The step is ``metrics[step_key]`` when present, else a counter.
    Non-numeric and non-finite values are skipped.
    """

    def __init__(self, logdir: str | Path, step_key: str = "learner/step", max_queue: int = 1000,
                 flush_secs: float = 5.0):
        from tensorboard.compat.proto import event_pb2, summary_pb2  # noqa: PLC0415  (optional dep)
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: PLC0415

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.step_key = step_key
        self.dropped = 0
        self._count = 0
        self._writer = EventFileWriter(str(self.logdir), max_queue_size=100, flush_secs=flush_secs)
        self._q: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="metrics-tensorboard", daemon=True)
        self._thread.start()

    def write(self, metrics: dict[str, float]) -> None:
        self._count += 1
        step = metrics.get(self.step_key, self._count)
        try:
            self._q.put_nowait((int(step), time.time(), dict(metrics)))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            step, wall, metrics = item
            try:
                values = [self._summary_pb2.Summary.Value(tag=k, simple_value=float(v))
                          for k, v in metrics.items()
                          if isinstance(v, (int, float)) and math.isfinite(v)]
                summary = self._summary_pb2.Summary(value=values)
                self._writer.add_event(self._event_pb2.Event(wall_time=wall, step=step, summary=summary))
            except Exception as e:  # a bad value or a full disk must not kill the thread silently
                log.warning("tensorboard write failed: %s", e)

    def close(self, timeout_s: float = 10.0) -> None:
        self._q.put(None)
        self._thread.join(timeout_s)
        self._writer.close()


def tensorboard_sink(logdir: str | Path, **kwargs) -> MetricSink:
    """A :class:`TensorBoardSink`, or a :class:`NullSink` (with a warning) when the
    ``tensorboard`` package is missing (e.g. on a machine without a package index)."""
    try:
        return TensorBoardSink(logdir, **kwargs)
    except ImportError as e:
        log.warning("tensorboard not installed (%s); no event files in %s", e, logdir)
        return NullSink()


class WandbSink:
    """A Weights & Biases run: one ``run.log(metrics, step=...)`` per write, off the hot path.

    :meth:`write` only enqueues (bounded, like :class:`TensorBoardSink`); a daemon thread
    calls wandb. ``WANDB_MODE=offline`` writes the run under ``RUN_DIR/wandb`` with no network
    (``wandb sync`` uploads it later). Non-numeric and non-finite values are skipped.
    """

    def __init__(self, run_dir: str | Path, name: str, project: str, config: dict | None = None,
                 step_key: str = "learner/step", max_queue: int = 1000):
        import wandb  # noqa: PLC0415  (optional dependency: the `wandb` extra)

        self.step_key = step_key
        self.dropped = 0
        self._count = 0
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, name=name, dir=str(run_dir), config=config or {},
                               reinit="create_new")
        self._q: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._loop, name="metrics-wandb", daemon=True)
        self._thread.start()

    def write(self, metrics: dict[str, float]) -> None:
        self._count += 1
        step = int(metrics.get(self.step_key, self._count))
        try:
            self._q.put_nowait((step, dict(metrics)))
        except queue.Full:
            self.dropped += 1

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            step, metrics = item
            try:
                self._run.log({k: v for k, v in metrics.items()
                               if isinstance(v, (int, float)) and math.isfinite(v)}, step=step)
            except Exception as e:  # a wandb failure must not kill the run
                log.warning("wandb log failed: %s", e)

    def close(self, timeout_s: float = 30.0) -> None:
        self._q.put(None)
        self._thread.join(timeout_s)
        self._run.finish()


def wandb_available() -> bool:
    """Whether the optional ``wandb`` package can be imported."""
    try:
        import wandb  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def wandb_sink(run_dir: str | Path, name: str, project: str, config: dict | None = None) -> MetricSink:
    """A :class:`WandbSink`, or a :class:`NullSink` with a warning when wandb cannot start a run
    (no API key while online, ...); a missing package is a preflight error, not this."""
    try:
        return WandbSink(run_dir, name, project, config)
    except Exception as e:  # noqa: BLE001 (wandb raises many kinds; the run goes on without it)
        log.warning("wandb disabled: %s (set WANDB_MODE=offline to log without an account or network)", e)
        return NullSink()


def run_sinks(cfg, run_dir: str | Path) -> MultiSink:
    """The learner's sinks for a run: JSONL and TensorBoard always, wandb when ``run.wandb``.

    Args:
        cfg: the run's :class:`~streamrl.config.Config`.
        run_dir: where ``metrics.jsonl``, ``tb/`` and ``wandb/`` go.
    """
    run_dir = Path(run_dir)
    sinks: list[MetricSink] = [JsonlSink(run_dir / "metrics.jsonl"), tensorboard_sink(run_dir / "tb")]
    if cfg.run.wandb:
        sinks.append(wandb_sink(run_dir, cfg.run.name, cfg.run.wandb_project, cfg.to_dict()))
    return MultiSink(*sinks)
