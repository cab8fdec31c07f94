"""Metric sinks: JSONL, fan-out, batched non-blocking Redis (real server), TensorBoard files."""
from __future__ import annotations

import json
import socket
import time

import pytest

from streamrl.coord.coordinator import Coordinator, connect
from streamrl.metrics import JsonlSink, MultiSink, NullSink, RateLimitedRedisSink, TensorBoardSink, tensorboard_sink


class Boom:
    def write(self, metrics):
        raise RuntimeError("disk full")

    def close(self):
        raise RuntimeError("disk full")


def test_multisink_isolates_a_failing_sink(tmp_path):
    sink = MultiSink(Boom(), JsonlSink(tmp_path / "m.jsonl"), NullSink())
    for i in range(3):
        sink.write({"learner/step": i + 1, "learner/loss": 0.5 / (i + 1)})
    sink.close()
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["learner/step"] for r in rows] == [1, 2, 3]
    assert sink.writes == 3 and sink.write_s > 0


def test_redis_sink_batches_and_sums_counters(redis_url, run_id):
    coord = Coordinator(redis_url, run_id)
    sink = RateLimitedRedisSink(coord, "learner", interval_s=0.3)
    t0 = time.monotonic()
    steps = 0
    while time.monotonic() - t0 < 1.0:  # ~100 steps in 1 s, flushed ~4 times
        steps += 1
        sink.write({"learner/step": steps, "learner/trained_tokens": 10, "learner/trajectories": 2})
        time.sleep(0.01)
    sink.close()
    latest = coord.latest_metrics()["learner"]
    assert latest["learner/step"] == steps
    # batching keeps only the newest per-step value, the _total keys keep every step's count
    assert latest["learner/trained_tokens_total"] == 10 * steps
    assert latest["learner/trajectories_total"] == 2 * steps
    # stamped at the newest write, before the (background) push
    assert latest["time"] - 1.0 < latest["metrics/time"] <= latest["time"]
    entries = coord.r.xrange(coord.keys.metrics_stream)
    assert 2 <= len(entries) <= 8, f"{len(entries)} pipelines for {steps} writes: not batched"
    assert sink.failures == 0


def test_redis_stream_stays_bounded(redis_url, run_id):
    coord = Coordinator(redis_url, run_id)
    for i in range(2600):
        coord.put_metrics("learner", {"learner/step": i})
    n = coord.r.xlen(coord.keys.metrics_stream)
    assert n <= 2000 + 200, n  # approximate trimming (whole radix-tree nodes)
    assert len(coord.r.hgetall(coord.keys.metrics("learner"))) == 2  # one rolling hash: key + time


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


@pytest.mark.timeout(60)
def test_redis_down_never_blocks_the_caller():
    coord = Coordinator(_dead_url(), "nobody")
    coord.r = connect(coord.url, outage_s=0.1)  # fail in ~0.1 s, not after the default outage budget
    sink = RateLimitedRedisSink(coord, "learner", interval_s=0.05)
    worst = 0.0
    for i in range(50):
        t = time.perf_counter()
        sink.write({"learner/step": i, "learner/trained_tokens": 1})
        worst = max(worst, time.perf_counter() - t)
        time.sleep(0.01)
    assert worst < 0.05, f"a write blocked for {worst:.3f} s"
    deadline = time.monotonic() + 30
    while sink.failures == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sink.failures >= 1
    t = time.perf_counter()
    sink.close(timeout_s=1.0)
    assert time.perf_counter() - t < 3.0  # bounded even though Redis never answers
    assert sink._pending["learner/step"] == 49  # kept, not lost, while Redis is away
    assert sink._pending["learner/trained_tokens_total"] == 50


def test_tensorboard_sink_writes_readable_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = tensorboard_sink(tmp_path / "tb")
    assert isinstance(sink, TensorBoardSink)
    for step in range(1, 21):
        sink.write({"learner/step": step, "learner/reward_mean": step / 20, "moe/router_entropy/layer0": 0.9,
                    "bad": float("nan")})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "learner/reward_mean" in tags and "moe/router_entropy/layer0" in tags and "bad" not in tags
    events = acc.Scalars("learner/reward_mean")
    assert [e.step for e in events] == list(range(1, 21))
    assert events[-1].value == pytest.approx(1.0)
    assert sink.dropped == 0


@pytest.mark.slow
def test_wandb_sink_offline_needs_no_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from streamrl.config import load_config
    from streamrl.metrics import WandbSink, run_sinks

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config("configs/tiny.yaml", [f"run.run_dir={tmp_path}", "run.wandb=true"])
    sink = run_sinks(cfg, tmp_path)
    assert isinstance(sink.sinks[-1], WandbSink)
    for step in (1, 2, 3):
        sink.write({"learner/step": step, "learner/reward_mean": step / 10, "learner/nan": float("nan"),
                    "learner/label": "text"})
    sink.close()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 30  # wandb's service process may still be appending after finish()
    while b"learner/reward_mean" not in (data := run_file.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    # The run's records (protobuf) hold the logged keys; non-finite and non-numeric values are left out.
    assert b"learner/reward_mean" in data and b"learner/nan" not in data and b"learner/label" not in data
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
