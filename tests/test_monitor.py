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
from monitor_helpers import empty_state
from streamrl.monitor.snapshot import SnapshotBuilder, counter_rate
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


def _simulate(coord: Coordinator, steps: int, dt: float = 0.05, workers=(0, 1), learner_extra=None,
              worker_extra=None):
    """A learner and workers reporting like the real ones (cumulative counters).
    ``learner_extra(step)`` / ``worker_extra(worker, step)``: more metrics for that report."""
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
            "transport/trajectories": 64 * s + 32, **(learner_extra(s) if learner_extra else {}),
        })
        for w in workers:
            coord.put_metrics(f"rollout-{w}", {"rollout/generated_tokens": 200 * s, "rollout/trajectories": 32 * s,
                                               "rollout/version": s - 1, "rollout/reward_mean": 0.2,
                                               "rollout/weights_load_s": 0.003,
                                               **(worker_extra(w, s) if worker_extra else {})})
            coord.heartbeat(w, {"host": "h", "pid": 1, "device": "cpu", "version": s - 1,
                                "state": "running", "incarnation": 1})
        coord.r.set(coord.keys.version, s)
        time.sleep(dt)


@pytest.fixture
def simulated(redis_url, run_id):
    coord = Coordinator(redis_url, run_id)
    coord.put_config({"run": {"name": "sim"}})
    for w in (0, 1):
        coord.r.set(coord.keys.incarnation(w), 1)
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
    # no critic, no leases, no in-flight updates: none of their keys or lines
    assert "critic" not in snap and "credit" not in snap
    assert not {"retained_versions", "inflight_loads"} & set(snap["weights"])
    assert all("inflight_loads" not in w for w in snap["workers"])
    for absent in ("critic", "retained", "in-flight", "advantage credit"):
        assert absent not in text, absent


def test_worker_status_stale_restarting_dead(simulated, redis_url, run_id):
    coord, _ = simulated
    builder = SnapshotBuilder(window_s=30)
    source = RunSource(redis_url, run_id)
    take_snapshot(source, builder)  # remembers incarnation 1 of both workers
    # worker 0: a new process registered (incarnation 2) but has not heartbeated yet
    coord.r.incr(coord.keys.incarnation(0))
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


def _critic_metrics(s: int) -> dict[str, float]:
    """A V-trace learner's extra metrics: the critic learns (loss down, EV up); two leased versions."""
    return {"learner/value_loss": 1.0 / s, "learner/value_mean": 0.02 * s, "learner/vtrace_target_mean": 0.5,
            "learner/explained_variance": -0.5 + s / 20, "learner/vtrace_advantage_abs_mean": 0.3,
            "weights/retained_versions": 2.0, "weights/served_bytes": 1e6 * s}


def _render_text(snap, width=130) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(render(snap, "redis://x"))
    return console.export_text()


