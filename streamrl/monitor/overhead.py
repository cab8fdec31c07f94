"""What metrics reporting costs a learner step: replay a run's metrics through the real sinks.

    python -m streamrl.monitor.overhead RUN_DIR --redis-url redis://127.0.0.1:6379/0

Replays every row of ``RUN_DIR/metrics.jsonl`` (the learner's real dicts: ~40 keys) through
the sinks the learner uses — JSONL, the batched Redis sink, TensorBoard — and divides by the
median ``learner/step_s`` of that same run. Two figures:

* ``hot_path_frac``: time the calling (training) thread spends in ``write`` per step;
* ``cpu_frac``: all CPU the process spends on metrics per step, background threads included,
  with one Redis pipeline per ``interval_s`` charged at its measured cost (an upper bound:
  the replay cannot overlap anything).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from streamrl.coord.coordinator import Coordinator
from streamrl.metrics import JsonlSink, MultiSink, RateLimitedRedisSink, TensorBoardSink


def measure(rows: list[dict], redis_url: str, workdir: str | Path, interval_s: float = 1.0) -> dict[str, float]:
    """Overhead figures for ``rows`` (learner metric dicts with ``learner/step_s``)."""
    if not rows:
        raise ValueError("rows: empty (no learner steps to replay)")
    step_s = statistics.median(r["learner/step_s"] for r in rows if "learner/step_s" in r)
    workdir = Path(workdir)
    coord = Coordinator(redis_url, f"overhead-{uuid.uuid4().hex[:8]}")
    try:
        redis_sink = RateLimitedRedisSink(coord, "learner", interval_s=interval_s)
        sink = MultiSink(JsonlSink(workdir / "metrics.jsonl"), redis_sink, TensorBoardSink(workdir / "tb"))
        cpu0 = time.process_time()
        for r in rows:
            sink.write(r)
        sink.close()  # drains the TensorBoard queue and pushes the last Redis batch
        cpu_local = time.process_time() - cpu0
        n = 20  # one Redis pipeline, measured on its own
        t0 = time.perf_counter()
        for r in rows[:n]:
            coord.put_metrics("learner", r)
        pipeline_s = (time.perf_counter() - t0) / min(n, len(rows))
        coord.r.delete(*coord.r.keys(f"streamrl:{coord.keys.run}:*"))
    finally:
        coord.close()
    hot = sink.write_s / sink.writes
    cpu = cpu_local / len(rows) + pipeline_s * step_s / interval_s
    return {"steps": len(rows), "keys_per_step": statistics.median(len(r) for r in rows),
            "step_s": step_s, "hot_path_s": hot, "cpu_s": cpu, "redis_pipeline_s": pipeline_s,
            "hot_path_frac": hot / step_s, "cpu_frac": cpu / step_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="run directory with metrics.jsonl")
    p.add_argument("--redis-url", required=True, help="a Redis to write to (keys are deleted afterwards)")
    args = p.parse_args(argv)
    path = Path(args.run_dir) / "metrics.jsonl"
    if not path.is_file():
        print(f"overhead: {path}: not found", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        out = measure(rows, args.redis_url, tmp)
    print(f"metrics overhead per learner step ({out['keys_per_step']:.0f} keys, step {1000 * out['step_s']:.1f} ms): "
          f"hot path {1e6 * out['hot_path_s']:.0f} us = {100 * out['hot_path_frac']:.3f} %, "
          f"all CPU {1e6 * out['cpu_s']:.0f} us = {100 * out['cpu_frac']:.3f} %")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
