"""streamrl-monitor shows each Hybrid role server placed apart: throughput, batch time, lag, failures."""
from __future__ import annotations

import json
import subprocess

import pytest
from rich.console import Console

from streamrl.coord.coordinator import Coordinator
from monitor_helpers import empty_state
from streamrl.monitor.snapshot import SnapshotBuilder
from streamrl.monitor.ui import render


def _text(snap, width=130) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(render(snap, "redis://x"))
    return console.export_text()


def critic_at(t, traj, batches, score_s, step):
    """What a critic server reports (cumulative counters, streamrl.roles.token_server + critic)."""
    return {"time": t, "critic/trajectories": traj, "critic/batches": batches, "critic/score_s": score_s,
            "critic/rejected": 0.0, "critic/errors": 0.0, "critic/step": step, "critic/explained_variance": 0.42,
            "critic/value_loss": 0.07}


def test_role_rows_from_server_metrics():
    history = {"critic": [critic_at(90.0, 64.0, 2.0, 0.5, 2.0), critic_at(98.0, 320.0, 10.0, 2.5, 10.0)],
               "reference": [{"time": 91.0, "reference/trajectories": 0.0, "reference/batches": 0.0,
                              "reference/score_s": 0.0, "reference/rejected": 0.0, "reference/errors": 0.0},
                             {"time": 99.0, "reference/trajectories": 128.0, "reference/batches": 4.0,
                              "reference/score_s": 0.4, "reference/rejected": 3.0, "reference/errors": 0.0}]}
    state = empty_state(100.0)
    state.latest = {k: v[-1] for k, v in history.items()}
    roles = SnapshotBuilder(window_s=20.0).build("r", history, state)["roles"]
    assert roles["critic"]["trajectories_per_s"] == pytest.approx(256 / 8)
    assert roles["critic"]["score_s_per_batch"] == pytest.approx(2.0 / 8)
    assert roles["critic"]["last_report_s"] == pytest.approx(2.0) and roles["critic"]["step"] == 10.0
    assert roles["reference"]["trajectories_per_s"] == pytest.approx(16.0) and roles["reference"]["rejected"] == 3.0
    for width in (130, 80):
        text = _text(SnapshotBuilder(window_s=20.0).build("r", history, state), width)
        assert "critic traj/s" in text and "250.0 ms" in text and "10 / 0.42" in text
        assert "reference last report" in text and "1.00 s ago" in text and "3 / 0 bad" in text


def test_runs_without_role_servers_show_none():
    state = empty_state(100.0)
    state.latest = {"rollout-0": {"rollout/generated_tokens": 10.0}}
    snap = SnapshotBuilder().build("r", {"rollout-0": [{"time": 99.0, "rollout/generated_tokens": 10.0}]}, state)
    assert "roles" not in snap and "last report" not in _text(snap)


def test_monitor_cli_json_lists_a_role_server(redis_url, run_id, python):
    coord = Coordinator(redis_url, run_id)
    coord.put_config({"run": {"name": "roles"}})
    coord.put_metrics("learner", {"learner/step": 3, "learner/samples": 192})
    coord.put_metrics("reference", {"reference/trajectories": 64.0, "reference/batches": 2.0,
                                    "reference/score_s": 0.2, "reference/rejected": 0.0, "reference/errors": 1.0})
    p = subprocess.run([python, "-m", "streamrl.monitor.cli", "--redis-url", redis_url, "--run-id", run_id,
                        "--once", "--json"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    ref = json.loads(p.stdout)["roles"]["reference"]
    assert ref["errors"] == 1.0 and ref["last_report_s"] is not None