@pytest.fixture
def simulated_vtrace(redis_url, run_id):
    """A V-trace run with read leases and in-flight weight updates on worker 1 only."""
    coord = Coordinator(redis_url, run_id)
    coord.put_config({"run": {"name": "sim"}, "learner": {"loss": "vtrace", "advantage": "token"}})
    for w in (0, 1):
        coord.r.set(coord.keys.incarnation(w), 1)
    _simulate(coord, 20, learner_extra=_critic_metrics,
              worker_extra=lambda w, s: {"rollout/inflight_loads": float(w * (s // 4))})
    yield coord
    coord.close()


def test_new_signals_in_snapshot_and_screen(simulated_vtrace, redis_url, run_id, python):
    builder = SnapshotBuilder(window_s=30)
    source = RunSource(redis_url, run_id)
    snap = take_snapshot(source, builder)
    c = snap["critic"]
    # window means over the learner reports of the last 30 s (all 20 here), as for reward_mean
    learner = list(source.history["learner"])
    assert len(learner) == 20
    assert c["value_loss"] == pytest.approx(sum(e["learner/value_loss"] for e in learner) / 20)
    assert c["explained_variance"] == pytest.approx(sum(-0.5 + s / 20 for s in range(1, 21)) / 20)
    assert c["value_mean"] == pytest.approx(0.02 * 21 / 2) and c["advantage_abs_mean"] == pytest.approx(0.3)
    assert c["target_mean"] == pytest.approx(0.5)
    assert snap["weights"]["retained_versions"] == 2.0
    assert snap["weights"]["inflight_loads"] == 20 // 4  # worker 0 none, worker 1 five loads
    assert {w["id"]: w["inflight_loads"] for w in snap["workers"]} == {0: 0.0, 1: 5.0}
    assert snap["credit"] == {"advantage": "token"}  # RunSource reads the run's stored config

    text = _render_text(snap)
    assert "critic loss / EV" in text and "critic V / |A| vtrace" in text
    assert f"{c['value_loss']:.3g} / {c['explained_variance']:.3g}" in text
    assert "retained (leased)" in text and "in-flight loads" in text and "infl  state" in text.split("Workers")[1]
    for section in SECTIONS:
        assert section in text, section
    narrow = _render_text(snap, width=80)  # 80 columns: the extra rows fit, nothing dropped
    assert "critic loss / EV" in narrow and "retained (leased)" in narrow and "infl" in narrow and "alive" in narrow

    # --once --json: the same new keys, the old ones unchanged
    p = subprocess.run([python, "-m", "streamrl.monitor.cli", "--redis-url", redis_url, "--run-id", run_id,
                        "--once", "--json", "--window", "30"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    js = json.loads(p.stdout)
    assert js["critic"]["value_loss"] == pytest.approx(c["value_loss"])
    assert js["weights"]["retained_versions"] == 2.0 and js["weights"]["inflight_loads"] == 5.0
    assert set(js) - {"critic", "credit"} == set(SnapshotBuilder().build("r", {}, empty_state()))


def test_credit_mode_and_negative_ev_flag():
    state = empty_state(100.0)
    state.config = {"learner": {"advantage": "token"}}  # a State that carries the run's config
    learner = [{"time": 99.0, "learner/step": 1, "learner/value_loss": 0.5, "learner/explained_variance": -0.25}]
    snap = SnapshotBuilder().build("r", {"learner": learner}, state)
    assert snap["credit"] == {"advantage": "token"}
    assert snap["critic"]["explained_variance"] == -0.25 and snap["critic"]["value_mean"] is None
    text = _render_text(snap)
    assert "advantage credit" in text and "token" in text and "-0.25 low" in text
    state.config = {"learner": {"advantage": "sequence"}}  # the default is not worth a line
    assert "advantage credit" not in _render_text(SnapshotBuilder().build("r", {"learner": learner}, state))


def test_inflight_counter_at_zero_stays_off_screen():
    """Today's rollout workers always report rollout/inflight_loads (0 with in-flight updates
    off): the JSON carries the zeros, the screen shows no column or row for them."""
    state = empty_state(100.0)
    state.heartbeats = {0: {"time": 99.5, "version": 0, "incarnation": 1}}
    state.incarnations = {0: 1}
    state.latest = {"rollout-0": {"rollout/inflight_loads": 0.0}}
    snap = SnapshotBuilder().build("r", {"rollout-0": [{"time": 99.0, "rollout/inflight_loads": 0.0}]}, state)
    assert snap["weights"]["inflight_loads"] == 0 and snap["workers"][0]["inflight_loads"] == 0
    text = _render_text(snap)
    assert "alive" in text and "infl" not in text and "in-flight" not in text


def test_learning_diagnostics_in_snapshot_and_screen():
    """Response lengths, truncation, entropy, ESS / clip / behaviour KL, staleness against its bound
    and the workers' reward per task: window means in the snapshot, one row each on screen."""
    state = empty_state(100.0)
    state.latest = {"rollout-0": {"rollout/task_reward/chain_sum": 0.2, "rollout/task_reward/gcd": 0.6},
                    "rollout-1": {"rollout/task_reward/chain_sum": 0.4}}
    learner = [{"time": 98.0 + i, "learner/step": i, "learner/response_len_mean": 100.0 + 10 * i,
                "learner/response_len_p90": 300.0, "learner/truncated_frac": 0.1, "learner/entropy": 0.7,
                "learner/is_ess": 0.95, "learner/clip_frac": 0.02, "learner/kl_behaviour": 0.004,
                "learner/staleness_max": 3.0, "learner/staleness_bound": 4.0} for i in (1, 2)]
    state.latest["learner"] = learner[-1]
    snap = SnapshotBuilder(window_s=30).build("r", {"learner": learner, "rollout-0": [], "rollout-1": []}, state)
    g = snap["learning"]
    assert g["response_len_mean"] == pytest.approx(115.0) and g["truncated_frac"] == pytest.approx(0.1)
    assert g["is_ess"] == pytest.approx(0.95) and g["staleness_bound"] == 4.0
    assert g["task_reward"] == {"chain_sum": pytest.approx(0.3), "gcd": pytest.approx(0.6)}
    text = _render_text(snap)
    for row in ("response len mean / p90", "115 / 300", "truncated at the limit", "IS ESS / clip frac",
                "0.95 / 2 %", "behaviour KL", "staleness max / bound", "3 / 4", "reward chain_sum", "reward gcd"):
        assert row in text, row
    assert "learning" not in SnapshotBuilder().build("r", {}, empty_state())  # absent without the signals
