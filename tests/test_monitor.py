"""streamrl-monitor without a training run: rates, worker status, rendering, Redis down.

Runs are simulated by writing through the real Coordinator into a real redis-server; the
real-run check (a launched job) is in test_monitor_run.py.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
from rich.console import Console

from streamrl.coord.coordinator import Coordinator
from streamrl.monitor.cli import take_snapshot
from streamrl.monitor.snapshot import SnapshotBuilder, counter_rate, empty_state
from streamrl.monitor.source import RedisUnavailable, RunSource, newest_run, resolve_target
from streamrl.monitor.ui import render, sparkline

SECTIONS = ("Totals", "History", "Staleness", "Weights", "MoE router", "Workers")


def test_counter_rate_handles_restarts():
    rows = [{"time": t, "c": v} for t, v in [(0, 0), (1, 100), (2, 200), (3, 50), (4, 150)]]
    # 100 + 100 + (restart: 50 from zero) + 100 over 4 s
    assert counter_rate(rows, "c", 0, 4)["rate"] == pytest.approx(350 / 4)
    assert counter_rate(rows, "c", 3.5, 4) is None  # one point: no rate


def test_sparkline_scales_and_gaps():
    assert sparkline([0, 1, 2, 4]) == "▁▃▅█"  # 7 levels above the floor, rounded
    assert sparkline([None, 1.0]) == " █"


def _simulate(coord: Coordinator, steps: int, dt: float = 0.05, workers=(0, 1)):
    """A learner and workers reporting like the real ones (cumulative counters)."""
    for s in range(1, steps + 1):
        coord.put_metrics("learner", {
            "learner/step": s, "learner/samples": 64 * s, "learner/trained_tokens_total": 384 * s,
            "learner/step_s": 0.03, "learner/idle_frac": 0.25, "learner/reward_mean": 0.1 + s / 100,
            "learner/buffer_trajectories": 32, "learner/behaviour_logprob_abs_diff": 0.01,
            "learner/staleness_mean": 1.0, "learner/staleness_hist/0": 64.0 * s / 2,
            "learner/staleness_hist/1": 64.0 * s / 2, "learner/samples_dropped_stale": 8,
            "weights/bytes": 5e5, "weights/gather_s": 0.002, "weights/write_s": 0.004,
            "moe/router_entropy/layer0": 0.9, "moe/expert_usage_std/layer0": 0.2,
            "moe/router_entropy/layer1": 0.2, "moe/expert_usage_std/layer1": 1.3,
            "transport/trajectories": 64 * s + 32,
        })
        for w in workers:
            coord.put_metrics(f"rollout-{w}", {"rollout/generated_tokens": 200 * s, "rollout/trajectories": 32 * s,
                                               "rollout/version": s - 1, "rollout/reward_mean": 0.2,
                                               "rollout/weights_load_s": 0.003})
            coord.heartbeat(w, {"host": "h", "pid": 1, "device": "cpu", "version": s - 1,
                                "state": "running", "incarnation": 1})
        coord.r.set(coord.keys.version, s)
        time.sleep(dt)


@pytest.fixture
def simulated(redis_url, run_id):
    coord = Coordinator(redis_url, run_id)
    coord.put_config({"run": {"name": "sim"}})
    for w in (0, 1):
        coord.r.set(f"streamrl:{run_id}:incarnation:{w}", 1)
    t0 = time.time()
    _simulate(coord, 20)
    yield coord, time.time() - t0
    coord.close()


def test_snapshot_rates_and_sections(simulated, redis_url, run_id):
    coord, elapsed = simulated
    source = RunSource(redis_url, run_id)
    snap = take_snapshot(source, SnapshotBuilder(window_s=30))
    t = snap["totals"]
    # 19 increments of 64 samples between the first and the last learner report
    t0, t1 = snap["window"]["learner"]
    assert t["trained_trajectories_per_s"] == pytest.approx(19 * 64 / (t1 - t0))
    assert t["trained_tokens_per_s"] == pytest.approx(6 * t["trained_trajectories_per_s"])
    assert t["generated_tokens_per_s"] == pytest.approx(2 * 200 * 19 / (t1 - t0), rel=0.1)
    assert t["trajectories_per_s"] == pytest.approx(2 * 32 * 19 / (t1 - t0), rel=0.1)
    assert t["version"] == 20 and t["queue_depth"] == 32 and t["learner_idle_frac"] == pytest.approx(0.25)
    assert snap["staleness"]["histogram"] == {"0": 640.0, "1": 640.0}
    assert snap["staleness"]["histogram_source"] == "learner"
    levels = [(layer["entropy_level"], layer["usage_level"]) for layer in snap["moe"]["layers"]]
    assert levels == [("ok", "ok"), ("bad", "bad")]
    assert snap["weights"]["write_gbps"] == pytest.approx(5e5 / 0.004 / 1e9)
    assert [(w["id"], w["status"], w["lag"]) for w in snap["workers"]] == [(0, "alive", 1), (1, "alive", 1)]
    assert sum(snap["history"]["trained_trajectories_per_s"]) > 0

    console = Console(record=True, width=130, color_system=None)
    console.print(render(snap, redis_url))
    text = console.export_text()
    for section in SECTIONS:
        assert section in text, section
    assert "trained tokens/s" in text and "lag 1" in text and "alive" in text
    assert "0.2 BAD" in text and "1.3 BAD" in text  # layer 1 collapsed: entropy and usage both flagged


def test_worker_status_stale_restarting_dead(simulated, redis_url, run_id):
    coord, _ = simulated
    builder = SnapshotBuilder(window_s=30)
    source = RunSource(redis_url, run_id)
    take_snapshot(source, builder)  # remembers incarnation 1 of both workers
    # worker 0: a new process registered (incarnation 2) but has not heartbeated yet
    coord.r.incr(f"streamrl:{run_id}:incarnation:0")
    # worker 1: heartbeat expired (TTL gone)
    coord.r.delete(coord.keys.heartbeat(1))
    coord.heartbeat(2, {"host": "h", "device": "cpu", "version": 3, "state": "running", "incarnation": 1})
    state = source.refresh()
    state.heartbeats[2]["time"] -= 10  # stale: alive key, old heartbeat
    snap = builder.build(run_id, {p: list(h) for p, h in source.history.items()}, state)
    status = {w["id"]: w["status"] for w in snap["workers"]}
    assert status == {0: "restarting", 1: "dead", 2: "stale"}
    coord.request_stop("completed")
    snap = take_snapshot(source, builder)
    assert snap["status"] == "ended: completed"
    assert {w["id"]: w["status"] for w in snap["workers"]}[1] == "exited"


def test_newest_run_is_picked(redis_url, run_id):
    old, new = Coordinator(redis_url, run_id + "-old"), Coordinator(redis_url, run_id + "-new")
    for c in (old, new):
        c.put_config({})
    new.put_metrics("learner", {"learner/step": 1})
    time.sleep(0.01)
    old.put_metrics("learner", {"learner/step": 1})  # old run id, newest activity
    assert newest_run(old.r) == run_id + "-old"


def test_render_before_data_and_empty_run():
    snap = SnapshotBuilder().build("r", {}, empty_state())
    console = Console(record=True, width=120, color_system=None)
    console.print(render(snap, "redis://x", error="Redis at redis://x unreachable"))
    text = console.export_text()
    assert "waiting for data" in text and "unreachable" in text and "no rollout workers" in text
    console.print(render(None, "redis://x"))


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}/0"


@pytest.mark.timeout(60)
def test_cli_redis_down_once_and_live(tmp_path, python):
    url = _dead_url()
    t = time.monotonic()
    p = subprocess.run([python, "-m", "streamrl.monitor.cli", "--redis-url", url, "--once", "--json"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "unreachable" in p.stderr and p.stdout == ""
    assert time.monotonic() - t < 20
    # a finished run dir: the message says the run ended
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "gone", "redis_url": url}))
    (tmp_path / "summary.json").write_text("{}")
    p = subprocess.run([python, "-m", "streamrl.monitor.cli", str(tmp_path), "--once"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "run has ended" in p.stderr
    # live mode keeps trying and says so
    p = subprocess.run([python, "-m", "streamrl.monitor.cli", "--redis-url", url, "--iterations", "2",
                        "--interval", "0.2"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "unreachable" in p.stdout and "retrying" in p.stdout


def test_cli_arguments(tmp_path, python):
    with pytest.raises(ValueError, match="run.json"):
        resolve_target(str(tmp_path), None, None)
    with pytest.raises(ValueError, match="--redis-url"):
        resolve_target(None, None, None)
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "abc", "redis_url": "redis://h:1/0"}))
    assert resolve_target(str(tmp_path), None, None) == ("redis://h:1/0", "abc")
    assert resolve_target(str(tmp_path), "redis://o:2/0", "x") == ("redis://o:2/0", "x")
    with pytest.raises(RedisUnavailable):
        RunSource(_dead_url(), "abc").refresh()


def test_cli_once_json_on_simulated_run(simulated, redis_url, run_id, python):
    p = subprocess.run([python, "-m", "streamrl.monitor.cli", "--redis-url", redis_url, "--run-id", run_id,
                        "--once", "--json", "--window", "30"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    snap = json.loads(p.stdout)
    assert snap["run_id"] == run_id and snap["totals"]["trained_trajectories_per_s"] > 0
    p = subprocess.run([python, "-m", "streamrl.monitor.cli", "--redis-url", redis_url, "--run-id", run_id + "x",
                        "--once"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "not found" in p.stderr
